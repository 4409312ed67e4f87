"""Runners in a child process of their own, so that a reference library which crashes (llama.cpp's
SIGSEGV on some CPUs) takes down its own column and never the bench run.

The child is started with multiprocessing's "spawn" context (forking a torch process that runs
threads can deadlock), sets torch's thread count to the parent's, builds the real runner once
from a picklable factory (a module-level class or function and its arguments) and then serves
(prompt ids, config) requests over a pipe, each answered with the Generation it measured:
timings are taken in the child, so the pipe costs no measured time. When the child dies (EOF on
the pipe) or its runner raises, the proxy raises `RunnerFailed` with one line naming the signal
or the error; bench records that line as the column's result and goes on with the others.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from specgen.bench.runners import Generation
from specgen.config import GenerationConfig
from specgen.errors import one_line

STOP_SECONDS = 10.0  # an idle child asked to stop gets this long before it is killed


class RunnerFailed(RuntimeError):
    """A column that cannot go on: its process crashed, or its runner raised. One line."""


class IsolatedRunner:
    """A Runner whose generations run in a child process built by `factory(*args)`.

    The child starts at the first generation (inside bench's fixed thread count, which it
    copies), lives for the whole run and is stopped by `close`: asked to stop when idle, killed
    when a request is still in flight (Ctrl-C), reaped either way.
    """

    def __init__(
        self, name: str, factory: Callable, args: tuple = (), label: str | None = None, crash_hint: str = ""
    ):
        self.name = name
        self.factory, self.args = factory, args
        self.label = label or name  # what a failure line calls the engine: "llama.cpp crashed (SIGSEGV)"
        self.crash_hint = crash_hint  # appended to a crash's line: where to read what to do
        self.peak_memory_bytes: int | None = None  # the child's peak RSS in the last generation
        self.process = None
        self._conn = None
        self._busy = False  # a request (or the start) is in flight: close kills instead of asking
        self._failed: str | None = None

    def generate(self, prompt_ids: list[int], config: GenerationConfig) -> Generation:
        if self._failed is not None:
            raise RunnerFailed(self._failed)
        self._busy = True
        if self.process is None:
            self._start()
        self._conn.send((list(prompt_ids), config))
        generation, self.peak_memory_bytes = self._reply()
        self._busy = False
        return generation

    def close(self) -> None:
        """Stop the child and reap it (no zombie); a no-op when none runs."""
        process, conn = self.process, self._conn
        if process is None:
            return
        self.process = self._conn = None
        if process.is_alive() and not self._busy:
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
            process.join(STOP_SECONDS)
        if process.is_alive():
            process.kill()
        process.join()
        conn.close()
        self._busy = False

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(
            target=serve,
            args=(theirs, self.factory, self.args, torch.get_num_threads()),
            name=f"specgen-bench-{self.name}",
            daemon=True,
        )
        try:
            process.start()
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # only the child holds its end now: its death is EOF on ours
        self.process, self._conn = process, ours
        self._reply()  # None once the runner is built, else the failure to build it

    def _reply(self):
        try:
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            raise self._fail(self._death()) from None
        if kind == "error":
            raise self._fail(f"{self.label} failed: {value}")
        return value

    def _death(self) -> str:
        process = self.process
        process.join(STOP_SECONDS)  # EOF comes as the process dies: its exit code follows at once
        code = process.exitcode
        if code is None:
            return f"{self.label} closed its pipe but did not exit"
        if code < 0:
            return f"{self.label} crashed ({signal_name(-code)}){self.crash_hint}"
        return f"{self.label} exited with status {code}"

    def _fail(self, line: str) -> RunnerFailed:
        self._failed = line
        self.close()
        return RunnerFailed(line)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@contextlib.contextmanager
def closing(runners: Iterable) -> Iterator[None]:
    """Close every isolated runner among `runners` on the way out, however the block ends."""
    try:
        yield
    finally:
        for runner in runners:
            if isinstance(runner, IsolatedRunner):
                runner.close()


# -- the child's side ------------------------------------------------------------------------
def serve(conn, factory: Callable, args: tuple, threads: int) -> None:
    """The child's loop: build the runner, then answer each request with ("ok", (Generation,
    peak RSS)) until the parent sends None or goes away; an exception is answered with
    ("error", one line) and ends the child."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops this process
    torch.set_num_threads(threads)
    try:
        runner = factory(*args)
    except Exception as exc:  # noqa: BLE001 - any failure to build is this column's result
        conn.send(("error", one_line(exc)))
        return
    conn.send(("ok", None))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if request is None:
            return
        prompt_ids, config = request
        resettable = _reset_peak()
        try:
            generation = runner.generate(prompt_ids, config)
        except Exception as exc:  # noqa: BLE001 - reported as the column's one line
            conn.send(("error", one_line(exc)))
            return
        conn.send(("ok", (generation, _peak() if resettable else None)))


def _reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM) where Linux allows it, as bench does for its own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None
