"""How `specgen run` finds and talks to a `specgen serve` process: where its socket lives,
which server matches a run's model options, and the message framing. Stdlib only (no torch).

Matching: a server answers on a socket named by a digest of its model options (target, draft,
placement, formats), the cache directory and the specgen version, so a `specgen run` with other
model options, or from another specgen version, never finds it and loads in its own process.
Decoding options (method, k, sampling, seed, ...) travel with each request.

Security: messages are pickles, so the socket lives in a directory only its user can open
(mode 700, owned by the user, checked on both sides), and the server also checks the peer's
uid (SO_PEERCRED) where the platform has it.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import socket
import struct
import tempfile
from pathlib import Path

from specgen import __version__
from specgen.config import ModelSettings
from specgen.models.cache import cache_root

PROTOCOL = 1
_HEADER = struct.Struct("!Q")
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux, 104 on macOS


def supported() -> bool:
    return hasattr(socket, "AF_UNIX") and hasattr(os, "getuid")


def runtime_dir() -> Path:
    """$SPECGEN_RUNTIME_DIR, else $XDG_RUNTIME_DIR/specgen, else <tmp>/specgen-<uid>."""
    if os.environ.get("SPECGEN_RUNTIME_DIR"):
        return Path(os.environ["SPECGEN_RUNTIME_DIR"]).expanduser()
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "specgen"
    return Path(tempfile.gettempdir()) / f"specgen-{os.getuid()}"


def private(directory: Path) -> bool:
    """A directory owned by this user that nobody else can open."""
    try:
        info = directory.stat()
    except OSError:
        return False
    return directory.is_dir() and info.st_uid == os.getuid() and not info.st_mode & 0o077


def settings_key(settings: ModelSettings) -> str:
    """A digest of everything that decides what a server loaded (not how it decodes)."""
    def model(arg: str | None) -> str | None:
        if arg is None:
            return None
        path = Path(arg).expanduser()
        return str(path.resolve()) if path.exists() else arg

    fields = [PROTOCOL, __version__, str(cache_root()), os.environ.get("CUDA_VISIBLE_DEVICES"),
              model(settings.target), model(settings.draft), settings.device, settings.draft_device,
              settings.dtype, settings.draft_quant, settings.compile, settings.target_quant]
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]


def socket_path(settings: ModelSettings) -> Path:
    return runtime_dir() / f"{settings_key(settings)}.sock"


# -- framing: 8-byte length, then a pickle --
def send(sock: socket.socket, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv(sock: socket.socket):
    """The next message, or None when the other side closed the connection."""
    header = exactly(sock, _HEADER.size)
    if header is None:
        return None
    body = exactly(sock, _HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


def exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except ConnectionError:
            return None
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
