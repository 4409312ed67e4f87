"""`specgen serve`: one process keeps a loaded pair so that `specgen run` starts in a moment.

Why: a warm `specgen run` spends most of its start outside generation. On a 2-core AVX2 EPYC
(default pair, int8 on the CPU) it took about 16 s to the first token: about 7 s importing
torch and transformers' modeling code, about 5.6 s packing the int8 weights for fbgemm (its
packed layout cannot be saved, so every process packs again), and about 2 s reading the
tokenizer and weights. A server pays all of that once; a `specgen run` that finds it imports
no torch and sends its request over a Unix socket.

What a client sees is what a run in its own process shows: the server drives the same
`session.generate` into a `Relay`, which sends each renderer call (enter, round, replay,
exit, finish) to the client, whose own renderer (Rich, plain or JSON, chosen by the client's
terminal) draws it. Ctrl-C in the client asks the server to stop after the current round,
and the client still gets the interrupted outcome (the same text an in-process Ctrl-C keeps).

Matching: a server answers on a socket named by a digest of its model options (target, draft,
placement, formats), the cache directory and the specgen version, so a `specgen run` with
other model options, or from another specgen version, never finds it and loads in its own
process. Decoding options (method, k, sampling, seed, ...) travel with each request.

Security: messages are pickles, so the socket lives in a directory only its user can open
(mode 700, owned by the user, checked on both sides), and the server also checks the peer's
uid (SO_PEERCRED) where the platform has it.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import select
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path

from specgen.config import ModelSettings
from specgen.errors import ConfigError, ModelError, PromptError, SpecgenError

PROTOCOL = 1
_HEADER = struct.Struct("!Q")
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux, 104 on macOS
WAIT_NOTE_SECONDS = 2.0  # a client tells the user it waits once the server is this late


# -- where a server listens ----------------------------------------------------------------------
def supported() -> bool:
    return hasattr(socket, "AF_UNIX") and hasattr(os, "getuid")


def runtime_dir() -> Path:
    """$SPECGEN_RUNTIME_DIR, else $XDG_RUNTIME_DIR/specgen, else <tmp>/specgen-<uid>."""
    if os.environ.get("SPECGEN_RUNTIME_DIR"):
        return Path(os.environ["SPECGEN_RUNTIME_DIR"]).expanduser()
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "specgen"
    return Path(tempfile.gettempdir()) / f"specgen-{os.getuid()}"


def _private(directory: Path) -> bool:
    """A directory owned by this user that nobody else can open."""
    try:
        info = directory.stat()
    except OSError:
        return False
    return directory.is_dir() and info.st_uid == os.getuid() and not info.st_mode & 0o077


def settings_key(settings: ModelSettings) -> str:
    """A digest of everything that decides what a server loaded (not how it decodes)."""
    from specgen import __version__
    from specgen.catalog import cache_root

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


# -- framing: 8-byte length, then a pickle ------------------------------------------------------
def _send(sock: socket.socket, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv(sock: socket.socket):
    """The next message, or None when the other side closed the connection."""
    header = _exactly(sock, _HEADER.size)
    if header is None:
        return None
    body = _exactly(sock, _HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


def _exactly(sock: socket.socket, size: int) -> bytes | None:
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


# -- the client side (stdlib and renderers only: no torch) ----------------------------------------
def connect(settings: ModelSettings) -> socket.socket | None:
    """A connection to a running server with these model options, or None."""
    if os.environ.get("SPECGEN_NO_SERVER"):
        return None
    return _connect_at(socket_path(settings))


def _connect_at(path: Path) -> socket.socket | None:
    if not supported() or len(str(path)) > MAX_SOCKET_PATH or not _private(path.parent) or not path.exists():
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
            _send(sock, ("generate", request))
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
            message = _recv(sock)
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
                    _send(sock, ("stop",))
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
    try:
        sys.stderr.write(f"specgen: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def ping(settings: ModelSettings, timeout: float = 5.0) -> dict | None:
    """The running server's description (pid, models, since), or None."""
    return _ask(settings, ("ping",), timeout)


def shutdown(settings: ModelSettings, timeout: float = 30.0) -> dict | None:
    """Ask the matching server to stop; its description, or None when none was running."""
    return _ask(settings, ("shutdown",), timeout)


def running(timeout: float = 2.0) -> list[dict]:
    """Every server of this user that answers (pid, models, since, socket), oldest first."""
    directory = runtime_dir()
    if not supported() or not _private(directory):
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
            _send(sock, message)
            answer = _recv(sock)
        except OSError:
            return None
    return answer[1] if answer and answer[0] == "hello" else None


# -- the server side ------------------------------------------------------------------------------
class _ClientStopped(KeyboardInterrupt):
    """The client asked to stop (Ctrl-C there) or went away: session.generate ends the
    generation as it ends one on Ctrl-C, keeping what was made."""


class Relay:
    """A renderer that sends every call to the client. After each round it looks (without
    waiting) for a stop from the client, the one point where a generation can end early."""

    def __init__(self, conn: socket.socket):
        self.conn = conn
        self.gone = False

    def _post(self, *message) -> None:
        if self.gone:
            return
        try:
            _send(self.conn, message)
        except OSError:
            self.gone = True

    def _check(self) -> None:
        if not self.gone and select.select([self.conn], [], [], 0)[0]:
            try:
                message = _recv(self.conn)
            except (OSError, pickle.UnpicklingError, EOFError):
                message = None
            if message != ("stop",):  # the client closed the connection (or spoke nonsense)
                self.gone = True
            raise _ClientStopped()  # either way: end this generation as Ctrl-C would
        if self.gone:
            raise _ClientStopped()

    def __enter__(self) -> "Relay":
        self._post("enter")
        return self

    def __exit__(self, *exc) -> None:
        self._post("exit")

    def on_round(self, view, stats) -> None:
        self._post("round", view, stats)
        self._check()

    def on_replay(self, view, stats) -> None:
        self._post("replay", view, stats)
        self._check()

    def finish(self, outcome) -> None:
        self._post("finish", replace(outcome, state=None))


class _Quiet:
    """A renderer that shows nothing (the warm-up generation)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def on_round(self, view, stats):
        pass

    def on_replay(self, view, stats):
        pass

    def finish(self, outcome):
        pass


class Server:
    """Serves generations with one loaded pair, one connection at a time."""

    def __init__(self, settings: ModelSettings, pair, log=None):
        self.settings = settings
        self.pair = pair
        self.log = log or sys.stderr
        self.engines: dict = {}
        self.since = time.time()
        self.stopping = False
        self.served = 0
        names = pair.target.name + (f" + draft {pair.draft.name}" if pair.draft is not None else "")
        self.info = {"pid": os.getpid(), "models": f"target {names}", "since": self.since}
        self._listener: socket.socket | None = None
        self.path: Path | None = None

    # lifecycle
    def bind(self) -> Path:
        """Listen on this pair's socket; a ConfigError if a live server already holds it."""
        if not supported():
            raise ConfigError("specgen serve needs Unix sockets, which this platform lacks")
        path = socket_path(self.settings)
        if len(str(path)) > MAX_SOCKET_PATH:
            raise ConfigError(f"the socket path {path} is too long for a Unix socket",
                              hint="set SPECGEN_RUNTIME_DIR to a shorter directory")
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create {path.parent}: {exc.strerror or exc}",
                              hint="set SPECGEN_RUNTIME_DIR to a directory you can write") from None
        if not _private(path.parent):
            raise ConfigError(f"{path.parent} must be a directory only you can open (yours, mode 700)",
                              hint=f"chmod 700 {path.parent}, or set SPECGEN_RUNTIME_DIR elsewhere")
        if path.exists():
            other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                other.connect(str(path))
            except OSError:
                path.unlink(missing_ok=True)  # stale: its server died without cleaning up
            else:
                other.close()
                raise ConfigError("a specgen server with these model options is already running",
                                  hint="`specgen serve --stop` with the same options stops it")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        os.chmod(path, 0o600)
        listener.listen(16)
        self._listener, self.path = listener, path
        return path

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            if self.path is not None:
                self.path.unlink(missing_ok=True)

    def serve_forever(self, idle_seconds: float = 0.0) -> str:
        """Answer requests until a shutdown request, SIGTERM/SIGINT, or `idle_seconds` without a
        request (0: no limit). Returns why it stopped."""
        assert self._listener is not None, "bind() first"
        last = time.monotonic()
        self._listener.settimeout(1.0)
        while not self.stopping:
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                if idle_seconds and time.monotonic() - last > idle_seconds:
                    self.close()
                    return f"no request for {idle_seconds / 60:g} minutes"
                continue
            with conn:
                self.handle(conn)
            last = time.monotonic()
        self.close()  # no later client may queue on a socket nobody will answer
        return "asked to stop"

    def handle(self, conn: socket.socket) -> None:
        if not self._same_user(conn):
            return
        conn.settimeout(30.0)  # a request arrives at once; a silent peer must not hold the server
        try:
            request = _recv(conn)
        except Exception:  # noqa: BLE001: a peer that hung up or sent no pickle of ours; serve the next
            return
        conn.settimeout(None)
        if not isinstance(request, tuple) or not request:
            return
        kind = request[0]
        try:
            if kind == "ping":
                _send(conn, ("hello", self.info))
            elif kind == "shutdown":
                self.stopping = True
                _send(conn, ("hello", self.info))
            elif kind == "generate":
                self.generate(conn, request[1])
        except OSError:
            pass  # the client went away

    @staticmethod
    def _same_user(conn: socket.socket) -> bool:
        if not hasattr(socket, "SO_PEERCRED"):
            return True  # the private directory alone guards the socket
        creds = struct.Struct("3i")
        _, uid, _ = creds.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, creds.size))
        return uid == os.getuid()

    # one generation
    def generate(self, conn: socket.socket, request: dict) -> None:
        from specgen import session

        _send(conn, ("hello", self.info))
        try:
            config, _ = session.resolve_draft_length(self.pair, request["config"])
            if config.method.needs_draft_model and self.pair.draft is None:
                raise ConfigError(f"method {config.method.value} needs a draft model; this server has none")
            tokenizer = self.pair.target.tokenizer
            ids = session.encode_prompt(tokenizer, request["text"], request.get("raw", False),
                                        request.get("system"))
            outcome = session.generate(self.engine(config), tokenizer, ids, config, Relay(conn))
            self.served += 1
            from specgen.render import summary_line

            self._log(f"{summary_line(outcome)}; prompt {outcome.stats.prompt_tokens} tokens")
        except SpecgenError as exc:
            self._log(f"error: {exc}")
            _send(conn, ("error", type(exc).__name__, str(exc), exc.hint))
        except Exception as exc:  # noqa: BLE001: the server outlives one request's failure
            traceback.print_exc(file=self.log)
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            _send(conn, ("error", "SpecgenError", f"unexpected {type(exc).__name__} on the server: {first}",
                         "the server's log has the traceback"))

    def _log(self, line: str) -> None:
        """One line per request in the server's output (the --detach log), never a failure."""
        try:
            self.log.write(f"{time.strftime('%H:%M:%S')} {line}\n")
            self.log.flush()
        except (OSError, ValueError):
            pass

    def engine(self, config):
        """One engine per drafting setup, kept for later requests (compiled steps, captured
        graphs and caches stay warm); decoding settings reach it with each generation."""
        from specgen import session

        key = (config.method, config.draft_tokens, config.draft_confidence, config.branching,
               config.beam_width, config.depth)
        if key not in self.engines:
            self.engines[key] = session.build_engine(self.pair, config.method, config)
        return self.engines[key]

    def warm_up(self, config) -> None:
        """Short generations, so that the first requests pay no one-time costs (the draft length
        measurement, first-touch allocations; on a GPU the compilation and capture). Two prompts
        of different lengths: the compiled layers see a second prefill length and recompile
        once for any length (measured on an H100 before this: the first request with a new
        prompt length took 14 s, the rest 0.4-0.6 s)."""
        from specgen import session

        config, _ = session.resolve_draft_length(self.pair, config)
        tokenizer = self.pair.target.tokenizer
        for text in ("Hello", "Write a short poem about the sea, then explain its meter in one sentence."):
            session.generate(self.engine(config), tokenizer, session.encode_prompt(tokenizer, text), config, _Quiet())


def run_server(settings: ModelSettings, config, idle_minutes: float = 0.0, quiet: bool = False) -> str:
    """Load the pair, listen, warm up, answer until stopped; the reason it stopped."""
    from specgen import session

    pair = session.load(settings, config.method, quiet=quiet)
    server = Server(settings, pair)
    path = server.bind()
    previous = {}

    def stop(signum, frame):  # SIGTERM and SIGINT: finish (or interrupt) the request in hand, then stop
        server.stopping = True
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, stop)
    try:
        server.warm_up(replace(config, max_new_tokens=4))
        if not quiet:
            _note(f"server ready: pid {os.getpid()}, {server.info['models']}; socket {path}")
            _note("`specgen run` with the same model options now generates here; Ctrl-C stops the server")
        while True:
            try:
                return server.serve_forever(idle_minutes * 60)
            except KeyboardInterrupt:
                if server.stopping:
                    return "stopped by a signal"
    finally:
        server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
