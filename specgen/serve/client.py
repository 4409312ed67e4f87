"""The client side of `specgen serve` (what `specgen run` does when a matching server runs):
send one request, show the server's rounds with the client's own renderer. Stdlib and
renderers only: a served run imports no torch."""

from __future__ import annotations

import os
import select
import socket
from pathlib import Path

from specgen.config import ModelSettings
from specgen.errors import ConfigError, ModelError, PromptError, SpecgenError
from specgen.serve.protocol import MAX_SOCKET_PATH, private, recv, runtime_dir, send, socket_path, supported
from specgen.status import note

WAIT_NOTE_SECONDS = 2.0  # a client tells the user it waits once the server is this late


def connect(settings: ModelSettings) -> socket.socket | None:
    """A connection to a running server with these model options, or None."""
    if os.environ.get("SPECGEN_NO_SERVER"):
        return None
    return _connect_at(socket_path(settings))


def _connect_at(path: Path) -> socket.socket | None:
    if not supported() or len(str(path)) > MAX_SOCKET_PATH or not private(path.parent) or not path.exists():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:  # a stale socket: its server is gone
        sock.close()
        return None
    return sock


def generate_on_server(settings: ModelSettings, request: dict, renderer, quiet: bool = False):
    """Run one generation on a matching server into `renderer`; its Outcome, or None when no
    server with these model options is running (then the caller loads the pair itself).

    Ctrl-C once: the server stops after its current round and the outcome comes back marked
    interrupted. Twice: KeyboardInterrupt (the text shown so far stays on the screen)."""
    sock = connect(settings)
    if sock is None:
        return None
    with sock:
        try:
            send(sock, ("generate", request))
        except OSError:
            return None  # it went away between connect and send: load here
        return _drive(sock, renderer, quiet)


def _drive(sock: socket.socket, renderer, quiet: bool):
    """Show the server's messages with `renderer` until the outcome arrives."""
    if not quiet and not select.select([sock], [], [], WAIT_NOTE_SECONDS)[0]:
        _note("the specgen server is busy with another request; waiting for it ...")
    entered = stopping = False
    while True:
        try:
            message = recv(sock)
            if message is None:
                raise SpecgenError("the specgen server closed the connection before the generation finished",
                                   hint="was it stopped? what was shown is all that was generated")
            kind, *args = message
            if kind == "hello" and not quiet:
                _note(f"generating on the specgen server (pid {args[0]['pid']}, {args[0]['models']})")
            elif kind == "enter":
                renderer.__enter__()
                entered = True
            elif kind == "round":
                renderer.on_round(*args)
            elif kind == "replay":
                renderer.on_replay(*args)
            elif kind == "exit":
                entered = False
                renderer.__exit__(None, None, None)
            elif kind == "finish":
                renderer.finish(args[0])
                return args[0]
            elif kind == "error":
                raise _error(*args)
        except KeyboardInterrupt:  # in a wait or in the renderer: ask the server to stop, once
            if not stopping:
                stopping = True
                try:
                    send(sock, ("stop",))
                except OSError:
                    pass
                continue
            if entered:
                renderer.__exit__(None, None, None)
            raise
        except SpecgenError:
            if entered:
                renderer.__exit__(None, None, None)
            raise


_ERRORS = {cls.__name__: cls for cls in (SpecgenError, ModelError, ConfigError, PromptError)}


def _error(name: str, text: str, hint: str | None) -> SpecgenError:
    return _ERRORS.get(name, SpecgenError)(text, hint=hint)


def _note(text: str) -> None:
    note(f"specgen: {text}")


def ping(settings: ModelSettings, timeout: float = 5.0) -> dict | None:
    """The running server's description (pid, models, since), or None."""
    return _ask(settings, ("ping",), timeout)


def shutdown(settings: ModelSettings, timeout: float = 30.0) -> dict | None:
    """Ask the matching server to stop; its description, or None when none was running."""
    return _ask(settings, ("shutdown",), timeout)


def running(timeout: float = 2.0) -> list[dict]:
    """Every server of this user that answers (pid, models, since, socket), oldest first."""
    directory = runtime_dir()
    if not supported() or not private(directory):
        return []
    found = []
    for path in sorted(directory.glob("*.sock")):
        info = _ask_at(path, ("ping",), timeout)
        if info is not None:
            found.append({**info, "socket": str(path)})
    return sorted(found, key=lambda info: info["since"])


def _ask(settings: ModelSettings, message: tuple, timeout: float) -> dict | None:
    return _ask_at(socket_path(settings), message, timeout)


def _ask_at(path: Path, message: tuple, timeout: float) -> dict | None:
    sock = _connect_at(path)
    if sock is None:
        return None
    with sock:
        try:
            sock.settimeout(timeout)
            send(sock, message)
            answer = recv(sock)
        except OSError:
            return None
    return answer[1] if answer and answer[0] == "hello" else None
