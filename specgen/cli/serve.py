"""`specgen serve`: an OpenAI-compatible HTTP server over the speculative engine
(specgen/serve/). Foreground by default; --detach starts it in the background and returns
once it answers; --stop stops the one with the same model options; --list shows them all;
--ray serves it as a Ray Serve deployment (serve_ray.py). No tensor code here."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from typing import Annotated, Optional

import typer

import specgen.cli.remote as remote
from specgen.cli.options import model_args, user_errors, with_options
from specgen.cli.serve_ray import serve_on_ray, stop_on_ray
from specgen.config import ModelSettings
from specgen.errors import ConfigError
from specgen.serve import discovery
from specgen.status import status

STARTUP_TIMEOUT = 900.0  # a first start may download and convert the models
BROWSER_SECONDS = 10.0  # how long --open waits for the browser's launcher


@with_options()
def serve(
    *,
    models: ModelSettings,
    host: Annotated[
        str, typer.Option("--host", help="Address to listen on (another than loopback needs --api-key).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free one).")] = 8000,
    api_key: Annotated[
        Optional[str],
        typer.Option(
            "--api-key",
            help="A key clients must send (Authorization: Bearer KEY); local `specgen run` uses its own "
            "token. Default: $SPECGEN_API_KEY.",
            envvar="SPECGEN_API_KEY",
            show_default=False,
        ),
    ] = None,
    max_batch_size: Annotated[
        int, typer.Option("--max-batch-size", help="Requests decoded together at most.")
    ] = 8,
    max_queue: Annotated[
        int, typer.Option("--max-queue", help="Requests waiting at most; more get 503.")
    ] = 64,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="A request's token budget when it sets none.")
    ] = 512,
    idle_minutes: Annotated[
        float,
        typer.Option("--idle-minutes", help="Stop after this many minutes without a request (0: never)."),
    ] = 0.0,
    prefix_cache: Annotated[
        int,
        typer.Option(
            "--prefix-cache",
            help="MiB of requests' K/V kept per model: a prompt that starts as an earlier "
            "one did (a system prompt, a chat's conversation) prefills only the rest (0: off).",
        ),
    ] = 256,
    suffix_scope: Annotated[
        str,
        typer.Option(
            "--suffix-scope",
            help="Who shares a suffix memory: key (the clients of one API key), shared (every client: "
            "acceptance and timing then tell a client what others wrote) or request (none).",
        ),
    ] = "key",
    prefill_chunk: Annotated[
        int,
        typer.Option(
            "--prefill-chunk",
            help="On a CPU, a prompt longer than this joining requests that decode is prefilled this "
            "many tokens per round of theirs, so their streams do not stall for its whole "
            "prefill (0: whole).",
        ),
    ] = 256,
    allowed_origins: Annotated[
        Optional[str],
        typer.Option(
            "--allowed-origins",
            help="Web pages whose scripts may call the server, comma-separated origins as a browser "
            "sends them (http://localhost:3000), or * (CORS; they still need the key). "
            "Default: none.",
            show_default=False,
        ),
    ] = None,
    open_: Annotated[
        bool,
        typer.Option("--open", help="Open the playground (GET /) in your browser once the server answers."),
    ] = False,
    detach: Annotated[
        bool,
        typer.Option(
            "--detach", help="Start in the background; return once it answers (its log: the path printed)."
        ),
    ] = False,
    stop: Annotated[
        bool,
        typer.Option(
            "--stop",
            help="Stop the running server with these model options (with --ray: delete the cluster's specgen "
            "deployment).",
        ),
    ] = False,
    list_: Annotated[
        bool, typer.Option("--list", help="List your running servers (pid, models, since, url).")
    ] = False,
    ray_address: Annotated[
        Optional[str],
        typer.Option(
            "--ray",
            help="Serve as a Ray Serve deployment on this cluster: 'auto' or its ADDRESS (needs --api-key; "
            "pip install 'specgen\\[ray]').",
            show_default=False,
        ),
    ] = None,
    replicas: Annotated[
        int,
        typer.Option(
            "--replicas", help="With --ray: replicas behind the one endpoint, each loading the pair once."
        ),
    ] = 1,
    ray_threads: Annotated[
        int, typer.Option("--ray-threads", help="With --ray: CPU threads (and CPUs reserved) per replica.")
    ] = 1,
) -> None:
    """Serve the pair over an OpenAI-compatible HTTP API, batching concurrent requests.

    `specgen run` with the same model options then generates there and starts in a moment;
    any OpenAI client can use it too (base URL http://HOST:PORT/v1)."""
    from specgen.serve.server import ServeOptions  # the server's modules load torch: only once it runs

    with user_errors():
        origins = tuple(o.strip() for o in allowed_origins.split(",")) if allowed_origins is not None else ()
        options = ServeOptions(
            host=host,
            port=port,
            api_key=api_key,
            max_batch_size=max_batch_size,
            max_queue=max_queue,
            idle_minutes=idle_minutes,
            max_tokens=max_tokens,
            prefix_cache=prefix_cache,
            prefill_chunk=prefill_chunk,
            allowed_origins=origins,
        )
        if detach + stop + list_ > 1:
            raise ConfigError("give one of --detach, --stop and --list")
        if list_:
            _list()
            return
        settings = replace(models, memory=replace(models.memory, suffix_scope=suffix_scope))
        if ray_address is not None:
            if detach:
                raise ConfigError("--ray serves in the foreground; --detach is for a local server")
            if stop:
                stop_on_ray(ray_address)
            else:
                serve_on_ray(
                    settings, options, ray_address, replicas, ray_threads, _browse if open_ else None
                )
            return
        if replicas != 1 or ray_threads != 1:
            raise ConfigError("--replicas and --ray-threads go with --ray")
        if stop:
            _stop(settings)
            return
        options.check()
        discovery.private_dir()  # the runtime directory must be usable before anything loads
        if remote.find(settings) is not None:
            raise ConfigError(
                "a specgen server with these model options is already running",
                hint="`specgen serve --stop` with the same options stops it",
            )
        if detach:
            _detach(settings, options, open_)
            return
        from specgen.serve.server import run_server  # torch: only the server process loads it

        why = run_server(settings, options, browse=open_)
        typer.echo(f"specgen server stopped: {why}", err=True)


def _browse(url: str) -> None:
    from specgen.serve.playground import open_page  # FastAPI: only when a page is opened

    open_page(url, lambda line: typer.echo(line, err=True)).join(BROWSER_SECONDS)  # before this process ends


def _list() -> None:
    directory = discovery.runtime_dir()
    why = discovery.unsafe(directory)
    if why is not None:
        raise ConfigError(f"cannot look for servers: {why}", hint=discovery.fix_hint(directory))
    servers = remote.running()
    silent = remote.silent(servers)
    if not servers and not silent:
        typer.echo("no specgen server is running", err=True)
        return
    for info in servers:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
        typer.echo(f"pid {info['pid']}  {info['models']}  since {since}  {info['url']}")
    for key, pid in silent:  # a server holds its options' lock from before it loads until it ends
        typer.echo(
            f"pid {pid or '?'}  not answering yet (loading, or its record is lost)  "
            f"log {directory / (key + '.log')}"
        )


def _stop(settings: ModelSettings) -> None:
    why = discovery.unsafe(discovery.runtime_dir())
    if why is not None:
        raise ConfigError(f"cannot look for the server: {why}")
    info = remote.shutdown(settings)
    if info is None:
        raise ConfigError(
            "no specgen server with these model options is running",
            hint="`specgen serve --list` shows the running ones",
        )
    typer.echo(f"stopped the specgen server (pid {info['pid']}, {info['models']})", err=True)


def _detach(settings: ModelSettings, options, browse: bool = False) -> None:
    """Start `specgen serve` with the same options as a background process (its own session, so
    closing the terminal does not stop it) and wait until it answers or fails. Its log is
    appended to, never truncated: a second start cannot erase a running server's log."""
    log = discovery.log_path(settings)
    args = [
        sys.executable,
        "-m",
        "specgen",
        "serve",
        *model_args(settings),
        "--suffix-scope",
        settings.memory.suffix_scope.value,
        "--host",
        options.host,
        "--port",
        str(options.port),
        "--max-batch-size",
        str(options.max_batch_size),
        "--max-queue",
        str(options.max_queue),
        "--max-tokens",
        str(options.max_tokens),
        "--idle-minutes",
        f"{options.idle_minutes:g}",
        "--prefix-cache",
        str(options.prefix_cache),
        "--prefill-chunk",
        str(options.prefill_chunk),
    ]
    if options.allowed_origins:
        args += ["--allowed-origins", ",".join(options.allowed_origins)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if options.api_key:
        env["SPECGEN_API_KEY"] = options.api_key  # not on the command line, where `ps` shows it
    try:
        out = open(log, "ab")
    except OSError as exc:
        raise ConfigError(f"cannot write the server's log {log}: {exc.strerror or exc}") from None
    with out:
        start = out.tell()
        out.write(f"--- specgen serve --detach, {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        out.flush()
        process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, env=env
        )
    deadline = time.monotonic() + STARTUP_TIMEOUT
    try:
        with status(
            f"starting the specgen server in the background (pid {process.pid}; log {log}) ...", False
        ):
            while process.poll() is None and time.monotonic() < deadline:
                server = remote.find(settings, timeout=2.0)
                if server is not None:
                    typer.echo(
                        f"specgen server ready at {server.url}: pid {server.info['pid']}, "
                        f"{server.info['models']}; log {log}; playground {server.url}/",
                        err=True,
                    )
                    if browse:
                        _browse(server.url)
                    return
                time.sleep(0.5)
    except KeyboardInterrupt:
        process.terminate()
        raise typer.Exit(130) from None
    if process.poll() is None:
        process.terminate()
    with open(log, "rb") as handle:
        handle.seek(start)
        lines = [line for line in handle.read().decode(errors="replace").splitlines() if line.strip()]
    # its error line, not merely the log's last: another server starting at once writes there too
    errors = [line for line in lines if line.startswith("error:")]
    last = errors[-1] if errors else lines[-1] if len(lines) > 1 else f"exit status {process.returncode}"
    raise ConfigError(f"the specgen server did not start: {last.removeprefix('error: ')}", hint=f"log: {log}")
