"""`specgen serve`: one process keeps a loaded pair so that `specgen run` starts in a moment.

A warm `specgen run` spends most of its start outside generation (imports, int8 packing whose
layout cannot be saved, tokenizer and weights: figures in benchmarks/README.md). A server pays
that once; a `specgen run` that finds it imports no torch and sends its request over a Unix
socket (protocol.py).

What a client sees is what a run in its own process shows: the server drives the same
`run.generate` into a `Relay`, which sends each renderer call (enter, round, replay, exit,
finish) to the client, whose own renderer (Rich, plain or JSON, chosen by the client's
terminal) draws it. Ctrl-C in the client asks the server to stop after the current round,
and the client still gets the interrupted outcome (the same text an in-process Ctrl-C keeps).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path

from specgen.config import ModelSettings
from specgen.decoding import run as driver
from specgen.decoding.build import build_engine, resolve_draft_length
from specgen.decoding.prompts import encode_prompt
from specgen.decoding.views import Silent, summary_line
from specgen.errors import ConfigError, SpecgenError
from specgen.runtime.pair import load
from specgen.serve.protocol import MAX_SOCKET_PATH, private, recv, send, socket_path, supported
from specgen.status import note


class _ClientStopped(KeyboardInterrupt):
    """The client asked to stop (Ctrl-C there) or went away: run.generate ends the
    generation as it ends one on Ctrl-C, keeping what was made."""


class Relay:
    """A renderer that sends every call to the client. After each round it looks (without
    waiting) for a stop from the client, the one point where a generation can end early."""

    def __init__(self, conn: socket.socket, on_finish=lambda outcome: None):
        self.conn = conn
        self.gone = False
        self.on_finish = on_finish  # the server's bookkeeping, done before the client hears the end

    def _post(self, *message) -> None:
        if self.gone:
            return
        try:
            send(self.conn, message)
        except OSError:
            self.gone = True

    def _check(self) -> None:
        if not self.gone and select.select([self.conn], [], [], 0)[0]:
            try:
                message = recv(self.conn)
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
        self.on_finish(outcome)
        self._post("finish", replace(outcome, state=None))


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
        if not private(path.parent):
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
            request = recv(conn)
        except Exception:  # noqa: BLE001: a peer that hung up or sent no pickle of ours; serve the next
            return
        conn.settimeout(None)
        if not isinstance(request, tuple) or not request:
            return
        kind = request[0]
        try:
            if kind == "ping":
                send(conn, ("hello", self.info))
            elif kind == "shutdown":
                self.stopping = True
                send(conn, ("hello", self.info))
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
        send(conn, ("hello", self.info))
        try:
            config, _ = resolve_draft_length(self.pair, request["config"])
            if config.method.needs_draft_model and self.pair.draft is None:
                raise ConfigError(f"method {config.method.value} needs a draft model; this server has none")
            tokenizer = self.pair.target.tokenizer
            ids = encode_prompt(tokenizer, request["text"], request.get("raw", False), request.get("system"))
            driver.generate(self.engine(config), tokenizer, ids, config, Relay(conn, self._finished))
        except SpecgenError as exc:
            self._log(f"error: {exc}")
            send(conn, ("error", type(exc).__name__, str(exc), exc.hint))
        except Exception as exc:  # noqa: BLE001: the server outlives one request's failure
            traceback.print_exc(file=self.log)
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            send(conn, ("error", "SpecgenError", f"unexpected {type(exc).__name__} on the server: {first}",
                         "the server's log has the traceback"))

    def _finished(self, outcome) -> None:
        self.served += 1
        self._log(f"{summary_line(outcome)}; prompt {outcome.stats.prompt_tokens} tokens")

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
        key = (config.method, config.draft_tokens, config.draft_confidence, config.branching,
               config.beam_width, config.depth)
        if key not in self.engines:
            self.engines[key] = build_engine(self.pair, config)
        return self.engines[key]

    def warm_up(self, config) -> None:
        """Short generations, so that the first requests pay no one-time costs (the draft length
        measurement, first-touch allocations; on a GPU the compilation and capture). Two prompts
        of different lengths: the compiled layers see a second prefill length and recompile
        once for any length (without it the first request of a new length compiles again)."""
        config, _ = resolve_draft_length(self.pair, config)
        tokenizer = self.pair.target.tokenizer
        for text in ("Hello", "Write a short poem about the sea, then explain its meter in one sentence."):
            driver.generate(self.engine(config), tokenizer, encode_prompt(tokenizer, text), config, Silent())


def run_server(settings: ModelSettings, config, idle_minutes: float = 0.0, quiet: bool = False) -> str:
    """Load the pair, listen, warm up, answer until stopped; the reason it stopped."""
    pair = load(settings, config.method, quiet=quiet)
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
            _say(f"server ready: pid {os.getpid()}, {server.info['models']}; socket {path}")
            _say("`specgen run` with the same model options now generates here; Ctrl-C stops the server")
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


def _say(text: str) -> None:
    note(f"specgen: {text}")
