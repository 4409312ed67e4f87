"""`specgen serve`: options -> specgen/serve/. Foreground by default; --detach starts it in
the background and returns once it answers; --stop stops the one with the same model options.
No tensor code here."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Annotated

import typer

from specgen.cli.options import (CompileOpt, DeviceOpt, DraftDeviceOpt, DraftOpt, DraftQuantOpt, DtypeOpt, TargetOpt,
                                 TargetQuantOpt, generation_config, user_errors)
from specgen.config import ModelSettings
from specgen.errors import ConfigError
from specgen.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specgen.serve import client
from specgen.serve.protocol import runtime_dir, settings_key
from specgen.status import status


def serve(
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    device: DeviceOpt = "auto",
    draft_device: DraftDeviceOpt = None,
    dtype: DtypeOpt = "auto",
    draft_quant: DraftQuantOpt = "auto",
    target_quant: TargetQuantOpt = "auto",
    compile: CompileOpt = "auto",
    idle_minutes: Annotated[float, typer.Option(
        "--idle-minutes", help="Stop after this many minutes without a request (0: never).")] = 0.0,
    detach: Annotated[bool, typer.Option(
        "--detach", help="Start in the background; return once it answers (its log: the path printed).")] = False,
    stop: Annotated[bool, typer.Option("--stop", help="Stop the running server with these model options.")] = False,
    list_: Annotated[bool, typer.Option("--list", help="List your running servers (pid, models, since, socket).")] = False,
) -> None:
    """Keep the pair loaded: `specgen run` with the same model options then starts in a moment.

    A warm `specgen run` otherwise spends many seconds before its first token (imports, int8
    packing, tokenizer); with a server it sends its request over a Unix socket instead. Decoding
    options (method, k, sampling, seed) still come with each run; `run --no-server` loads
    in its own process."""
    with user_errors():
        if idle_minutes < 0:
            raise ConfigError(f"--idle-minutes must be >= 0, got {idle_minutes:g}")
        if detach + stop + list_ > 1:
            raise ConfigError("give one of --detach, --stop and --list")
        if list_:
            _list(client.running())
            return
        settings = ModelSettings(target, draft, device, draft_device, dtype, draft_quant, compile, target_quant)
        if stop:
            info = client.shutdown(settings)
            if info is None:
                raise ConfigError("no specgen server with these model options is running",
                                  hint="`specgen serve --list` shows the running ones")
            typer.echo(f"stopped the specgen server (pid {info['pid']}, {info['models']})", err=True)
            return
        if client.ping(settings) is not None:
            raise ConfigError("a specgen server with these model options is already running",
                              hint="`specgen serve --stop` with the same options stops it")
        if detach:
            _detach(settings, idle_minutes)
            return
        from specgen.serve.server import run_server  # torch: only the server process loads it

        config = generation_config("chain", 4, "device", 0.0, 0, 1.0, None)
        why = run_server(settings, config, idle_minutes)
        typer.echo(f"specgen server stopped: {why}", err=True)


def _list(servers: list[dict]) -> None:
    if not servers:
        typer.echo("no specgen server is running", err=True)
        return
    for info in servers:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
        typer.echo(f"pid {info['pid']}  {info['models']}  since {since}  {info['socket']}")


def _detach(settings, idle_minutes: float) -> None:
    """Start `specgen serve` with the same options as a background process (its own session, so
    closing the terminal does not stop it) and wait until it answers or fails."""
    directory = runtime_dir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {directory}: {exc.strerror or exc}",
                          hint="set SPECGEN_RUNTIME_DIR to a directory you can write") from None
    log = directory / f"{settings_key(settings)}.log"
    args = [sys.executable, "-m", "specgen", "serve", "--target", settings.target, "--draft", settings.draft,
            "--device", settings.device, "--dtype", settings.dtype, "--draft-quant", settings.draft_quant,
            "--target-quant", settings.target_quant, "--compile", settings.compile,
            "--idle-minutes", f"{idle_minutes:g}"]
    if settings.draft_device is not None:
        args += ["--draft-device", settings.draft_device]
    with open(log, "wb") as out:
        process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                   start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        with status(f"starting the specgen server in the background (pid {process.pid}; log {log}) ...", False):
            while process.poll() is None:
                info = client.ping(settings, timeout=2.0)
                if info is not None:
                    typer.echo(f"specgen server ready: pid {info['pid']}, {info['models']}; log {log}", err=True)
                    return
                time.sleep(0.5)
    except KeyboardInterrupt:
        process.terminate()
        raise typer.Exit(130) from None
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    last = lines[-1] if lines else f"exit status {process.returncode}"
    raise ConfigError(f"the specgen server did not start: {last.removeprefix('error: ')}", hint=f"log: {log}")
