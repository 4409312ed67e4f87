"""Files: writing one atomically, and the locks around work that two processes
could do at once. Imports nothing of specgen but its errors; every layer may use it.

Every file specgen writes (converted models, int8 weights, cached measurements, bench reports,
chat saves, server records, model downloads) goes through `atomic_write`: the data is written to
a temporary name beside the target and renamed over it only once complete, so a crash, a full
disk or a Ctrl-C never leaves a truncated file behind, and readers see the old file or the new
one. Work that two processes could do at once (a download, a conversion, a read-modify-write of
a JSON cache) holds a `locked` file lock (the `filelock` package) around it; a lock that must
fail at once when held, for as long as a descriptor stays open (a server's options, a results
file), is `flock_now`.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import os
import secrets
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Callable

from filelock import FileLock

from specgen.errors import DiskFullError


def cache_root() -> Path:
    """`$SPECGEN_CACHE`, else `$XDG_CACHE_HOME/specgen`, else `~/.cache/specgen`."""
    if os.environ.get("SPECGEN_CACHE"):
        return Path(os.environ["SPECGEN_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "specgen"
    return Path.home() / ".cache" / "specgen"


def atomic_write(
    path: Path, write: Callable[[Path], None], tmp: Path | None = None, parents: bool = True
) -> None:
    """`write(tmp)` creates a file or a directory at a temporary path beside `path`; once it
    returns, the result is synced to disk and renamed over `path`. On any failure (Ctrl-C
    included) the temporary is removed and `path` is untouched; a full disk (whichever library
    was writing) becomes a DiskFullError that says where and what to do.

    `tmp`: a fixed temporary name instead of a unique one, for writers that hold a `locked`
    lock (a leftover of a killed process is then overwritten by the next writer, not kept).
    `parents`: make missing parent directories (caches); a user's file names an existing one.

    A symbolic link is written through (its target replaced, the link kept); a device or a pipe
    (`--json /dev/stdout`, /dev/null) is written in place, never replaced by a file."""
    path = Path(path)
    if path.is_symlink():
        path = path.resolve()
    if path.exists() and not path.is_file() and not path.is_dir():
        _write_in_place(path, write)
        return
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp or path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    remove(tmp)
    try:
        write(tmp)
        _sync(tmp)
        if path.is_file() and tmp.is_file():  # a file written again keeps its mode (a 0444 file stays 0444)
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        os.replace(tmp, path)
    except BaseException as error:
        remove(tmp)
        if disk_full(error):
            raise DiskFullError(
                f"disk full while writing {path}; {_free_space_hint(path)}", _os_words(error)
            ) from None
        raise
    _sync_directory(path.parent)


def write_text(path: Path, text: str, parents: bool = True) -> None:
    """Text (UTF-8) written atomically."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), parents=parents)


def _write_in_place(path: Path, write: Callable[[Path], None]) -> None:
    """`write` to a temporary file, then its bytes into `path` (a device or a pipe)."""
    with tempfile.TemporaryDirectory(prefix="specgen-") as folder:
        tmp = Path(folder) / path.name
        try:
            write(tmp)
            with open(tmp, "rb") as source, open(path, "wb") as target:
                shutil.copyfileobj(source, target)
        except OSError as error:
            if disk_full(error):
                raise DiskFullError(f"disk full while writing {path}; free some space") from None
            raise


def disk_full(error: BaseException) -> bool:
    """Did `error` come from a full disk? An OSError says so by its errno; safetensors'
    writer (a SafetensorError, from Rust) only in its text."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return says_disk_full(str(error))


def says_disk_full(text: str) -> bool:
    """Does an error's text (another process's stderr, a Rust library's message) report a full disk?"""
    return "No space left on device" in text or any(
        f"{form} {errno.ENOSPC}" in text for form in ("Errno", "os error")
    )


def _os_words(error: BaseException) -> str:
    """What the OS said ("No space left on device", "Disk quota exceeded"), shown after the line: the
    words a user searches for, whichever library's error (torch's, Rust's) carried them."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return error.strerror or os.strerror(error.errno)
    return os.strerror(errno.ENOSPC)


def _free_space_hint(path: Path) -> str:
    """What to do about a full disk: in the cache, SPECGEN_CACHE can name another disk."""
    try:
        in_cache = Path(path).resolve().is_relative_to(cache_root().resolve())
    except OSError:
        in_cache = False
    return "free some space or set SPECGEN_CACHE to another disk" if in_cache else "free some space"


def locked(name: str, timeout: float = -1) -> FileLock:
    """An exclusive lock named `name`, across processes (use as a context manager). Lock files
    live in `cache_root()/locks/`, apart from what they guard."""
    directory = cache_root() / "locks"
    directory.mkdir(parents=True, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)
    return FileLock(str(directory / f"{safe}.lock"), timeout=timeout)


def flock_now(fd: int) -> None:
    """An exclusive `flock` on an open descriptor, held until it is closed (or the process ends),
    or at once BlockingIOError when another holds it (any other OSError: no locks there)."""
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def remove(path: Path) -> None:
    """A file, a link or a directory tree gone (nothing there is fine)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _sync(path: Path) -> None:
    """fsync a file, or every file of a directory tree: the rename must never publish bytes
    that are still only in the page cache."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())


def _sync_directory(directory: Path) -> None:
    """Make a rename itself durable (POSIX); harmless to skip where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_AT_EXIT: list[Callable[[], None]] = []


def at_exit(hook: Callable[[], None]) -> None:
    """Run `hook` once when the process ends: from the CLI's own exit (which leaves through
    os._exit, skipping the interpreter's teardown), or from atexit where specgen is a library."""
    if not _AT_EXIT:
        atexit.register(run_exit_hooks)
    _AT_EXIT.append(hook)


def run_exit_hooks() -> None:
    """The hooks `at_exit` took, each once, newest first."""
    while _AT_EXIT:
        hook = _AT_EXIT.pop()
        try:
            hook()
        except Exception as error:  # the command's work is done: say it, end as it would have
            print(f"specgen: at exit: {type(error).__name__}: {error}", file=sys.stderr)
