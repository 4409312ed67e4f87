"""CPU threads: handing the OpenMP workers of the thread that loaded the models over to the
thread that will run them.

torch runs its CPU ops on OpenMP (libgomp in the PyPI wheels), which keeps a pool of worker
threads per thread that has run a parallel op. A server loads and warms its pair on one thread
and runs every forward on its engine thread; the loading thread's pool stays, libgomp then
counts more threads than cores and stops its workers spinning between ops, so each parallel op
of the engine thread waits for its workers to wake: on a 2-core CPU an int8 product or a matvec
took 15-35% longer than the same op on the loading thread, and the served engine decoded 15-20%
slower than `specgen run` (benchmarks/server-peers.md).
`release_pool()`, called on the loading thread once it is done with tensors, frees that pool
(OpenMP 5's `omp_pause_resource_all`); a later parallel op on that thread would build a new one.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from pathlib import Path

from specgen.errors import ConfigError

OMP_PAUSE_HARD = 2  # omp_pause_hard: free the calling thread's threads and their state
RUNTIMES = ("libgomp", "libiomp5", "libomp")


@functools.lru_cache(maxsize=1)
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime this process has loaded (torch's), or None (none, or not Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.count("/") else ""
        if any(Path(path).name.startswith(name + ".so") for name in RUNTIMES):
            try:
                library = ctypes.CDLL(path)
                library.omp_pause_resource_all.restype = ctypes.c_int
                return library
            except (OSError, AttributeError):
                return None
    return None


def release_pool() -> bool:
    """Free the calling thread's OpenMP worker pool; False where there is no runtime to ask or
    it refused (then nothing changed)."""
    import torch  # noqa: F401  (the runtime is torch's: it must be loaded before it is looked for)

    library = _runtime()
    return library is not None and library.omp_pause_resource_all(OMP_PAUSE_HARD) == 0


# -- fitting the thread count to the cores other processes leave free -----------------------------
#
# torch's OpenMP workers meet at a barrier after every parallel op; where another process holds a
# core, the worker on it is preempted and every op waits for it: on a 2-core Xeon with one busy
# process beside it, plain decoding ran at 0.19x its quiet speed with 2 threads. One thread per
# core that nothing else uses keeps the barrier short. `Threads` picks that count at the start and
# again every PERIOD seconds, from the CPU time the kernel counted (/proc/stat) less this
# process's own (/proc/self/stat) since the last look: no waiting, a few dozen microseconds.

PERIOD = 1.0  # seconds between two looks at the other processes' load
BUSY = 0.5  # a core that other processes use more than this share of is not free
ENVIRONMENT = "SPECGEN_THREADS"  # a fixed count, as --threads gives it
MIN_TICKS = 20  # clock ticks per core a look needs (0.2 s at Linux's 100 per second)


def _cpu_ticks(cpus: set[int]) -> tuple[int, int] | None:
    """(busy, total) clock ticks of `cpus` since boot, from /proc/stat; None off Linux."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(f) for f in fields[:8]]
        idle = ticks[3] + ticks[4]  # idle and iowait
        busy, total = busy + sum(ticks) - idle, total + sum(ticks)
    return busy, total


def _own_ticks() -> int | None:
    """This process's user and system clock ticks since it started (every thread's)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime


def cores() -> int:
    """The cores this process may run on."""
    return len(_affinity())


class Threads:
    """The torch thread count the forwards run with: `fixed` (--threads), else one per core that
    other processes leave free, looked at again every PERIOD seconds (`tick`, each round). It
    changes only how fast a step runs, never what it computes (the int8 path's products are
    row-exact at any thread count, and torch's own ops keep their order)."""

    def __init__(self, fixed: int | None = None):
        self.fixed, self.cpus = fixed or from_environment(), _affinity()
        self.count = self.fixed or len(self.cpus)
        self._since = _STARTED if _STARTED[0] is not None else self._sample()  # loading is in the first look
        self.started = False

    def start(self) -> int:
        """Set the count on the calling thread (the one that runs the forwards): the fixed one,
        or, the first time, what the other processes' load since this process started leaves
        free (the models loaded meanwhile: seconds of it); later calls look as `tick` does."""
        if self.started:
            self.tick()
            return self.count
        if self.fixed is None:
            self._fit()
        _set(self.count)
        self.started = True
        return self.count

    def tick(self) -> None:
        """A round: every PERIOD seconds, the count the last PERIOD's load leaves free."""
        if self.fixed is None and time.monotonic() - self._since[2] >= PERIOD and self._fit():
            _set(self.count)

    def _sample(self) -> tuple:
        return _cpu_ticks(self.cpus), _own_ticks(), time.monotonic()

    def _fit(self) -> bool:
        """The count the other processes' load since the last look leaves; True when it changed."""
        (cpu0, own0, _), (cpu1, own1, now) = self._since, self._sample()
        if cpu0 is None or cpu1 is None or own0 is None or own1 is None:
            return False
        if cpu1[1] - cpu0[1] < MIN_TICKS * len(self.cpus):  # too short a look to tell: a longer one later
            return False
        self._since = (cpu1, own1, now)
        per_core = (cpu1[1] - cpu0[1]) / len(self.cpus)  # ticks each core had in the interval
        others = max(0.0, (cpu1[0] - cpu0[0]) - (own1 - own0)) / per_core  # cores other processes used
        free = len(self.cpus) - int(others + (1 - BUSY))  # a core counts busy past BUSY of it
        count = max(1, min(len(self.cpus), free))
        changed, self.count = count != self.count, count
        return changed


def _affinity() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _set(count: int) -> None:
    import torch  # the forwards' runtime; the command line reads this module's checks without it

    torch.set_num_threads(count)


def from_environment() -> int | None:
    """SPECGEN_THREADS as a count (the command line checks it: `check_count`), else None."""
    value = os.environ.get(ENVIRONMENT, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def check_count(count: int | None, option: str = "--threads") -> int | None:
    """A thread count a user gave: 1 up to this process's cores, else a ConfigError line."""
    if count is not None and not 1 <= count <= cores():
        raise ConfigError(f"{option} must be in 1..{cores()} (the cores this process may use), got {count}")
    return count


# the first look's start: this module is imported before the models load (the command line's
# first steps), so the load's seconds are in the first look and no forward waits for one
_STARTED = (_cpu_ticks(set(_affinity())), _own_ticks(), time.monotonic())
