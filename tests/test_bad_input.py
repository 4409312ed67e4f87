"""Local files nested too deeply for Python's JSON parser (a recursion per level) are bad JSON
like any other: one line, or a cache measured again, or a torn results line dropped; never a
RecursionError."""

from __future__ import annotations

import pytest

from specgen.errors import PromptError, SpecgenError

DEEP = "[" * 100_000 + "]" * 100_000


def test_a_deep_cache_file_counts_as_empty(tmp_path):
    from specgen.decoding import costs
    from specgen.models import placement

    path = tmp_path / "draft-length.json"
    path.write_text(DEEP)
    assert costs._read(path) == {}
    path = tmp_path / "cpu-format.json"
    path.write_text(DEEP)
    assert placement._read_format(path, "key") is None


def test_a_deep_prompts_file_line_chat_save_and_bench_file_are_one_line(tmp_path):
    from specgen.bench.prompts import read_prompt_file
    from specgen.chat.saves import SaveFileError, read_save
    from specgen.decoding.prompts import read_prompts_file

    lines = tmp_path / "prompts.jsonl"
    lines.write_text('{"prompt": "fine"}\n{"prompt": ' + DEEP + "}\n")
    with pytest.raises(PromptError, match="prompts.jsonl:2"):
        read_prompts_file(lines)
    bench = tmp_path / "bench.jsonl"
    bench.write_text('{"id": "a", "category": "c", "prompt": "fine"}\n' + DEEP + "\n")
    with pytest.raises(PromptError, match="bench.jsonl:2: not valid JSON .nested too deeply"):
        read_prompt_file(bench)
    save = tmp_path / "chat.json"
    save.write_text(DEEP)
    with pytest.raises(SaveFileError, match="nested too deeply"):
        read_save(save)


def test_a_deep_torn_last_results_line_is_dropped(tmp_path):
    from specgen.scale.results import ResultsFile

    path = tmp_path / "out.jsonl"
    path.write_text('{"id": "a", "text": "x"}\n' + DEEP + "\n")
    with ResultsFile.open(path) as results:
        assert set(results.done) == {"a"} and results.dropped > 0
    with pytest.raises(SpecgenError):  # in the middle of the file: not ours to delete
        path.write_text(DEEP + "\n" + '{"id": "a", "text": "x"}\n')
        ResultsFile.open(path)


def test_run_file_dev_zero_is_one_line(tiny_dirs):
    from typer.testing import CliRunner

    from specgen.cli import app

    result = CliRunner().invoke(
        app,
        [
            "run",
            "--file",
            "/dev/zero",
            "--target",
            str(tiny_dirs["target"]),
            "--method",
            "plain",
            "--device",
            "cpu",
            "--no-server",
        ],
    )
    assert result.exit_code == 1 and "more than 32 MiB" in result.output and "Traceback" not in result.output


def test_a_request_may_decode_past_eos_or_stop_at_its_own_ids(tiny_pair):
    """Request.ignore_eos decodes past the engine's stop ids; Request.stop_ids end a row early."""
    from specgen.config import GenerationConfig, Method
    from specgen.decoding.engine import Engine
    from specgen.decoding.events import Finished
    from specgen.decoding.feed import Request

    target = tiny_pair[0]
    prompt = [257, 84, 82, 68, 81, 198]
    config = GenerationConfig(method=Method.PLAIN, max_new_tokens=20)

    class Feed:
        def __init__(self, request):
            self.requests = [request]

        def take(self, room):
            out, self.requests = self.requests[:room], self.requests[room:]
            return out

        def dropped(self):
            return set()

    def run(engine_stops, **request):
        engine = Engine(target.model, target.device, frozenset(engine_stops), target.context_length)
        feed = Feed(Request(prompt, 0, config, **request))
        return next(r.state.ids[len(prompt) :] for r in engine.drive(feed) if isinstance(r.event, Finished))

    free = run(())
    assert len(free) == 20
    at = next(i for i in range(1, 20) if free[i] not in free[:i])
    assert run({free[at]}) == free[: at + 1]
    assert run({free[at]}, ignore_eos=True) == free
    assert run((), stop_ids=frozenset({free[at]})) == free[: at + 1]


def test_sigterm_ends_a_prompt_set_as_ctrl_c_does(tiny_dirs, tmp_path):
    """`kill` (SIGTERM) on `specgen run --prompts-file --output`: the summary line, exit 130, every
    finished result kept; a rerun finishes the rest."""
    import json
    import signal
    import subprocess
    import sys
    import time

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt number {i}\n" for i in range(40)))
    out = tmp_path / "out.jsonl"
    command = [
        sys.executable,
        "-m",
        "specgen",
        "run",
        "--prompts-file",
        str(prompts),
        "--output",
        str(out),
        "--target",
        str(tiny_dirs["target"]),
        "--method",
        "plain",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "-n",
        "200",
        "--batch-size",
        "1",
    ]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out.is_file() and out.read_text().count("\n") >= 2):
        assert child.poll() is None and time.monotonic() < deadline, (
            child.stderr.read() if child.poll() else "slow"
        )
        time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 130, err
    assert "interrupted:" in err and "Traceback" not in err
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert 2 <= len(kept) < 40


def served_in_a_process(tiny_dirs, *extra: str):
    """`specgen serve` on the tiny pair in a process of its own, answering: (the process, its
    port). `extra`: options that also give it model options of its own (its own lock)."""
    import http.client
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specgen",
            "serve",
            "--target",
            str(tiny_dirs["target"]),
            "--draft",
            str(tiny_dirs["draft"]),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--port",
            str(port),
            "--api-key",
            "key",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            conn.getresponse().read()
            return server, port
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)


def test_a_sigterm_lets_a_running_request_finish(tiny_dirs):
    """`serve --stop` (SIGTERM) drains: the running stream ends with its finish reason, not the
    server_shutdown error (it was cut at once, though the docs promised it time), and the
    server exits 0."""
    import http.client
    import json
    import signal

    server, port = served_in_a_process(tiny_dirs, "--compile", "off")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {
            "model": "target",
            "prompt": "hello",
            "max_tokens": 40,
            "stream": True,
            "ignore_eos": True,
            "speculative": {"method": "plain"},
        }
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(body),
            headers={"Authorization": "Bearer key", "Content-Type": "application/json"},
        )
        response = conn.getresponse()
        data = response.read(64)  # it runs
        server.send_signal(signal.SIGTERM)
        while chunk := response.read(64):
            data += chunk
        _, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert data.endswith(b"data: [DONE]\n\n") and b'"finish_reason": "length"' in data, data[-300:]
    assert b"server_shutdown" not in data
    assert server.returncode == 0 and "Traceback" not in err, err


def test_two_ctrl_cs_to_a_server_with_open_streams_end_them_with_an_error_event(tiny_dirs):
    """SIGINT twice while 6 streams run or wait (one row at a time): every stream ends with [DONE],
    each one that had not finished with the server_shutdown error before it (the queued ones at
    least), the server exits 0, and no traceback reaches its log."""
    import http.client
    import json
    import signal
    import threading
    import time

    server, port = served_in_a_process(tiny_dirs, "--max-batch-size", "1", "--draft-quant", "none")
    streams: dict[int, bytes] = {}

    def stream(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {
            "model": "target",
            "prompt": "hello",
            "max_tokens": 240,
            "stream": True,
            "ignore_eos": True,
            "speculative": {"method": "plain"},
        }
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(body),
            headers={"Authorization": "Bearer key", "Content-Type": "application/json"},
        )
        response, data = conn.getresponse(), b""
        try:
            while chunk := response.read(64):
                data += chunk
        except http.client.IncompleteRead as exc:
            data += exc.partial + b"<cut>"
        streams[i] = data

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    server.send_signal(signal.SIGINT)
    time.sleep(0.2)
    server.send_signal(signal.SIGINT)
    _, err = server.communicate(timeout=60)
    for thread in threads:
        thread.join(timeout=30)
    assert server.returncode == 0 and "Traceback" not in err and "CancelledError" not in err, err
    assert len(streams) == 6
    for data in streams.values():
        assert data.endswith(b"data: [DONE]\n\n"), data[-300:]
        assert b"server_shutdown" in data or b'"finish_reason": "length"' in data, data[-300:]
    assert sum(b"server_shutdown" in data for data in streams.values()) >= 3
