"""A prompt set on a Ray cluster (`specgen run --prompts-file F --output OUT --ray auto|ADDRESS`).

Ray is an optional extra (`pip install 'specgen[ray]'`) and is imported here only, late.
Actors each load the pair once (`Worker`: a `Decoder` with one GPU, or a set number of CPU
threads) and are spread over the nodes (`SPREAD`). The driver keeps the queue: each actor has at
most `IN_FLIGHT` small batches of the queue at a time and gets the next one when one comes back
(work stealing: a slow actor simply takes fewer, no fixed shards), and each batch decodes with
the same engine and dynamic batching as a local run. Results come back to the driver, which
writes them. An actor that dies has its unfinished batches put back at the head of the queue
for the others; a result is handed on only once per prompt.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections import deque
from typing import Iterator

from specgen.config import GenerationConfig, ModelSettings
from specgen.errors import ConfigError, PromptError, SpecgenError, first_line, one_line
from specgen.status import note

INSTALL_HINT = "pip install 'specgen[ray]'"
CONNECT_SECONDS = 3.0
GCS_WAIT = "RAY_gcs_server_port_wait_time_s"  # Ray's own wait for a head (about 20 s by default)
IN_FLIGHT = 2  # batches per actor: the next one waits in the actor while the current one decodes


def import_ray():
    """The `ray` module, or one ConfigError with the install hint."""
    try:
        import ray  # optional extra: only a --ray run needs it
    except ImportError:
        raise ConfigError("--ray needs Ray, which is not installed", hint=INSTALL_HINT) from None
    return ray


def connect(address: str):
    """Join the cluster `address` names ('auto': $RAY_ADDRESS, or the cluster `ray start` began
    on this machine, else a new local one; 'local': a new local one). Returns (ray, whether this
    call started the session). An address that does not answer within CONNECT_SECONDS (given, or
    $RAY_ADDRESS under 'auto') is one ConfigError naming it."""
    ray = import_ray()
    kind, named = check(address)
    address = named or address
    if ray.is_initialized():  # this process is already in a cluster (a test, a notebook)
        return ray, False
    try:
        if not named:
            ray.init(
                address="local" if kind == "local" else None,
                logging_level=logging.ERROR,
                log_to_driver=False,
                include_dashboard=False,
            )
        else:
            with _quick_and_quiet():
                ray.init(address=named, logging_level=logging.ERROR, log_to_driver=False)
    except ConnectionError as exc:  # Ray's own first line says why (an auth token it wants, say)
        said = first_line(exc, 200)
        raise ConfigError(
            f"cannot connect to the Ray cluster at {address}: "
            + (f"no Ray head answered there ({said})" if said else "no Ray head answered there"),
            hint="start one with `ray start --head`, or use --ray auto",
        ) from None
    except Exception as exc:  # Ray's own failures are many types: one line naming the address
        first = first_line(exc, 200) or type(exc).__name__
        raise ConfigError(f"cannot connect to the Ray cluster at {address}: {first}") from None
    return ray, True


def check(address: str) -> tuple[str, str]:
    """(`auto`, `local` or the address, the head to join: "" for a local cluster), once the head
    answers: called before a run touches its OUT, and by `connect`. `auto` with a $RAY_ADDRESS
    that is gone is one line, not minutes of Ray's retries."""
    address = address.strip()
    if not address:
        raise ConfigError("--ray needs a cluster's ADDRESS (host:port), 'auto' or 'local'")
    kind = address.lower() if address.lower() in ("auto", "local") else address
    named = (
        os.environ.get("RAY_ADDRESS", "").strip() if kind == "auto" else "" if kind == "local" else address
    )
    if named.lower() in ("", "auto", "local"):
        return kind, ""  # a new local cluster, or the one `ray start` began here
    try:
        _check_reachable(named)
    except ConfigError as exc:
        if kind != "auto":
            raise
        raise ConfigError(f"{exc} ($RAY_ADDRESS)", hint="unset RAY_ADDRESS for a local cluster") from None
    return kind, named


@contextlib.contextmanager
def _quick_and_quiet():
    """While joining a cluster: Ray's wait for its head cut from 20 to CONNECT_SECONDS (it reads
    the variable when it connects), and its C++ core's retry warnings, written straight to file
    descriptor 2, kept off the terminal (a failure is our one line)."""
    previous = os.environ.get(GCS_WAIT)
    os.environ[GCS_WAIT] = str(int(CONNECT_SECONDS))
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
        if previous is None:
            os.environ.pop(GCS_WAIT, None)
        else:
            os.environ[GCS_WAIT] = previous


def _check_reachable(address: str) -> None:
    """A quick TCP connect to the head (Ray itself retries for a minute before it gives up)."""
    client = address.startswith("ray://")
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":") if ":" in hostport else (hostport, "", "")
    try:
        port_number = int(port) if port else (10001 if client else 6379)
    except ValueError:
        raise ConfigError(f"cannot connect to the Ray cluster at {address}: '{port}' is not a port") from None
    if not 0 < port_number < 65536:
        raise ConfigError(f"cannot connect to the Ray cluster at {address}: {port_number} is not a port")
    try:
        with socket.create_connection(
            (host.strip("[]") or "127.0.0.1", port_number), timeout=CONNECT_SECONDS
        ) as sock:
            if os.environ.get("RAY_USE_TLS", "").strip().lower() not in ("1", "true"):
                answered = _speaks_grpc(sock)
            else:  # a TLS head does not answer a plaintext greeting: the connect is all we can check
                answered = True
    except OSError as exc:
        reason = "no answer" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise ConfigError(
            f"cannot connect to the Ray cluster at {address}: {reason}",
            hint="start one with `ray start --head`, or use --ray auto",
        ) from None
    if not answered:  # Ray would wait minutes on it, silently
        raise ConfigError(
            f"cannot connect to the Ray cluster at {address}: something listens there, but not a Ray head",
            hint="give the head's address (`ray status` on it), or use --ray auto",
        )


HTTP2_GREETING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(
    [0, 0, 0, 4, 0, 0, 0, 0, 0]
)  # and empty SETTINGS


def _speaks_grpc(sock: socket.socket) -> bool:
    """Whether the listener answers HTTP/2's greeting with its SETTINGS frame, as a Ray head's
    gRPC server (and a Ray client server) does at once; a web server, a silent listener or
    anything else does not within CONNECT_SECONDS."""
    sock.settimeout(CONNECT_SECONDS)
    sock.sendall(HTTP2_GREETING)
    head = b""
    try:
        while len(head) < 4:
            chunk = sock.recv(4 - len(head))
            if not chunk:
                return False
            head += chunk
    except TimeoutError:
        return False
    return head[3] == 4  # a frame header: 3 bytes of length, then its type (4: SETTINGS)


class Worker:
    """A Ray actor's state: a Decoder, or the one-line error its load raised."""

    def __init__(
        self, settings: ModelSettings, config: GenerationConfig, raw: bool, system: str | None, threads: int
    ):
        from specgen.scale.local import Decoder  # torch and the models: in the actor only

        self.decoder, self.error = None, None
        try:
            self.decoder = Decoder(settings, config, raw, system, quiet=True, threads=threads)
        except SpecgenError as exc:
            self.error = str(exc) + (f" ({exc.hint})" if exc.hint else "")

    def ready(self) -> str | None:
        return self.error

    def check(self, items: list[tuple[int, str]]) -> str | None:
        """Why a prompt of the run cannot be decoded (the first such, as a local run names it), or None."""
        try:
            self.decoder.encode(items)
        except SpecgenError as exc:
            return str(exc) + (f" ({exc.hint})" if exc.hint else "")
        return None

    def decode(self, items: list[tuple[int, str]], batch_size: int):
        return self.decoder.decode(items, batch_size)


def actor_plan(
    ray,
    device: str | None,
    actors: int | None,
    threads: int,
    names: tuple[str, str] = ("--ray-actors", "--ray-threads"),
) -> tuple[int, dict]:
    """How many actors and what each reserves: a GPU each when the cluster has GPUs and the
    device is not the CPU, else `threads` CPUs each; by default as many as the cluster fits.
    More than the cluster holds now is one ConfigError: Ray would wait for them forever. `names`
    are the options that set the count and the threads (serve --ray's are --replicas and --ray-threads)."""
    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), resources.get("CPU", 0)
    hint = "ask for fewer, or add nodes first; `ray status` shows what the cluster holds"
    if gpus and (device or "auto").lower() != "cpu":
        count, reserve = actors or gpus, {"num_gpus": 1, "num_cpus": threads}
        if count > gpus:
            raise ConfigError(
                f"{names[0]} {count}: each needs a GPU, and the Ray cluster has {gpus}", hint=hint
            )
    else:
        count, reserve = actors or int(cpus // threads), {"num_cpus": threads}
        if not count:
            raise ConfigError(
                f"{names[1]} {threads}: each reserves {threads} CPUs, and the Ray cluster has {cpus:g}",
                hint=hint,
            )
    if count * threads > cpus:
        raise ConfigError(
            f"{names[0]} {count} of {names[1]} {threads} need {count * threads} CPUs, and the Ray "
            f"cluster has {cpus:g}",
            hint=hint,
        )
    return count, reserve


class RayRun:
    """The driver's side of a run: iterate for (index, Outcome) as batches come back."""

    def __init__(
        self,
        ray,
        settings: ModelSettings,
        config: GenerationConfig,
        raw: bool,
        system: str | None,
        items: list[tuple[int, str]],
        batch_size: int,
        actors: int | None = None,
        threads: int = 1,
        chunk: int | None = None,
        owned: bool = False,
    ):
        self.ray, self.owned = ray, owned  # owned: this run started the Ray session, and ends it
        self.queue = deque(items)
        self.batch_size = batch_size
        self.chunk = chunk or batch_size
        count, reserve = actor_plan(ray, settings.device, actors, threads)
        remote = ray.remote(Worker).options(scheduling_strategy="SPREAD", max_restarts=0, **reserve)
        self.actors = [remote.remote(settings, config, raw, system, threads) for _ in range(count)]
        self.retried = 0  # prompts put back in the queue because their actor died
        self.last_actor = None  # the actor whose batch was handed on last

    def wait_ready(self, quiet: bool = False) -> int:
        """Wait for every actor's load; a load error (the pair itself: every actor would say the
        same) is one SpecgenError. An actor that died while starting (an unexpected error in it,
        its node lost or out of memory) is left out with a notice, and the run goes on with the
        others; with none left, one SpecgenError says why. Returns the actor count."""
        from ray.exceptions import RayActorError  # optional extra, as import_ray

        started, causes = [], []
        for actor, ref in [(actor, actor.ready.remote()) for actor in self.actors]:
            try:
                failed = self.ray.get(ref)
            except RayActorError as exc:
                causes.append(_last_line(exc))
                continue
            if failed:
                raise SpecgenError(f"a Ray actor could not load the pair: {failed}")
            started.append(actor)
        if not started:
            raise SpecgenError(f"no Ray actor could start: {causes[0]}")
        if causes and not quiet:
            note(
                f"specgen: {len(causes)} of {len(self.actors)} Ray actors could not start ({causes[0]}); "
                f"going on with {len(started)}"
            )
        self.actors = started
        # every prompt checked before any is decoded, as locally: a prompt too long for the
        # context would otherwise stop the run part way, in a batch that names no prompt of the
        # file. One actor checks them all (a tokenizer pass, small beside decoding); if it dies,
        # the next one does
        for actor in started:
            try:
                failed = self.ray.get(actor.check.remote(list(self.queue)))
            except RayActorError:
                continue
            if failed:
                raise PromptError(failed)
            break
        return len(started)

    def __iter__(self) -> Iterator[tuple[int, object]]:
        ray = self.ray
        # optional extra, as import_ray. A batch's result over Ray's inline size (100 KB: a large
        # --batch-size or -n) waits in its actor's node until fetched: a node lost meanwhile takes
        # the result with it, an ObjectLostError, and not a RayActorError
        from ray.exceptions import ObjectLostError, RayActorError

        live = list(self.actors)
        in_flight: dict = {}  # ObjectRef -> (actor, its batch)
        handed: set[int] = set()

        def feed(actor) -> None:
            while self.queue and sum(1 for a, _ in in_flight.values() if a is actor) < IN_FLIGHT:
                batch = [self.queue.popleft() for _ in range(min(self.chunk, len(self.queue)))]
                in_flight[actor.decode.remote(batch, self.batch_size)] = (actor, batch)

        for actor in live:
            feed(actor)
        while in_flight:
            [ref], _ = ray.wait(list(in_flight), num_returns=1)
            actor, batch = in_flight.pop(ref)
            try:
                results = ray.get(ref)
            except (
                RayActorError,
                ObjectLostError,
            ):  # the actor (or its node) died: its batches go back to the others
                self.queue.extendleft(reversed(batch))
                self.retried += len(batch)
                if actor in live:
                    live.remove(actor)
                    note(f"specgen: a Ray actor died; its {len(batch)} prompts go to the {len(live)} others")
                if not live:
                    raise SpecgenError(
                        f"every Ray actor died; {len(self.queue)} prompts were not decoded",
                        hint="rerun the same command: it finishes the rest",
                    ) from None
                for other in live:
                    feed(other)
                continue
            except ray.exceptions.RayTaskError as exc:  # a failure inside decode: one line, as locally
                cause = getattr(exc, "cause", None) or exc
                if isinstance(cause, SpecgenError):
                    raise cause from None
                raise SpecgenError(f"a Ray actor failed: {one_line(cause, 200)}") from None
            if actor in live:
                feed(actor)
            self.last_actor = actor
            for index, outcome in results:
                if index not in handed:
                    handed.add(index)
                    yield index, outcome

    def stop(self) -> None:
        """End every actor (after the run, on Ctrl-C or on an error), and a session we started."""
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:  # already dead: nothing to end
                pass
        if self.owned:
            self.ray.shutdown()


def _last_line(exc: Exception) -> str:
    """Why a Ray actor died, in one line: Ray's message ends with the error that ended it."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:200]
