"""`specgen run --prompts-file F --output OUT --ray`: a local Ray instance (2 CPUs), tiny models,
2 actors of 1 thread: the same outputs as a run in one process; an actor killed mid-run still
gives every prompt exactly once; a bad address is one line. Skipped where Ray is not installed
(it is not in the dev extra) and left out of the default run: `pip install 'specgen[ray]'`, then
`python -m pytest -m ray` (about 70 s here, most of it starting Ray, its actors and Ray Serve).
`serve --ray --replicas 2`: the app in two Ray Serve replicas answers as a local run does."""

from __future__ import annotations

import json
import socket
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

ray = pytest.importorskip("ray")

from test_output import models  # noqa: E402,F401 (the same tiny pair and settings: a fixture)

from specgen.cli import app  # noqa: E402
from specgen.scale import cluster  # noqa: E402

pytestmark = pytest.mark.ray
runner = CliRunner()
PROMPTS = "".join(f'{{"prompt": "prompt number {i}, {"x" * (i % 4)}", "id": "p{i}"}}\n' for i in range(10))


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One Ray instance for the module (starting one takes seconds)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(PROMPTS)
    return path


@pytest.fixture(scope="module")
def local(models, tmp_path_factory):
    """Each prompt's token ids from a run in this process (no Ray)."""
    root = tmp_path_factory.mktemp("local")
    (root / "prompts.jsonl").write_text(PROMPTS)
    result = runner.invoke(
        app,
        [
            "run",
            "--prompts-file",
            str(root / "prompts.jsonl"),
            "--output",
            str(root / "out.jsonl"),
            "--batch-size",
            "2",
            *models,
        ],
    )
    assert result.exit_code == 0, result.output
    return ids_of(root / "out.jsonl")


def ids_of(path) -> dict[str, list[int]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {r["id"]: r["token_ids"] for r in records}
    assert len(by_id) == len(records), "a prompt written twice"
    return by_id


def test_two_actors_give_what_one_process_gives(models, prompts, tmp_path, local):
    out = tmp_path / "out.jsonl"
    result = runner.invoke(
        app,
        [
            "run",
            "--prompts-file",
            str(prompts),
            "--output",
            str(out),
            "--ray",
            "auto",
            "--ray-actors",
            "2",
            "--ray-threads",
            "1",
            "--batch-size",
            "2",
            *models,
        ],
    )
    assert result.exit_code == 0, result.output
    assert ids_of(out) == local
    assert "10 prompts written" in result.stderr


def test_an_actor_killed_mid_run_loses_no_prompt_and_repeats_none(
    models, prompts, tmp_path, local, monkeypatch
):
    real_iter, runs = cluster.RayRun.__iter__, []

    def iterate(self):
        runs.append(self)
        for count, item in enumerate(real_iter(self)):
            yield item
            if count == 0:  # that actor was just given its next batches of the queue: kill it now
                ray.kill(self.last_actor, no_restart=True)

    monkeypatch.setattr(cluster.RayRun, "__iter__", iterate)
    out = tmp_path / "out.jsonl"
    result = runner.invoke(
        app,
        [
            "run",
            "--prompts-file",
            str(prompts),
            "--output",
            str(out),
            "--ray",
            "auto",
            "--ray-actors",
            "2",
            "--ray-threads",
            "1",
            *models,
        ],
    )
    assert result.exit_code == 0, result.output
    assert runs[0].retried >= 1  # the killed actor's batches went to the other one
    assert "a Ray actor died; its" in result.stderr  # and the user is told
    assert ids_of(out) == local


def test_a_rerun_on_ray_writes_only_the_missing_prompts(models, prompts, tmp_path, local):
    """An interrupted run left the first prompts in OUT.jsonl (here: a local run of them); the
    same command on Ray then writes the others and nothing twice."""
    first = tmp_path / "first.jsonl"
    first.write_text("".join(prompts.read_text().splitlines(keepends=True)[:4]))
    out = tmp_path / "out.jsonl"
    assert (
        runner.invoke(app, ["run", "--prompts-file", str(first), "--output", str(out), *models]).exit_code
        == 0
    )
    result = runner.invoke(
        app,
        [
            "run",
            "--prompts-file",
            str(prompts),
            "--output",
            str(out),
            "--ray",
            "auto",
            "--ray-actors",
            "2",
            "--ray-threads",
            "1",
            *models,
        ],
    )
    assert result.exit_code == 0, result.output
    assert "6 prompts written" in result.stderr
    assert ids_of(out) == local


def test_an_address_that_does_not_answer_is_one_line(models, prompts, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = runner.invoke(
        app,
        [
            "run",
            "--prompts-file",
            str(prompts),
            "--output",
            str(tmp_path / "o.jsonl"),
            "--ray",
            f"127.0.0.1:{port}",
            *models,
        ],
    )
    assert result.exit_code == 1
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and f"cannot connect to the Ray cluster at 127.0.0.1:{port}" in lines[0], (
        result.output
    )
    assert not (tmp_path / "o.jsonl").exists()  # checked before OUT is touched


def test_auto_with_a_ray_address_that_is_gone_and_an_empty_address_are_one_line(
    models, prompts, tmp_path, monkeypatch
):
    """`--ray auto` follows $RAY_ADDRESS: one that does not answer was minutes of Ray's retries."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    out = tmp_path / "o.jsonl"
    result = runner.invoke(
        app, ["run", "--prompts-file", str(prompts), "--output", str(out), "--ray", "auto", *models]
    )
    assert (
        result.exit_code == 1 and "($RAY_ADDRESS)" in result.output and "unset RAY_ADDRESS" in result.output
    )
    assert not out.exists()
    monkeypatch.delenv("RAY_ADDRESS")
    result = runner.invoke(
        app, ["run", "--prompts-file", str(prompts), "--output", str(out), "--ray", " ", *models]
    )
    assert result.exit_code == 1 and "--ray needs a cluster's ADDRESS" in result.output


@pytest.mark.slow  # over 10 s: the default run stays under 15 minutes
def test_serve_replicas_answer_behind_one_endpoint(models, tiny_dirs):
    """`serve --ray --replicas 2`: the HTTP app in two Ray Serve replicas; greedy answers are the
    ones `specgen run` gives in its own process, and a request without the key gets 401."""
    import httpx
    from ray import serve

    from specgen.config import ModelSettings
    from specgen.serve import replicas
    from specgen.serve.server import ServeOptions

    local = runner.invoke(app, ["run", "hello there", "--raw", *models, "--format", "json", "--no-server"])
    assert local.exit_code == 0, local.output
    expected = json.loads(local.stdout.strip().splitlines()[-1])["text"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = ModelSettings(
        str(tiny_dirs["target"]), str(tiny_dirs["draft"]), "cpu", None, "float32", "auto", "auto", "auto"
    )
    url = replicas.deploy(settings, ServeOptions(port=port, api_key="key"), 2, 1, {"num_cpus": 1})
    try:
        states = serve.status().applications[replicas.APP_NAME].deployments[replicas.APP_NAME].replica_states
        assert states.get("RUNNING") == 2, states
        headers = {"Authorization": "Bearer key"}
        model = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        for _ in range(4):
            answer = httpx.post(
                f"{url}/v1/completions",
                headers=headers,
                timeout=60,
                json={"model": model, "prompt": "hello there", "max_tokens": 6, "temperature": 0},
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == expected
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
        # a second `serve --ray` on this cluster would replace this one: refused before it deploys
        from specgen.errors import ConfigError

        with pytest.raises(ConfigError, match="already runs on this Ray cluster") as info:
            replicas.check_free()
        assert "specgen serve --ray ADDRESS --stop" in info.value.hint
        # one whose `serve --ray` was killed past its clean-up (SIGKILL): --stop deletes it
        stopped = runner.invoke(app, ["serve", "--ray", "auto", "--stop"])
        assert stopped.exit_code == 0 and "deployment on this Ray cluster is deleted" in stopped.output, (
            stopped.output
        )
        assert replicas.APP_NAME not in serve.status().applications
        again = runner.invoke(app, ["serve", "--ray", "auto", "--stop"])
        assert again.exit_code == 1 and "no specgen deployment runs" in again.output, again.output
    finally:
        if replicas.APP_NAME in serve.status().applications:
            replicas.undeploy()
        serve.shutdown()


def test_serve_ray_deletes_its_deployment_on_sigterm(tiny_dirs, monkeypatch):
    """Ray's core takes SIGTERM for itself when it connects: `kill`, a container's stop or a
    scheduler's left the deployment serving with nobody to stop it. SIGTERM (and SIGHUP) now end
    `serve --ray` as Ctrl-C does, and its clean-up deletes the deployment."""
    import signal

    from specgen.cli.options import _interrupt
    from specgen.serve import replicas

    deleted, before = [], {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}

    def deploy(*args):
        assert (
            signal.getsignal(signal.SIGTERM) is _interrupt and signal.getsignal(signal.SIGHUP) is _interrupt
        )
        raise KeyboardInterrupt  # what the handler raises when SIGTERM comes

    monkeypatch.setattr(replicas, "deploy", deploy)
    monkeypatch.setattr(replicas, "undeploy", lambda: deleted.append(1))
    try:
        result = runner.invoke(
            app, ["serve", "--ray", "auto", "--api-key", "k", "--target", str(tiny_dirs["target"])]
        )
        assert result.exit_code == 130 and deleted == [1], result.output
        assert signal.getsignal(signal.SIGINT) == before[signal.SIGINT]  # held only during the clean-up
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_more_actors_or_replicas_than_the_cluster_holds_is_one_line(models, prompts, tmp_path, tiny_dirs):
    """Ray waits forever for actors it cannot place: asking for more than the cluster holds (2
    CPUs here) is one line, before anything loads or OUT is touched."""
    from specgen.errors import ConfigError

    def plan(resources, device=None, actors=None, threads=1, names=("--ray-actors", "--ray-threads")):
        return cluster.actor_plan(
            SimpleNamespace(cluster_resources=lambda: resources), device, actors, threads, names
        )

    assert plan({"CPU": 2}) == (2, {"num_cpus": 1}) and plan({"CPU": 4}, threads=2) == (2, {"num_cpus": 2})
    assert plan({"CPU": 8, "GPU": 2}) == (2, {"num_gpus": 1, "num_cpus": 1})
    for resources, kwargs, fragment in (
        (
            {"CPU": 2},
            {"actors": 4},
            "--ray-actors 4 of --ray-threads 1 need 4 CPUs, and the Ray cluster has 2",
        ),
        ({"CPU": 2}, {"threads": 3}, "--ray-threads 3: each reserves 3 CPUs, and the Ray cluster has 2"),
        (
            {"CPU": 8, "GPU": 1},
            {"actors": 2, "names": ("--replicas", "--ray-threads")},
            "--replicas 2: each needs a GPU, and the Ray cluster has 1",
        ),
    ):
        with pytest.raises(ConfigError, match=fragment):
            plan(resources, **kwargs)
    out = tmp_path / "o.jsonl"
    result = runner.invoke(
        app,
        [
            "run",
            "--prompts-file",
            str(prompts),
            "--output",
            str(out),
            "--ray",
            "auto",
            "--ray-actors",
            "4",
            *models,
        ],
    )
    assert result.exit_code == 1 and "need 4 CPUs" in result.output and not out.exists(), result.output
    result = runner.invoke(
        app,
        ["serve", "--ray", "auto", "--api-key", "k", "--replicas", "3", "--target", str(tiny_dirs["target"])],
    )
    assert result.exit_code == 1 and "--replicas 3 of --ray-threads 1 need 3 CPUs" in result.output, (
        result.output
    )


def test_a_prompt_too_long_for_the_context_stops_a_ray_run_before_any_is_decoded(models, tmp_path):
    """A batch's error named no prompt ("the prompt has ..."), part way through the set: every
    prompt is checked first, as a local run does, and named by its place in the file."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(PROMPTS + json.dumps({"prompt": "word " * 400, "id": "long"}) + "\n")
    out = tmp_path / "o.jsonl"
    result = runner.invoke(
        app, ["run", "--prompts-file", str(path), "--output", str(out), "--ray", "auto", *models]
    )
    assert result.exit_code == 1 and "prompt 11 has" in result.output and "context holds" in result.output, (
        result.output
    )
    assert not out.exists() or out.read_text() == ""


def test_a_listener_that_is_not_a_ray_head_is_one_line_within_seconds():
    """Ray waited minutes, silently, on a web server or a listener that never answers."""
    import threading
    import time
    from http.server import HTTPServer, SimpleHTTPRequestHandler

    from specgen.errors import ConfigError

    web = HTTPServer(("127.0.0.1", 0), SimpleHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        for port in (web.server_address[1], silent.getsockname()[1]):
            started = time.monotonic()
            with pytest.raises(ConfigError, match="something listens there, but not a Ray head"):
                cluster.check(f"127.0.0.1:{port}")
            assert time.monotonic() - started < 2 * cluster.CONNECT_SECONDS
        with pytest.raises(ConfigError, match="99999 is not a port"):
            cluster.check("127.0.0.1:99999")
    finally:
        web.shutdown()
        silent.close()


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--ray", "auto"], "needs an --api-key"),
        (["--replicas", "2"], "go with --ray"),
        (["--ray", "auto", "--api-key", "k", "--detach"], "serves in the foreground"),
    ],
)
def test_serve_ray_options_are_checked_first(args, fragment, monkeypatch):
    monkeypatch.delenv("SPECGEN_API_KEY", raising=False)
    result = runner.invoke(app, ["serve", *args, "--target", "/nonexistent"])
    assert result.exit_code == 1
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], result.output


class _FakeRay:
    """Just enough of Ray for RayRun's start, with no Ray running: actors whose `ready` answers
    None, a load error's text, or raises what Ray raises for an actor that died while starting."""

    def __init__(self, fates):
        self.fates = iter(fates)  # per actor: None (ready), a load error's text, or "died"

    def cluster_resources(self):
        return {"CPU": 3}

    def remote(self, cls):
        def start(*_):
            fate = next(self.fates)
            return SimpleNamespace(
                ready=SimpleNamespace(remote=lambda: fate), check=SimpleNamespace(remote=lambda items: None)
            )

        handle = SimpleNamespace(remote=start)
        handle.options = lambda **_: handle
        return handle

    def get(self, fate):
        if fate == "died":
            raise ray.exceptions.RayActorError(
                error_msg="The actor died because of an error raised in its creation task, "
                "ray::Worker.__init__()\n"
                '  File "x.py", line 1, in __init__\nMemoryError: the node ran out of memory'
            )
        return fate


def test_an_actor_that_dies_while_starting_is_left_out_and_the_run_goes_on(models, capsys):
    """An actor that dies in its creation (not a load error of the pair, which every actor would
    share) is left out with one notice; none left is one line that says why, never an
    'unexpected ActorDiedError'; a load error still stops the run with its own line."""
    from specgen.config import GenerationConfig, ModelSettings
    from specgen.errors import SpecgenError

    def start(*fates):
        run = cluster.RayRun(
            _FakeRay(fates),
            ModelSettings("t", "d"),
            GenerationConfig(),
            False,
            None,
            [(0, "hi")],
            1,
            actors=len(fates),
        )
        return run, run.wait_ready()

    run, count = start(None, "died", None)
    assert count == 2 and len(run.actors) == 2
    assert "1 of 3 Ray actors could not start (MemoryError: the node ran out of memory); going on with 2" in (
        capsys.readouterr().err
    )
    with pytest.raises(
        SpecgenError, match=r"^no Ray actor could start: MemoryError: the node ran out of memory$"
    ):
        start("died", "died")
    with pytest.raises(SpecgenError, match="a Ray actor could not load the pair: no such model"):
        start(None, "no such model")
