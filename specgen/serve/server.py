"""`specgen serve`: load the pair once, warm it up, answer OpenAI-style HTTP requests with
continuous batching until stopped (SIGINT/SIGTERM, or idle for --idle-minutes).

uvicorn serves the FastAPI app (app.py) on one event loop; the engine runs on its own thread
(scheduler.py). The server writes its record (URL, random token, pid) to the user's runtime
directory so that `specgen run` with the same model options finds it (discovery.py), and
removes it when it stops.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import uvicorn

from specgen.config import DEFAULT_METHOD, GenerationConfig, Method, ModelSettings, SamplingConfig
from specgen.decoding import run as driver
from specgen.decoding.build import resolve_draft_length
from specgen.decoding.prompts import encode_prompt
from specgen.decoding.staging import PREFILL_CHUNK
from specgen.decoding.views import Outcome, Silent, summary_line
from specgen.decoding.widths import WidthCaps, width_costs
from specgen.errors import ConfigError
from specgen.models.load import Vocabulary
from specgen.runtime.pair import load
from specgen.runtime.prefixes import DEFAULT_MIB
from specgen.runtime.threads import release_pool
from specgen.serve import discovery, playground
from specgen.serve.app import ServerState, create_app, refusal
from specgen.serve.metrics import Metrics
from specgen.serve.protocol import TimedH11
from specgen.serve.scheduler import Scheduler
from specgen.status import note, status

# a first SIGINT/SIGTERM: running requests get this long to finish (queued ones are answered
# that the server is stopping), then their rows end; uvicorn closes what is left a second later
DRAIN_SECONDS = 4.0


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_batch_size: int = 8
    max_queue: int = 64
    idle_minutes: float = 0.0
    max_tokens: int = 512  # a request's default token budget
    prefix_cache: int = DEFAULT_MIB  # MiB of requests' K/V kept per model for later prompts (0: none)
    prefill_chunk: int = PREFILL_CHUNK  # a long prompt's tokens per round while others decode (CPU; 0: whole)
    allowed_origins: tuple[
        str, ...
    ] = ()  # web pages (scheme://host[:port], or *) whose scripts may call (CORS)

    def check(self) -> None:
        """Refused before anything loads."""
        if not self.api_key and not loopback(self.host):
            raise ConfigError(
                f"--host {self.host} is reachable from other machines; give it an --api-key",
                hint="or serve on 127.0.0.1 (the default)",
            )
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        if not 1 <= self.max_batch_size <= 256:
            raise ConfigError(f"--max-batch-size must be in 1..256, got {self.max_batch_size}")
        # every request waits in the queue, if only until the next round
        if not 1 <= self.max_queue <= 100_000:
            raise ConfigError(f"--max-queue must be in 1..100000, got {self.max_queue}")
        if self.max_tokens < 1:
            raise ConfigError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        key = self.api_key
        if key is not None and (not key or not all(33 <= ord(c) < 127 for c in key)):
            # HTTP strips a header's surrounding spaces, and a client cannot send other characters
            raise ConfigError(
                "--api-key must be printable ASCII without spaces (a client could never send it)",
                hint="check for a trailing newline or carriage return where the key was read",
            )
        if not (self.idle_minutes >= 0 and self.idle_minutes < float("inf")):  # nan fails both
            raise ConfigError(f"--idle-minutes must be a number >= 0, got {self.idle_minutes:g}")
        if not 0 <= self.prefix_cache <= 1 << 20:
            raise ConfigError(f"--prefix-cache must be in 0..1048576 (MiB), got {self.prefix_cache}")
        if not 0 <= self.prefill_chunk <= 1 << 20:
            raise ConfigError(f"--prefill-chunk must be in 0..1048576 (tokens), got {self.prefill_chunk}")
        for origin in self.allowed_origins:
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ConfigError(
                    f"--allowed-origins: {origin!r} is not an origin",
                    hint="an origin is scheme://host[:port] with no path or trailing slash, "
                    "as a browser sends it (http://localhost:3000), or *",
                )


_ORIGIN = re.compile(r"https?://[^\s/?#@]+")


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (port 0: any free one); a ConfigError when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        taken = exc.errno == errno.EADDRINUSE
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}",
            hint="choose another --port (0 picks a free one)"
            if taken
            else "check --host: it must be an address of this machine",
        ) from None
    sock.listen(128)
    return sock


def defaults(pair, options: ServeOptions) -> GenerationConfig:
    """A request's drafting and budget when it names none: run's default method at the device's
    k, or prompt lookup on a pair loaded without a draft model (a bench of plain and lookup only)."""
    method = DEFAULT_METHOD if pair.draft is not None else Method.LOOKUP
    config = GenerationConfig(
        method=method,
        max_new_tokens=options.max_tokens,
        device_draft_tokens=True,
        device_confidence=True,
        sampling=SamplingConfig(temperature=1.0),
    )
    config, _ = resolve_draft_length(pair, config)
    return config


def servable(pair) -> list[str]:
    """The methods this pair can serve (the playground's picker)."""
    return [m.value for m in Method if refusal(pair, m) is None]


def width_caps(pair, widest: int, k: int, quiet: bool) -> WidthCaps:
    """A model chain's draft length at each batch width up to `widest`: the device's `k` for one
    row (what `specgen run` drafts), scaled down as the measured costs of wider rounds say
    (widths.WidthCosts, measured once per machine and pair, cached), down to 0 (plain rounds)
    where a wide verify no longer pays; and at each width the fewest rows that draft with the
    model together (`WidthCosts.least`). Empty without a draft model, and for an EAGLE-3 head (a
    head's step is a small fraction of a target step at any width: its chains keep their k)."""
    if pair.draft is None or pair.draft.vocabulary is Vocabulary.HEAD:
        return WidthCaps()
    with status("measuring forward costs at several batch widths (once per machine) ...", quiet):
        costs = width_costs(pair)
    alone = max(costs.cap(1), 1)
    caps = {1: k}  # one row: the device's own choice, as `specgen run` makes it
    for width in range(2, widest + 1):
        best = costs.cap(width)
        caps[width] = 0 if best == 0 else max(1, min(k, round(k * best / alone)))
    # one row drafts alone, as `specgen run` does, whatever the costs say
    least = {1: 1} | {width: costs.least(width) for width in range(2, widest + 1)}
    return WidthCaps(caps, least)


def warm_up(scheduler: Scheduler, config: GenerationConfig) -> None:
    """Short generations on the default engine before the first request, so that it pays no
    one-time costs (first-touch allocations; on a GPU the compilation and capture). Two prompt
    lengths: compiled layers see a second prefill length and then take any length."""
    engine = scheduler.ready(config)
    tokenizer = scheduler.pair.target.tokenizer
    short = replace(config, max_new_tokens=4, sampling=SamplingConfig())
    for text in ("Hello", "Write a short poem about the sea, then explain its meter in one sentence."):
        ids = encode_prompt(tokenizer, text)  # at most half the context: a short-context model starts too
        driver.generate(engine, tokenizer, ids[-max(1, engine.context_length // 2) :], short, Silent())


class Running(uvicorn.Server):
    """A prepared server: uvicorn's, with what its routes need (`state`), its bound socket and
    its record's path; `serve_until_stopped()` answers until stopped. Unlike uvicorn's, SIGINT
    and SIGTERM end `run()` after the graceful shutdown instead of being raised again there:
    uvicorn re-raises them, and SIGTERM's default action ended the process before the server
    removed its record (which holds its token) or said why it stopped. The record is written
    once it listens, with its signal handlers in place: a record written before them let a
    quick SIGTERM (`serve --stop`) end the process with the record left."""

    def __init__(self, config: uvicorn.Config, sock: socket.socket, state: ServerState, record: Path):
        super().__init__(config)
        self.sock, self.state, self.record = sock, state, record
        self.ready: Callable[[], None] = lambda: None  # runs once the server answers

    @property
    def scheduler(self) -> Scheduler:
        return self.state.scheduler

    @property
    def token(self) -> str:
        """The local token (in the record): the first of the keys the routes take."""
        return self.state.keys[0]

    def handle_exit(self, sig, frame) -> None:
        # the first signal drains (running rows may finish for DRAIN_SECONDS), a second one ends
        # them at once; off the signal handler: the scheduler's lock may be held right here
        grace = 0.0 if self.should_exit else DRAIN_SECONDS
        threading.Thread(target=self.scheduler.stop, args=(grace,), daemon=True).start()
        if not self.should_exit:  # not uvicorn's forced exit on a second one: it cancels the app's
            super().handle_exit(
                sig, frame
            )  # lifespan mid-wait (a traceback); the rows' connections close anyway

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit:
            discovery.write_record(self.record, {**self.state.info, "token": self.token})
            self.ready()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        for sig in handled:
            signal.signal(sig, self.handle_exit)
        try:
            yield
        finally:  # stopped: another Ctrl-C while the record is removed changes nothing (it said
            for sig in handled:  # "interrupted" and exited 130 for a server that had stopped cleanly)
                signal.signal(sig, signal.SIG_IGN)

    def serve_until_stopped(self, ready: Callable[[], None] = lambda: None) -> None:
        """Answer (blocking) until stopped; the record is there meanwhile, gone afterwards.
        `ready` runs once the server answers (`--open` opens the playground then)."""
        self.ready = ready
        self.scheduler.start()
        try:
            self.run(sockets=[self.sock])
        finally:
            self.scheduler.stop()
            if (discovery.read_record(self.record) or {}).get(
                "token"
            ) == self.token:  # ours, not a later server's
                self.record.unlink(missing_ok=True)
            self.sock.close()


def prepare(
    settings: ModelSettings, options: ServeOptions, quiet: bool = False, log=None, pair=None
) -> Running:
    """Check the options, bind, load the pair (unless given) and warm it up; nothing is served yet."""
    options.check()
    discovery.private_dir()
    sock = bind(options.host, options.port)
    try:
        return _prepared(settings, options, quiet, log or sys.stderr, pair, sock)
    except BaseException:
        sock.close()
        raise


def _prepared(settings, options, quiet, log, pair, sock) -> Running:
    token = secrets.token_urlsafe(32)
    port = sock.getsockname()[1]
    local = options.host if loopback(options.host) else "127.0.0.1"
    url = f"http://{'[' + local + ']' if ':' in local else local}:{port}"
    keys = [token] + ([options.api_key] if options.api_key else [])
    state = serving_state(settings, options, quiet, log, pair, url, keys)
    config = uvicorn.Config(
        create_app(state),
        http=TimedH11,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=DRAIN_SECONDS + 1,
    )
    return Running(config, sock, state, discovery.record_path(settings))


def serving_state(settings, options, quiet, log, pair, url: str, keys: list[str]) -> ServerState:
    """What the routes need, the pair loaded (unless given) and warmed up and its scheduler (not
    started yet): for this process's uvicorn, or for a Ray Serve replica (replicas.py)."""
    pair = pair or load(settings, Method.CHAIN, quiet=quiet)
    pair.keep_prefixes(options.prefix_cache)
    config = defaults(pair, options)
    metrics = Metrics()

    def say(line: str) -> None:  # one line per request in the server's output (the --detach log)
        try:
            log.write(f"{time.strftime('%H:%M:%S')} {line}\n")
            log.flush()
        except (OSError, ValueError):
            pass

    scheduler = Scheduler(
        pair,
        options.max_batch_size,
        options.max_queue,
        metrics,
        lambda job, stats: say(
            f"{summary_line(Outcome('', [], stats))}; prompt {stats.prompt_tokens} tokens"
        ),
        width_caps(pair, options.max_batch_size, config.draft_tokens, quiet),
        options.prefill_chunk,
    )
    warm_up(scheduler, config)
    release_pool()  # this thread is done with tensors: its OpenMP workers would slow the engine thread's
    names = pair.target.name + (f" + draft {pair.draft.name}" if pair.draft is not None else "")
    info = {
        "pid": os.getpid(),
        "models": f"target {names}",
        "since": time.time(),
        "url": url,
        "model": pair.target.name,
        "draft": pair.draft.name if pair.draft is not None else None,
        "methods": servable(pair),
        "method": config.method.value,
        "draft_tokens": config.draft_tokens,
        "key": discovery.settings_key(settings),
    }  # what its record is named after (discovery.proof)
    state = ServerState(
        scheduler,
        config,
        keys,
        pair.target.name,
        {settings.target},
        info,
        pair.target.context_length,
        metrics,
        say,
        options.allowed_origins,
    )
    return state


def run_server(
    settings: ModelSettings, options: ServeOptions, quiet: bool = False, browse: bool = False
) -> str:
    """Load, warm up, listen and answer until stopped (SIGINT, SIGTERM, idle); why it stopped.
    One server per model options: the lock (discovery.hold) is taken before anything loads.
    `browse`: open the playground in the user's browser once the server answers."""
    options.check()
    discovery.private_dir()
    discovery.hold(settings)  # held until this process ends
    running = prepare(settings, options, quiet)
    stopped = {"why": "stopped by a signal"}
    if options.idle_minutes:
        threading.Thread(
            target=_watch_idle, args=(running, options.idle_minutes, stopped), daemon=True
        ).start()
    if not quiet:
        url = running.state.info["url"]
        note(
            f"specgen: server ready at {url} (pid {os.getpid()}, {running.state.info['models']}); "
            f"OpenAI API at {url}/v1"
        )
        note(f"specgen: playground at {url}/ (its key: {playground_key(options, running.token)})")
        note("specgen: `specgen run` with the same model options generates here; Ctrl-C stops the server")
    running.serve_until_stopped(
        lambda: playground.open_page(running.state.info["url"], note) if browse else None
    )
    return stopped["why"]


def playground_key(options: ServeOptions, token: str) -> str:
    """What to type into the playground's key box: the --api-key (never printed), or, on a
    loopback server without one, the local token (the record in the private runtime directory
    holds it too)."""
    return "your --api-key" if options.api_key else f"this server's local token {token}"


def _watch_idle(running: Running, minutes: float, stopped: dict) -> None:
    scheduler = running.scheduler
    while not running.should_exit:
        time.sleep(min(5.0, minutes * 60 / 4))
        if not scheduler.busy() and time.monotonic() - scheduler.idle_since > minutes * 60:
            stopped["why"] = f"no request for {minutes:g} minutes"
            running.should_exit = True
