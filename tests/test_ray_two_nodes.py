"""`specgen run --prompts-file F --output OUT --ray ADDRESS` on a Ray cluster of two nodes, both on this
machine: a head (`ray start --head`) and a second node (`ray start --address HEAD`, its own temp dir and
a `node2` resource), one CPU each, so the run's two actors of one thread are one per node. The run is
`specgen`'s own command in a process of its own (as a user's; a Ray driver's settings last as long as
its process). Once both actors have returned a batch, every process of the second node is killed at
once (SIGKILL to its process session: a machine that is lost), while its actor decodes, or once it
has finished its batches and their results wait in its node for the driver to fetch them. Either way
its batches go to the head's actor, every prompt is in OUT exactly once, and each is what a run in one
process (no Ray) gives, token for token and text for text. Skipped where Ray is not installed, where
there is no /proc (Linux's), or where a node cannot start (about 25 s: the nodes, drivers and actors)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

ray = pytest.importorskip("ray")

from specgen.cli import app  # noqa: E402
from specgen.scale import cluster  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # two nodes, a kill: 24 s (-m slow)
runner = CliRunner()
PROMPTS = "".join(
    json.dumps({"prompt": f"prompt number {i}, " + "x" * (i % 5), "id": f"p{i}"}) + "\n" for i in range(24)
)
START_SECONDS = 90  # a node's `ray start` on a busy machine of two cores
RUN_SECONDS = 120  # a run that loses a node: seconds here; longer is a hang
GONE = (ProcessLookupError, PermissionError, subprocess.TimeoutExpired)
RAY_ENV = {
    # the nodes and the driver alike: no token. (A head started where ~/.ray/auth_token exists, as
    # any local `ray.init()` writes it, wants it, and a node joining it does not send it, Ray 2.60.)
    "RAY_AUTH_MODE": "disabled",
    # the head finds a lost node within about 2 s (Ray's default: 5 health checks 3 s apart)
    "RAY_health_check_initial_delay_ms": "0",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "3",
    # every batch's result waits in its actor's node's object store until the driver fetches it,
    # as a large one does (over 100 KB: a large --batch-size or -n)
    "RAY_max_direct_call_object_size": "100",
}
# the driver: `specgen run ...` (specgen.cli.main, as the `specgen` command) with a hook in the run
# that kills node 2 at the moment the test chooses (`drive`)
DRIVER = (
    "import json, sys; spec = json.loads(sys.argv[1]); sys.path.insert(0, spec['tests']); "
    "import test_ray_two_nodes; test_ray_two_nodes.drive(spec)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(root: Path, name: str, *args: str) -> subprocess.Popen:
    """`ray start --block` in its own process session, whose id is its pid: every process of the node
    (raylet, agents, workers, and the head's GCS) is in it, so it is killed whole, and only it."""
    temp = root / name  # short: Ray's Unix sockets are under it, and a socket's path holds about 107 bytes
    with open(root / f"{name}.log", "wb") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ray.scripts.scripts",
                "start",
                "--block",
                "--temp-dir",
                str(temp),
                "--num-cpus",
                "1",
                "--object-store-memory",
                str(100 * 2**20),
                "--disable-usage-stats",
                "--dashboard-agent-listen-port",
                str(free_port()),
                "--min-worker-port",
                "0",
                "--max-worker-port",
                "0",
                *args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **RAY_ENV},
        )


def wait_started(root: Path, name: str, node: subprocess.Popen) -> None:
    """Until the node's `ray start` says it started (a node says so once the head has registered it),
    or a skip with the end of its log where it cannot."""
    log, deadline = root / f"{name}.log", time.monotonic() + START_SECONDS
    while "Ray runtime started" not in log.read_text(errors="replace"):
        if node.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            pytest.skip(f"a Ray node ({name}) could not start here: " + " | ".join(tail))
        time.sleep(0.2)


def session_pids(session: int) -> list[int]:
    """A node's processes: those of its `ray start`'s session (none starts a session of its own)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):  # ended meanwhile
                if os.getsid(int(entry)) == session:
                    pids.append(int(entry))
    return pids


def titles(session: int) -> list[str]:
    """A node's processes' command lines: Ray titles an actor's process `ray::Worker`, and
    `ray::Worker.decode` while it decodes a batch."""
    lines = []
    for pid in session_pids(session):
        with contextlib.suppress(OSError):
            line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            lines.append(line.decode(errors="replace").strip())
    return lines


def kill_session(session: int) -> None:
    """SIGKILL to every process of a node at once, as a lost machine: none shuts down cleanly."""
    with contextlib.suppress(*GONE):
        os.killpg(session, signal.SIGKILL)
    for pid in session_pids(session):  # one that moved to another process group
        with contextlib.suppress(*GONE):
            os.kill(pid, signal.SIGKILL)


def kill_node(node: subprocess.Popen) -> None:
    kill_session(node.pid)
    with contextlib.suppress(*GONE):
        node.wait(timeout=10)


def wait_idle(session: int) -> None:
    """Until the node's actor has decoded every batch it was given (the driver gives no more while
    it waits here): titled `ray::Worker` at five looks in a row, 0.1 s apart."""
    deadline, idle = time.monotonic() + 30, 0
    while idle < 5:
        assert time.monotonic() < deadline, f"node 2's actor is still busy: {titles(session)}"
        idle = idle + 1 if "ray::Worker" in titles(session) else 0
        time.sleep(0.1)


def drive(spec: dict) -> None:
    """The driver's process: `specgen run ...`, whose run kills node 2 once both actors have
    returned a batch (after its actor is idle, when `done`), and writes to `report` whether each
    node held an actor then."""
    from specgen.cli import main

    real_iter = cluster.RayRun.__iter__

    def iterate(self):
        returned = set()
        for item in real_iter(self):
            if len(returned) < 2:
                returned.add(id(self.last_actor))
                if len(returned) == 2:  # both actors, one per node, have decoded a batch: node 2 is lost now
                    placed = [
                        "ray::Worker" in " ".join(titles(node)) for node in (spec["head"], spec["second"])
                    ]
                    if spec["when"] == "done":
                        wait_idle(spec["second"])
                    kill_session(spec["second"])
                    Path(spec["report"]).write_text(json.dumps(placed))
            yield item

    cluster.RayRun.__iter__ = iterate
    sys.argv = ["specgen", *spec["args"]]
    main()


@pytest.fixture(scope="module")
def head(request):
    """The head, with one CPU; all its processes, and every second node's, are killed at the end,
    whatever happened (also when one could not start)."""
    if not Path("/proc/self").is_dir():
        pytest.skip("a node's processes are found in /proc, which this system does not have")
    root = Path(tempfile.mkdtemp(prefix="sgr-"))
    nodes: list[subprocess.Popen] = []

    def clean_up():
        for node in nodes:
            kill_node(node)
        shutil.rmtree(root, ignore_errors=True)

    request.addfinalizer(clean_up)
    port = free_port()
    nodes.append(
        start_node(
            root,
            "head",
            "--head",
            "--port",
            str(port),
            "--include-dashboard",
            "false",
            "--dashboard-port",
            str(free_port()),
            "--ray-client-server-port",
            str(free_port()),
        )
    )
    wait_started(root, "head", nodes[0])
    return SimpleNamespace(root=root, address=f"127.0.0.1:{port}", node=nodes[0], nodes=nodes)


@pytest.fixture
def second(head):
    """A second node of one CPU and its own temp dir, joined to the head: one for each test, as
    each test kills it."""
    name = f"node{len(head.nodes) + 1}"
    head.nodes.append(start_node(head.root, name, "--address", head.address, "--resources", '{"node2": 1}'))
    wait_started(head.root, name, head.nodes[-1])
    return head.nodes[-1]


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return [
        "--target",
        str(tiny_dirs["target"]),
        "--draft",
        str(tiny_dirs["draft"]),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "-n",
        "32",
        "--batch-size",
        "2",
    ]


@pytest.fixture(scope="module")
def local(models, tmp_path_factory):
    """The prompts file, and each prompt's record from a run in this process (no Ray)."""
    root = tmp_path_factory.mktemp("two-nodes")
    (root / "prompts.jsonl").write_text(PROMPTS)
    result = runner.invoke(
        app,
        [
            "run",
            "--prompts-file",
            str(root / "prompts.jsonl"),
            "--output",
            str(root / "local.jsonl"),
            *models,
        ],
    )
    assert result.exit_code == 0, result.output
    return root / "prompts.jsonl", records_of(root / "local.jsonl")


def records_of(path) -> dict[str, dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {r["id"]: r for r in records}
    assert len(by_id) == len(records), "a prompt written twice"
    return by_id


@pytest.mark.parametrize("when", ["decoding", "done"])
def test_a_node_killed_mid_run_loses_no_prompt_and_repeats_none(head, second, local, models, when, tmp_path):
    """`decoding`: node 2 is killed as soon as both actors have returned a batch, while its actor
    has batches to decode (in Ray: RayActorError). `done`: once its actor has finished the batches
    it holds, whose results wait in node 2 for the driver (in Ray: ObjectLostError, which stopped the
    run with an "unexpected" error before)."""
    prompts, expected = local
    out, report = tmp_path / "out.jsonl", tmp_path / "report.json"
    spec = {
        "tests": str(Path(__file__).parent),
        "head": head.node.pid,
        "second": second.pid,
        "when": when,
        "report": str(report),
        "args": [
            "run",
            "--prompts-file",
            str(prompts),
            "--output",
            str(out),
            "--ray",
            head.address,
            "--ray-actors",
            "2",
            "--ray-threads",
            "1",
            *models,
        ],
    }
    try:
        result = subprocess.run(
            [sys.executable, "-c", DRIVER, json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=RUN_SECONDS,
            env={**os.environ, **RAY_ENV},
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the run hung once node 2 was lost: {exc.stderr}")
    assert result.returncode == 0, result.stderr
    assert json.loads(report.read_text()) == [True, True], "the two actors are not one per node"
    assert second.wait(timeout=10) is not None  # node 2 is gone
    assert "a Ray actor died; its 2 prompts go to the 1 others" in result.stderr  # a batch of node 2, redone
    assert "24 prompts written" in result.stderr  # (stdout has Ray's own line on the node it found dead)
    got = records_of(out)
    assert sorted(got) == sorted(expected)  # every prompt, each once
    for ident, record in expected.items():
        assert (got[ident]["token_ids"], got[ident]["text"]) == (record["token_ids"], record["text"]), ident
