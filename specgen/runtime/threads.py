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
from pathlib import Path

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
