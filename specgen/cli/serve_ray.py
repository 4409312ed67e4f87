"""`specgen serve --ray ADDRESS`: the app as a Ray Serve deployment until Ctrl-C, and `--stop`,
which deletes one left on the cluster. Ray and the server's modules load only here, late."""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Callable

import typer

from specgen.cli.options import handle_signals, sigterm_as_ctrl_c
from specgen.config import ModelSettings
from specgen.errors import ConfigError
from specgen.status import status


def serve_on_ray(
    settings: ModelSettings,
    options,
    address: str,
    replicas: int,
    threads: int,
    browse: Callable[[str], None] | None = None,
) -> None:
    """The app as a Ray Serve deployment until Ctrl-C; then the deployment is deleted. `browse`
    opens its playground once it answers."""
    if replicas < 1 or threads < 1:
        raise ConfigError(f"--replicas and --ray-threads must be >= 1, got {replicas} and {threads}")
    if not options.api_key:
        raise ConfigError(
            "serve --ray needs an --api-key (its replicas share it)",
            hint="give --api-key KEY or set SPECGEN_API_KEY",
        )
    options.check()
    # Ray and the server's modules (torch) load only for a --ray server
    from specgen.scale.cluster import actor_plan, connect
    from specgen.serve import replicas as ray_serve

    ray, owned = connect(address)
    try:
        ray_serve.check_free()  # before anything of ours exists there: the `finally` below deletes ours
        _, reserve = actor_plan(ray, settings.device, replicas, threads, ("--replicas", "--ray-threads"))
    except BaseException:
        if owned:
            ray.shutdown()
        raise
    # Ray's core takes SIGTERM for itself when it connects: `kill`, a container's stop or a
    # scheduler's must delete the deployment as Ctrl-C does, or it serves on with nobody to stop it
    sigterm_as_ctrl_c(hangup=True)
    try:
        with status(f"starting {replicas} Ray Serve replicas (each loads the pair) ...", False):
            try:
                url = ray_serve.deploy(settings, options, replicas, threads, reserve)
            except ConfigError:
                raise
            except Exception as exc:  # Ray Serve's deployment failures carry a replica's traceback
                lines = [line for line in str(exc).splitlines() if line.strip()]
                raise ConfigError(
                    f"the Ray Serve deployment failed: {(lines or [type(exc).__name__])[-1][:300]}"
                ) from None
        typer.echo(
            f"specgen: {replicas} Ray Serve replicas ready at {url}; OpenAI API at {url}/v1; "
            f"Ctrl-C stops them; playground {url}/",
            err=True,
        )
        if browse is not None:
            browse(url)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            typer.echo("specgen server stopped (Ctrl-C or SIGTERM); deleting its deployment", err=True)
    finally:
        with signals_held():  # a second Ctrl-C must not cut the clean-up short
            try:
                ray_serve.undeploy()
            except Exception:  # nothing deployed (a failed start), or the cluster went away
                pass
            if owned:
                ray.shutdown()


@contextlib.contextmanager
def signals_held():
    """A second Ctrl-C (or SIGTERM, SIGHUP) during the clean-up, often pressed out of habit, is
    noted and the clean-up goes on; a third leaves at once, saying how to finish the clean-up
    (a cluster that does not answer could hold it for minutes). Then the handlers are as they were."""
    held = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    seen = []

    def patient(signum, frame) -> None:
        seen.append(signum)
        if len(seen) == 1:
            typer.echo("specgen: deleting the deployment; once more to leave without waiting", err=True)
            return
        typer.echo(
            "specgen: left before the deployment was deleted; `specgen serve --ray ADDRESS --stop` "
            "deletes it",
            err=True,
        )
        raise KeyboardInterrupt

    before = handle_signals(held, patient)
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def stop_on_ray(address: str) -> None:
    """`serve --ray ADDRESS --stop`: delete a specgen deployment left on the cluster."""
    from specgen.scale.cluster import connect  # Ray: the optional extra, only for --ray
    from specgen.serve import replicas as ray_serve

    ray, owned = connect(address)
    try:
        ray_serve.check_installed()
        if not ray_serve.stop():
            raise ConfigError("no specgen deployment runs on this Ray cluster")
        typer.echo("specgen: the deployment on this Ray cluster is deleted", err=True)
    finally:
        if owned:
            ray.shutdown()
