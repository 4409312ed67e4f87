"""How a `specgen run` finds the server started with the same model options, same user only.

A server writes a record (its URL, a random token, pid, models, start time) to a file named
by a digest of its model options (target, draft, placement, formats), the cache directory and
the specgen version, in a runtime directory only its user may open (mode 700, checked). A run
with other model options, or from another specgen version, never finds it. Stdlib only: a
served run imports no torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from specgen import __version__
from specgen.config import ModelSettings
from specgen.errors import ConfigError
from specgen.files import atomic_write, cache_root, flock_now
from specgen.text import json_value

# the HTTP API (3: /health proves the token by a challenge; 4: and the model options; 5: a live
# round carries its ids, a live replay its window's figures)
PROTOCOL = 5


def runtime_dir() -> Path:
    """$SPECGEN_RUNTIME_DIR, else $XDG_RUNTIME_DIR/specgen, else <tmp>/specgen-<uid>."""
    if os.environ.get("SPECGEN_RUNTIME_DIR"):
        return Path(os.environ["SPECGEN_RUNTIME_DIR"]).expanduser()
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "specgen"
    return Path(tempfile.gettempdir()) / f"specgen-{os.getuid()}"


def unsafe(directory: Path) -> str | None:
    """Why `directory` may not hold a server's token (None when it is this user's, mode 700)."""
    try:
        info = directory.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot read {directory}: {exc.strerror or exc}"
    if not directory.is_dir():
        return f"{directory} is not a directory"
    if info.st_uid != os.getuid():
        return f"{directory} belongs to another user"
    if info.st_mode & 0o077:
        return f"{directory} can be opened by other users (mode {info.st_mode & 0o777:o}; it must be 700)"
    return None


def private_dir() -> Path:
    """The runtime directory, made if missing; a ConfigError says why it cannot be used."""
    directory = runtime_dir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create {directory}: {exc.strerror or exc}",
            hint="set SPECGEN_RUNTIME_DIR to a directory you can write",
        ) from None
    why = unsafe(directory)
    if why is not None:
        raise ConfigError(why, hint=fix_hint(directory))
    return directory


def fix_hint(directory: Path) -> str:
    """What to do about an unusable runtime directory: chmod only helps a directory."""
    if directory.exists() and not directory.is_dir():
        return "set SPECGEN_RUNTIME_DIR to a directory; this path is a file"
    return f"chmod 700 {directory}, or set SPECGEN_RUNTIME_DIR elsewhere"


def settings_key(settings: ModelSettings) -> str:
    """A digest of everything that decides what a server loaded (not how it decodes)."""

    def model(arg: str | None) -> str | None:
        if arg is None:
            return None
        path = Path(arg).expanduser()
        return str(path.resolve()) if path.exists() else arg

    def word(value: str | None) -> str | None:  # --dtype FLOAT32 is --dtype float32
        return value.strip().lower() if isinstance(value, str) else value

    fields = [
        PROTOCOL,
        __version__,
        str(cache_root()),
        os.environ.get("CUDA_VISIBLE_DEVICES"),
        model(settings.target),
        model(settings.draft),
        word(settings.device),
        word(settings.draft_device),
        word(settings.dtype),
        word(settings.draft_quant),
        word(settings.compile),
        word(settings.target_quant),
    ]
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]


def proof(token: str, challenge: str, key: str) -> str:
    """What a server answers to /health?challenge=C: an HMAC of C and its model options' key
    (`settings_key`) under its local token. A client checks it before it sends the token
    anywhere: what listens at a dead server's port (another user, after a crash) cannot make
    it, and a server found through another options' record (a copied file) makes another."""
    message = f"specgen-health:{key}:{challenge}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def record_path(settings: ModelSettings) -> Path:
    return runtime_dir() / f"{settings_key(settings)}.json"


def log_path(settings: ModelSettings) -> Path:
    return runtime_dir() / f"{settings_key(settings)}.log"


def lock_path(settings: ModelSettings) -> Path:
    return runtime_dir() / f"{settings_key(settings)}.lock"


def holder(path: Path) -> int | None:
    """Who holds the lock at `path` (`hold`): its pid, 0 for a holder that has not written it
    yet, None when no process does (the lock is free, or there is none). A server holds its
    lock from before it loads until it ends, so this finds one still loading, or whose record
    is lost. Probing takes the lock for an instant when it is free."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            flock_now(fd)
            return None  # free: released again as the descriptor closes
        except BlockingIOError:
            return _pid_in(fd)
        except OSError:  # a file system without locks: nothing to learn from it
            return None
    finally:
        os.close(fd)


def _pid_in(fd: int) -> int:
    """The pid a lock file's holder wrote there (`hold`); 0 before it has."""
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else 0


def held() -> list[tuple[str, int]]:
    """(model-options key, holder's pid) of every held lock in the runtime directory."""
    directory = runtime_dir()
    if not directory.is_dir() or unsafe(directory) is not None:
        return []
    found = [(path.stem, holder(path)) for path in sorted(directory.glob("*.lock"))]
    return [(key, pid) for key, pid in found if pid is not None]


def is_server(pid: int, lock: Path) -> bool:
    """Whether process `pid` runs `specgen serve` and holds `lock` (Linux's /proc: its command
    line, and /proc/locks for the lock file's inode; elsewhere never proven): what a signal to a
    pid read from a lock file needs first (the file may still name an earlier, dead holder)."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        inode = lock.stat().st_ino
        held = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return False
    if not (any(b"specgen" in word for word in words) and b"serve" in words):
        return False
    # "1: FLOCK  ADVISORY  WRITE 1234 00:2f:123456 0 EOF": the holder's pid, then device:inode
    return any(
        len(f) > 5 and f[1] == "FLOCK" and f[4] == str(pid) and f[5].rsplit(":", 1)[-1] == str(inode)
        for f in (line.split() for line in held)
    )


def _flock_soon(fd: int, tries: int = 10) -> None:
    """`flock_now`, tried for about 100 ms: `holder` (serve --list, --stop) takes a free lock for
    an instant, and a server starting in that instant must not be refused."""
    for attempt in range(tries):
        try:
            flock_now(fd)
            return
        except BlockingIOError:
            if attempt == tries - 1:
                raise
            time.sleep(0.01)


def hold(settings: ModelSettings) -> int:
    """An exclusive lock, for this process's lifetime, on the right to serve these model options
    (`flock` on `<key>.lock` beside the record): a second server of the same options, started in
    the same seconds or beside a hung one, is refused instead of overwriting the first's record.
    Returns the descriptor (closing it releases the lock; so does the process's end)."""
    path = lock_path(settings)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot create {path}: {exc.strerror or exc}") from None
    try:
        _flock_soon(fd)
    except OSError:
        try:
            pid = _pid_in(fd)
        finally:
            os.close(fd)
        raise ConfigError(
            "a specgen server with these model options is already running or starting"
            + (f" (pid {pid})" if pid else ""),
            hint="`specgen serve --list` shows it; `specgen serve --stop` with the same options stops "
            "it" + (f"; one that never answers: kill {pid}" if pid else ""),
        ) from None
    os.ftruncate(
        fd, 0
    )  # the holder's pid, for the refusal above: a server whose record is lost can still be named
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def write_record(path: Path, record: dict) -> None:
    """The record, readable by this user only, written atomically."""
    data = json.dumps(record).encode()

    def write(tmp: Path) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)

    atomic_write(path, write, parents=False)


def read_record(path: Path) -> dict | None:
    """A record with the fields a client needs, or None (absent, unreadable, not ours)."""
    if unsafe(path.parent) is not None:
        return None
    try:
        record = json_value(path.read_text())
    except (OSError, ValueError):
        return None
    fields = {"url": str, "token": str, "pid": int, "models": str, "model": str, "since": (int, float)}
    if not isinstance(record, dict) or not all(isinstance(record.get(k), t) for k, t in fields.items()):
        return None
    try:
        parts = urlsplit(record["url"])
        usable = parts.scheme == "http" and bool(parts.hostname) and parts.port is not None
    except ValueError:  # a port out of range, a malformed address
        usable = False
    if (
        not usable
        or not math.isfinite(record["since"])
        or not 0 <= record["since"] < 1e11
        or record["pid"] <= 0
    ):
        return None  # not what a server writes: left alone, as a record of no server
    return record


def records() -> list[tuple[Path, dict]]:
    """Every readable record in the runtime directory."""
    directory = runtime_dir()
    if not directory.is_dir() or unsafe(directory) is not None:
        return []
    found = []
    for path in sorted(directory.glob("*.json")):
        record = read_record(path)
        if record is not None:
            found.append((path, record))
    return found
