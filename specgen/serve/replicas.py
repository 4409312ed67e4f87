"""`specgen serve --ray auto|ADDRESS --replicas N`: the same HTTP app as a Ray Serve deployment of
N replicas behind one endpoint (Ray Serve's proxy on --host/--port), so an OpenAI client scales
out unchanged. Each replica loads the pair once, warms it up and batches its own requests with
its own scheduler, exactly as a single `specgen serve` does; Ray Serve spreads requests over
the replicas. Ray (the optional extra `specgen[ray]`, which brings Ray Serve) is imported
here only, late; the command (cli/serve.py) has joined the cluster before.

Every request needs the --api-key (the replicas share it; there is no local token and no
record for `specgen run` to find: a Ray deployment is for OpenAI clients).
"""

from __future__ import annotations

import http.client
import logging
import sys
from urllib.parse import urlsplit

import torch

from specgen.config import ModelSettings
from specgen.errors import ConfigError
from specgen.serve.app import create_app
from specgen.serve.server import ServeOptions, serving_state

APP_NAME = "specgen"
SERVE_HINT = "pip install 'specgen[ray]'"


class Replica:
    """One replica: the pair, its scheduler (started) and the FastAPI app over them."""

    def __init__(self, settings: ModelSettings, options: ServeOptions, threads: int, url: str):
        torch.set_num_threads(threads)
        self.state = serving_state(settings, options, True, sys.stderr, None, url, [options.api_key])
        self.state.scheduler.start()

    def __serve_build_asgi_app__(self):  # Ray Serve asks each replica for its app once it is built
        return create_app(self.state)


def check_installed() -> None:
    try:
        from ray import serve  # noqa: F401 - the optional extra, only a --ray server needs it
    except ImportError:
        raise ConfigError("serve --ray needs Ray Serve, which is not installed", hint=SERVE_HINT) from None


def check_free() -> None:
    """Refuse a second `serve --ray` on one cluster: its deployment would replace the first's
    (one app name, one HTTP address per cluster), and either's Ctrl-C would end both."""
    check_installed()
    from ray import serve  # the optional extra, checked just above

    if APP_NAME in serve.status().applications:
        raise ConfigError(
            "a specgen deployment already runs on this Ray cluster",
            hint="stop it (Ctrl-C where it was started, or `specgen serve --ray ADDRESS --stop`), "
            "or use another cluster",
        )


def stop() -> bool:
    """Delete a specgen deployment on this cluster (one whose `serve --ray` was killed past its
    clean-up); whether there was one."""
    from ray import serve  # the optional extra: check_free has imported it

    if APP_NAME not in serve.status().applications:
        return False
    undeploy()
    return True


def deploy(settings: ModelSettings, options: ServeOptions, replicas: int, threads: int, reserve: dict) -> str:
    """Start Ray Serve's proxy on options.host:port and N replicas, each reserving `reserve` (Ray
    actor options: the caller has checked that the cluster holds them all); returns the URL once
    every replica has loaded. The caller has joined the cluster."""
    if not options.api_key:
        raise ConfigError(
            "serve --ray needs an --api-key (its replicas share it)",
            hint="give --api-key KEY or set SPECGEN_API_KEY",
        )
    check_installed()
    from ray import serve  # the optional extra, checked just above

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its INFO lines are not the user's business
    url = f"http://{options.host}:{options.port}"
    serve.start(http_options={"host": options.host, "port": options.port})
    deployment = serve.deployment(
        serve.ingress()(Replica),
        name=APP_NAME,
        num_replicas=replicas,
        ray_actor_options=reserve,
        max_ongoing_requests=options.max_batch_size + options.max_queue,
    )
    try:
        serve.run(
            deployment.bind(settings, options, threads, url), name=APP_NAME, route_prefix="/", blocking=False
        )
    except RuntimeError as exc:  # "Failed to update the deployments": the reason is in the status
        raise ConfigError(f"a Ray Serve replica could not start: {_replica_error(serve) or exc}") from None
    _check_answers(url)
    return url


def _check_answers(url: str) -> None:
    """Ray Serve keeps the HTTP address it started with on a cluster and ignores another (with
    only a warning): say so rather than print a URL that nothing serves."""
    parts = urlsplit(url)
    try:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        conn.request("GET", "/health")
        ok = conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        ok = False
    if not ok:
        undeploy()
        raise ConfigError(
            f"nothing answers at {url}: Ray Serve on this cluster listens on the address it "
            "was first started with",
            hint="give that --host/--port, or restart the cluster",
        )


def _replica_error(serve) -> str | None:
    """The error a replica's constructor raised, from Ray Serve's status (its last traceback line)."""
    try:
        message = serve.status().applications[APP_NAME].deployments[APP_NAME].message
    except Exception:  # no status to read: the caller says what Ray said
        return None
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("specgen.errors.")]
    last = (ours or lines or [""])[-1]
    return last.split(": ", 1)[1] if ours and ": " in last else (last[:300] or None)


def undeploy() -> None:
    """Delete the deployment (its replicas end); Ray Serve's proxy goes with the session."""
    from ray import serve  # the optional extra, imported by deploy before

    serve.delete(APP_NAME)
