"""`specgen serve`: a run on a server shows and returns exactly what a run in its own process
does; stops, errors and departures on either side leave the server serving."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specgen.runtime.pair import load
from specgen.serve import client, protocol
from specgen.serve import server as server_mod
from specgen.cli import app
from specgen.config import GenerationConfig, Method, ModelSettings
from specgen.errors import ConfigError

runner = CliRunner()


def invoke(*args, input=None):
    return runner.invoke(app, list(args), input=input)


def options(tiny_dirs) -> list[str]:
    return ["--target", str(tiny_dirs["target"]), "--draft", str(tiny_dirs["draft"]),
            "--dtype", "float32", "--device", "cpu"]


def settings_for(tiny_dirs) -> ModelSettings:
    """What `specgen run` builds from options(): the CLI defaults for the rest."""
    return ModelSettings(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), "cpu", None, "float32", "auto",
                         "auto", "auto")


@pytest.fixture
def served(tiny_dirs):
    """A server for the tiny pair, answering on a thread of this process."""
    settings = settings_for(tiny_dirs)
    pair = load(settings, Method.CHAIN, quiet=True)
    server = server_mod.Server(settings, pair)
    server.bind()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.stopping = True
    thread.join(timeout=30)
    server.close()


def last_json(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("extra", [
    ["--method", "chain", "-k", "3"],
    ["--method", "plain"],
    ["--method", "rsd-c", "--temperature", "0.9", "--seed", "7"],
    ["--method", "chain", "-k", "2", "--temperature", "0.8", "--top-k", "20", "--seed", "11"],
    ["--method", "chain", "-k", "3", "--deterministic", "--verify-window", "4"],
])
def test_a_served_run_returns_what_a_local_run_returns(served, tiny_dirs, extra):
    args = ("run", "Write a haiku about caches", *options(tiny_dirs), "-n", "16", "--format", "json", *extra)
    local = last_json(invoke(*args, "--no-server"))
    before = served.served
    remote = last_json(invoke(*args))
    assert served.served == before + 1  # it really ran on the server
    assert remote["token_ids"] == local["token_ids"]
    assert remote["text"] == local["text"]
    for key in ("new_tokens", "rounds", "drafted", "accepted", "prompt_tokens", "accepted_length_histogram",
                "stop_reason", "dtype"):
        assert remote["stats"][key] == local["stats"][key], key


def test_plain_and_rich_output_come_through(served, tiny_dirs):
    for fmt in ("plain", "rich"):
        args = ("run", "hello", *options(tiny_dirs), "-n", "8", "--format", fmt)
        local, remote = invoke(*args, "--no-server"), invoke(*args)
        assert remote.exit_code == 0, remote.output
        assert "generating on the specgen server" in remote.stderr
        if fmt == "plain":
            assert remote.stdout == local.stdout
            assert "tokens/target forward" in remote.stderr
        else:
            assert "summary" in remote.output and "tokens/target forward" in remote.output


def test_the_server_logs_a_line_per_request(served, tiny_dirs):
    import io

    served.log = io.StringIO()
    last_json(invoke("run", "hello", *options(tiny_dirs), "-n", "5", "-k", "2", "--format", "json"))
    invoke("run", "x" * 400, *options(tiny_dirs), "--raw")
    lines = served.log.getvalue().splitlines()
    assert len(lines) == 2
    assert "[chain] 5 tokens in" in lines[0] and "prompt" in lines[0] and "tok/s" in lines[0]
    assert "error:" in lines[1] and "400 tokens" in lines[1]


def test_other_model_options_are_not_served(served, tiny_dirs):
    before = served.served
    result = invoke("run", "hello", *options(tiny_dirs), "--target-quant", "none", "-n", "4", "--format", "json")
    assert result.exit_code == 0, result.output
    assert served.served == before


def test_errors_come_back_as_one_line_and_the_server_goes_on(served, tiny_dirs):
    result = invoke("run", "x" * 400, *options(tiny_dirs), "--raw")
    assert result.exit_code == 1
    lines = [line for line in result.output.strip().splitlines() if not line.startswith("specgen: ")]
    assert len(lines) == 1 and lines[0].startswith("error:") and "400 tokens" in lines[0], result.output
    assert "Traceback" not in result.output
    again = last_json(invoke("run", "hello", *options(tiny_dirs), "-n", "4", "--format", "json"))
    assert again["stats"]["new_tokens"] == 4


class Recorder:
    """A renderer that records calls; `interrupt_at`: raise KeyboardInterrupt in that round."""

    def __init__(self, interrupt_at: int | None = None):
        self.calls, self.rounds, self.interrupt_at = [], 0, interrupt_at

    def __enter__(self):
        self.calls.append("enter")
        return self

    def __exit__(self, *exc):
        self.calls.append("exit")

    def on_round(self, view, stats):
        self.rounds += 1
        self.calls.append("round")
        if self.rounds == self.interrupt_at:
            raise KeyboardInterrupt

    def on_replay(self, view, stats):
        self.calls.append("replay")

    def finish(self, outcome):
        self.calls.append("finish")


def request(text="Write a haiku about caches", **config) -> dict:
    config = GenerationConfig(**{"method": Method.CHAIN, "draft_tokens": 2, "max_new_tokens": 40, **config})
    return {"text": text, "raw": False, "system": None, "config": config}


def test_ctrl_c_in_the_client_stops_the_generation_and_keeps_its_text(served, tiny_dirs, monkeypatch):
    import time

    relay_round = server_mod.Relay.on_round

    def slow_round(self, view, stats):  # rounds of a real model's pace: the stop arrives mid-generation
        time.sleep(0.02)
        relay_round(self, view, stats)

    monkeypatch.setattr(server_mod.Relay, "on_round", slow_round)
    settings = settings_for(tiny_dirs)
    recorder = Recorder(interrupt_at=1)
    outcome = client.generate_on_server(settings, request(max_new_tokens=120), recorder, quiet=True)
    assert outcome.interrupted
    assert 0 < len(outcome.token_ids) < 120
    assert outcome.stats.new_tokens == len(outcome.token_ids)
    assert recorder.calls[0] == "enter" and recorder.calls[-2:] == ["exit", "finish"]
    whole = client.generate_on_server(settings, request(max_new_tokens=120), Recorder(), quiet=True)
    assert not whole.interrupted and len(whole.token_ids) == 120
    assert whole.token_ids[:len(outcome.token_ids)] == outcome.token_ids


def test_a_client_that_goes_away_mid_generation_leaves_the_server_serving(served, tiny_dirs):
    settings = settings_for(tiny_dirs)
    sock = client.connect(settings)
    protocol.send(sock, ("generate", request()))
    kinds = []
    while "round" not in kinds:
        kinds.append(protocol.recv(sock)[0])
    sock.close()
    outcome = client.generate_on_server(settings, request(max_new_tokens=6), Recorder(), quiet=True)
    assert len(outcome.token_ids) == 6


def test_no_server_a_stale_socket_or_an_open_directory_means_loading_here(tiny_dirs, tmp_path):
    settings = settings_for(tiny_dirs)
    assert client.generate_on_server(settings, request(), Recorder(), quiet=True) is None
    path = protocol.socket_path(settings)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nothing listens
    try:
        assert client.connect(settings) is None
        result = invoke("run", "hello", *options(tiny_dirs), "-n", "4", "--format", "json")
        assert last_json(result)["stats"]["new_tokens"] == 4
    finally:
        path.unlink(missing_ok=True)


def test_a_directory_others_can_open_is_refused(tiny_dirs, tmp_path, monkeypatch):
    open_dir = tmp_path / "rt"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    monkeypatch.setenv("SPECGEN_RUNTIME_DIR", str(open_dir))
    settings = settings_for(tiny_dirs)
    pair = load(settings, Method.PLAIN, quiet=True)
    with pytest.raises(ConfigError, match="only you can open"):
        server_mod.Server(settings, pair).bind()
    assert client.connect(settings) is None


def test_a_second_server_for_the_same_models_is_refused_and_stop_stops_the_first(served, tiny_dirs):
    result = invoke("serve", *options(tiny_dirs))
    assert result.exit_code == 1
    assert "already running" in result.output and "Traceback" not in result.output
    stopped = invoke("serve", *options(tiny_dirs), "--stop")
    assert stopped.exit_code == 0, stopped.output
    assert f"pid {os.getpid()}" in stopped.output
    assert served.stopping
    assert invoke("serve", *options(tiny_dirs), "--stop").exit_code == 1  # nothing left to stop


def test_bad_serve_options_are_one_line(tiny_dirs):
    result = invoke("serve", *options(tiny_dirs), "--idle-minutes", "-1")
    assert result.exit_code == 1 and "--idle-minutes must be >= 0" in result.output


def test_idle_server_stops_by_itself(tiny_dirs):
    settings = settings_for(tiny_dirs)
    server = server_mod.Server(settings, load(settings, Method.PLAIN, quiet=True))
    path = server.bind()
    try:
        assert "no request" in server.serve_forever(idle_seconds=0.5)
    finally:
        server.close()
    assert not path.exists()


def test_detached_server_end_to_end(tiny_dirs):
    """The real thing: `serve --detach` in the background, a `specgen run` process that imports no
    torch, its output equal to a local run's, and `serve --stop`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cli = [sys.executable, "-m", "specgen"]
    started = subprocess.run([*cli, "serve", *options(tiny_dirs), "--detach"], capture_output=True, text=True,
                             env=env, timeout=300)
    assert started.returncode == 0, started.stderr
    assert "specgen server ready" in started.stderr
    try:
        probe = ("import sys, json; from specgen.cli import app\n"
                 "try:\n    app(sys.argv[1:], standalone_mode=False)\n"
                 "finally:\n    print(json.dumps({'torch': 'torch' in sys.modules}), file=sys.stderr)\n")
        args = ["run", "Write a haiku about caches", *options(tiny_dirs), "-n", "12", "--format", "json"]
        remote = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, env=env,
                                timeout=120)
        assert remote.returncode == 0, remote.stderr
        assert json.loads(remote.stderr.strip().splitlines()[-1]) == {"torch": False}
        local = subprocess.run([*cli, *args, "--no-server"], capture_output=True, text=True, env=env, timeout=300)
        assert json.loads(remote.stdout)["token_ids"] == json.loads(local.stdout)["token_ids"]
    finally:
        stopped = subprocess.run([*cli, "serve", *options(tiny_dirs), "--stop"], capture_output=True, text=True,
                                 env=env, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert not protocol.socket_path(settings_for(tiny_dirs)).exists() or _gone(settings_for(tiny_dirs))


def _gone(settings) -> bool:
    import time

    for _ in range(100):  # the server removes its socket as it exits
        if not protocol.socket_path(settings).exists():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_a_server_on_cuda_serves_what_a_local_cuda_run_prints(tiny_dirs):
    """compile auto (inductor and CUDA graphs on CUDA): the server warms up, keeps its engines,
    and two served runs of each method print the local run's text."""
    from specgen.cli.options import generation_config

    settings = ModelSettings(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), "cuda", None, "auto", "auto",
                             "auto", "auto")
    server = server_mod.Server(settings, load(settings, Method.CHAIN, quiet=True))
    server.bind()
    server.warm_up(generation_config("chain", 4, "device", 0.0, 0, 1.0, None))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        cuda = ["--target", str(tiny_dirs["target"]), "--draft", str(tiny_dirs["draft"]), "--device", "cuda"]
        for method in ("plain", "chain", "lookup-chain"):
            args = ("run", "def add(a, b):", *cuda, "--method", method, "-n", "24", "-k", "3", "--format", "plain")
            local = invoke(*args, "--no-server")
            assert local.exit_code == 0, local.output
            for _ in range(2):
                before = server.served
                remote = invoke(*args)
                assert remote.exit_code == 0, remote.output
                assert server.served == before + 1
                assert remote.stdout == local.stdout and local.stdout.strip()
    finally:
        server.stopping = True
        thread.join(timeout=60)
        server.close()


def test_a_detached_server_that_cannot_load_says_why(tmp_path):
    result = subprocess.run([sys.executable, "-m", "specgen", "serve", "--target", str(tmp_path / "nope"),
                             "--detach"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "did not start" in lines[0] and "does not exist" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_foreground_server_stops_on_a_signal_and_removes_its_socket(tiny_dirs, sig):
    import signal
    import time

    settings = settings_for(tiny_dirs)
    process = subprocess.Popen([sys.executable, "-m", "specgen", "serve", *options(tiny_dirs)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            if client.ping(settings, timeout=1.0) is not None or process.poll() is not None:
                break
            time.sleep(0.1)
        assert client.ping(settings) is not None, process.stderr.read() if process.poll() is not None else ""
        process.send_signal(getattr(signal, sig))
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    assert "server ready" in err and "specgen server stopped" in err
    assert "Traceback" not in err
    assert not protocol.socket_path(settings).exists()


def test_list_shows_the_running_servers(served, tiny_dirs):
    result = invoke("serve", "--list")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and f"pid {os.getpid()}" in lines[0] and "target target + draft draft" in lines[0]
    assert str(protocol.socket_path(settings_for(tiny_dirs))) in lines[0]
    assert invoke("serve", "--list", "--stop").exit_code == 1


def test_list_without_servers_says_so():
    result = invoke("serve", "--list")
    assert result.exit_code == 0 and "no specgen server is running" in result.output
