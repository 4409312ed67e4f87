"""`specgen serve` under load and misbehaving clients: continuous batching of concurrent
requests (each exactly what it would be alone when greedy), a full queue (503), clients that
leave, stop reading, or give up while queued, memory over many requests, and the command's own
errors (unsafe runtime directory, a non-loopback host without a key, bad options)."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import pickle
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_server import (
    PROMPT,
    invoke,
    last_json,
    local_run,
    model,
    options,
    pair,
    raw,
    served,
    settings_for,
    slow_rounds,
    start,
    stop,
)

from specgen.config import Method
from specgen.runtime.pair import load

openai = pytest.importorskip("openai")

PROMPTS = [
    "Write a haiku about caches",
    "def add(a, b):",
    "Explain KV caches",
    "hello",
    "Why is the sky blue?",
    "List three prime numbers",
    "x",
    "Summarize: the cat sat on the mat.",
]


def stream_request(served, body: dict):
    """An open streaming response over a raw connection: (connection, response)."""
    host, port = served.state.info["url"].removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps({**body, "stream": True}).encode(),
        headers={"Authorization": f"Bearer {served.token}", "Content-Type": "application/json"},
    )
    return conn, conn.getresponse()


def chat_body(served, prompt=PROMPT, **extra) -> dict:
    return {"model": model(served), "messages": [{"role": "user", "content": prompt}], **extra}


def test_32_concurrent_streams_with_mixed_sampling_all_complete(served, tiny_dirs):
    """Rows join and leave a running batch (8 wide); every greedy answer is what `specgen run`
    gives for that prompt alone, every sampled one has its length."""
    sdk = openai.OpenAI(
        base_url=served.state.info["url"] + "/v1", api_key=served.token, max_retries=0, timeout=120
    )
    jobs = [(PROMPTS[i % len(PROMPTS)], 0.0 if i % 2 == 0 else 0.9, 8 + i % 5, i) for i in range(32)]

    def one(job):
        prompt, temperature, n, seed = job
        # a sampled row may draw EOS (which rows share its rounds changes its draws): ignore_eos holds it to n
        chunks = sdk.chat.completions.create(
            model=model(served),
            messages=[{"role": "user", "content": prompt}],
            max_tokens=n,
            temperature=temperature,
            seed=seed,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True} if temperature else None,
        )
        chunks = list(chunks)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(one, jobs))
    expected = {}
    for (prompt, temperature, n, _), (text, usage) in zip(jobs, answers):
        assert usage.completion_tokens == n
        if temperature == 0.0:
            key = (prompt, n)
            if key not in expected:
                expected[key] = local_run(tiny_dirs, prompt, "-n", str(n))["text"]
            assert text == expected[key], prompt
    # the draft length the default method's rows finished with per batch width: at most the width
    # caps, lowered where their measured rounds chose less (0: plain rounds)
    status, text, _ = raw(served, "GET", "/metrics")
    prefix = 'specgen_draft_length{method="lookup-chain",width="'
    lengths = {
        int(line[len(prefix) :].split('"')[0]): float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }
    caps = served.scheduler.caps
    assert status == 200 and lengths
    assert all(0 <= k <= caps.at(w) for w, k in lengths.items()), lengths
    # the fewest draft-model rows that draft together at each width, as measured at the start
    prefix = 'specgen_drafting_together{width="'
    together = {
        int(line[len(prefix) :].split('"')[0]): int(float(line.split()[-1]))
        for line in text.splitlines()
        if line.startswith(prefix)
    }
    assert together == caps.least and together[1] == 1, together


def test_a_full_queue_answers_503_with_retry_after(tiny_dirs, pair, monkeypatch):
    slow_rounds(monkeypatch, 0.05)
    running, thread = start(settings_for(tiny_dirs), pair, max_batch_size=1, max_queue=1)
    try:
        first = stream_request(running, chat_body(running, max_tokens=40))  # runs
        deadline = time.monotonic() + 10
        while not running.scheduler.running:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        second = stream_request(running, chat_body(running, max_tokens=4))  # waits
        while not running.scheduler.waiting:
            time.sleep(0.01)
        status, body, headers = raw(running, "POST", "/v1/chat/completions", chat_body(running, max_tokens=4))
        assert status == 503 and body["error"]["code"] == "queue_full" and headers["retry-after"] == "1"
        # more choices than the queue ever holds: a 400, not a 503 that a retry cannot cure
        status, body, _ = raw(running, "POST", "/v1/chat/completions", chat_body(running, max_tokens=4, n=2))
        assert status == 400 and body["error"]["param"] == "n" and "--max-queue" in body["error"]["message"]
        for conn, response in (first, second):
            assert b"[DONE]" in response.read()
            conn.close()
    finally:
        stop(running, thread)


def test_a_server_without_a_draft_model_serves_plain_and_lookup(tiny_dirs):
    """`bench --concurrency --methods plain,lookup` loads no draft: the server's default drafting is
    prompt lookup, and a method that needs the draft model gets a 400, not an engine failure."""
    settings = settings_for(tiny_dirs)
    running, thread = start(
        settings, load(settings, Method.LOOKUP, quiet=True), max_batch_size=4, max_queue=8
    )
    try:
        assert running.state.defaults.method is Method.LOOKUP
        for method in ("plain", "lookup", None):
            extra = {"speculative": {"method": method}} if method else {}
            status, body, _ = raw(
                running,
                "POST",
                "/v1/chat/completions",
                chat_body(running, max_tokens=6, temperature=0, **extra),
            )
            assert status == 200 and body["speculative"]["method"] == (method or "lookup"), body
        status, body, _ = raw(
            running,
            "POST",
            "/v1/chat/completions",
            chat_body(running, max_tokens=6, speculative={"method": "rsd-s"}),
        )
        assert status == 400 and "needs a draft model" in body["error"]["message"]
        assert body["error"]["param"] == "speculative.method"
    finally:
        stop(running, thread)


def leave_mid_stream(served, body: dict) -> None:
    """Start a stream of `body`, leave once it has begun, and wait until the server is idle."""
    conn, response = stream_request(served, body)
    assert response.readline().startswith(b"data:")  # the stream has begun
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 10
    while served.scheduler.busy():
        assert time.monotonic() < deadline, "the rows of a client that left are still decoding"
        time.sleep(0.02)


def test_a_client_leaving_mid_stream_frees_its_row(served, monkeypatch):
    slow_rounds(monkeypatch, 0.02)
    leave_mid_stream(served, chat_body(served, max_tokens=200, temperature=0))
    status, text, _ = raw(served, "GET", "/metrics")
    assert 'specgen_requests_total{endpoint="chat",status="cancelled"}' in text


def test_a_client_that_stops_reading_holds_nobody_up(served, monkeypatch):
    """One stream is left unread while others come and go: they finish at the usual pace."""
    conn, response = stream_request(served, chat_body(served, max_tokens=200, temperature=0))
    started = time.monotonic()
    sdk = openai.OpenAI(
        base_url=served.state.info["url"] + "/v1", api_key=served.token, max_retries=0, timeout=30
    )
    for _ in range(3):
        answer = sdk.chat.completions.create(**chat_body(served, max_tokens=6, temperature=0))
        assert answer.usage.completion_tokens == 6
    assert time.monotonic() - started < 30
    conn.close()


def test_a_prompt_that_takes_long_to_tokenize_stalls_no_stream(served, monkeypatch):
    """Tokenizing a 4 MB prompt takes seconds (2.7 s with the default pair's tokenizer): it runs
    off the event loop, so a stream already going keeps going meanwhile. The tokenizer is held
    here until the stream has ended; on the event loop it would have stopped every stream."""
    from specgen.serve import encoding

    entered, release = threading.Event(), threading.Event()
    real = encoding.encode

    def slow(tokenizer, prompt, *rest):
        if prompt.kind == "completion" and prompt.text == "tokenize me slowly":
            entered.set()
            assert release.wait(60)
        return real(tokenizer, prompt, *rest)

    monkeypatch.setattr(encoding, "encode", slow)
    conn, response = stream_request(served, chat_body(served, max_tokens=24, temperature=0))
    assert response.readline().startswith(b"data: ")  # the stream is going
    sdk = openai.OpenAI(
        base_url=served.state.info["url"] + "/v1", api_key=served.token, max_retries=0, timeout=60
    )
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(
            sdk.completions.create,
            model=model(served),
            prompt="tokenize me slowly",
            max_tokens=3,
            temperature=0,
        )
        assert entered.wait(30)
        rest = response.read().decode()  # the whole stream while the other prompt is being tokenized
        assert rest.rstrip().endswith("data: [DONE]") and not release.is_set()
        release.set()
        assert held.result(timeout=60).usage.completion_tokens == 3
    conn.close()


def test_a_queued_request_whose_client_leaves_is_dropped_at_once(tiny_dirs, pair, monkeypatch):
    slow_rounds(monkeypatch, 0.05)
    running, thread = start(settings_for(tiny_dirs), pair, max_batch_size=1, max_queue=4)
    try:
        first = stream_request(running, chat_body(running, max_tokens=60))
        while not running.scheduler.running:
            time.sleep(0.01)
        conn, response = stream_request(running, chat_body(running, max_tokens=4))
        while not running.scheduler.waiting:
            time.sleep(0.01)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        deadline = time.monotonic() + 2  # far less than the 60 paced rounds ahead of it
        while running.scheduler.waiting:
            assert time.monotonic() < deadline, "the queued request waited for the one ahead"
            time.sleep(0.01)
        assert running.scheduler.running  # the first one still runs
        # and it counts, as a running row that loses its client does (it was left out of /metrics)
        metrics = running.state.metrics.text().decode()
        assert 'specgen_requests_total{endpoint="chat",status="cancelled"} 1.0' in metrics
        first[1].read()
        first[0].close()
    finally:
        stop(running, thread)


def test_many_sequential_requests_leave_memory_flat(served):
    sdk = openai.OpenAI(
        base_url=served.state.info["url"] + "/v1", api_key=served.token, max_retries=0, timeout=30
    )

    def rss() -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * resource.getpagesize()

    def batch(n):
        for i in range(n):
            sdk.chat.completions.create(
                **chat_body(served, PROMPTS[i % len(PROMPTS)], max_tokens=2, temperature=0.5, seed=i)
            )

    def stored() -> int:  # the prefix cache grows up to its budget by design
        pair = served.state.scheduler.pair
        return pair.target_prefixes.held + pair.draft_prefixes.held

    batch(100)  # warm-up: allocator pools, the first shapes
    before, held = rss(), stored()
    batch(900)
    after, grown = rss(), stored() - held
    pair = served.state.scheduler.pair
    assert max(pair.target_prefixes.held, pair.draft_prefixes.held) <= pair.target_prefixes.budget
    assert after - max(grown, 0) < before * 1.10, (
        f"RSS grew from {before >> 20} MB to {after >> 20} MB over 900 requests ({grown >> 20} MB of it the "
        f"prefix cache)"
    )


def test_many_drafting_settings_share_one_engine_and_idle_drafters_are_bounded(served, monkeypatch):
    """Every request may choose its drafting (draft_confidence is any number): all share the one
    engine, each setting its own drafter; past MAX_IDLE the least recently used idle drafters
    (and their draft caches) are given up, and answers stay right."""
    from specgen.decoding.drafters import mixed

    monkeypatch.setattr(mixed, "MAX_IDLE", 2)
    answers = set()
    engine = served.scheduler.engine
    for i in range(6):
        status, body, _ = raw(
            served,
            "POST",
            "/v1/chat/completions",
            chat_body(served, max_tokens=6, temperature=0, speculative={"draft_confidence": 0.1 + i / 100}),
        )
        assert status == 200, body
        answers.add(body["choices"][0]["message"]["content"])
        assert served.scheduler.engine is engine and len(engine.drafter.drafters) <= 3
    assert len(answers) == 1  # greedy: the drafting never changes the answer


def test_a_prompt_far_past_the_context_is_refused_before_it_is_all_tokenized(served):
    """Counted a piece at a time, stopping once past the context: a 4 MB prompt costs about
    what one that fits costs, and holds up the tokenizing thread no longer."""
    from specgen.serve.encoding import beyond

    tokenizer = served.scheduler.pair.target.tokenizer
    seen = []

    class Counting:
        def encode(self, text, **kwargs):
            seen.append(len(text))
            return tokenizer.encode(text, **kwargs)

    context = served.state.context_length
    words = "lorem ipsum dolor sit amet " * 150_000  # 4 MB
    assert beyond(Counting(), [words], context) > context
    assert sum(seen) < 100_000
    for fits in (["hello " * (context // 8)], ["a" * (context // 2), "b" * (context // 2)]):
        assert beyond(Counting(), fits, context) == 0
    # the whole text is counted in pieces when it is long but fits: no false refusal
    long_fit = ["\u4e2d" * (context - 10)]  # 3 bytes, 3 byte-level tokens, per character
    assert beyond(Counting(), long_fit, 10 * context) == 0
    status, body, _ = raw(
        served, "POST", "/v1/completions", {"model": model(served), "prompt": words, "max_tokens": 2}
    )
    assert (
        status == 400
        and body["error"]["code"] == "context_length_exceeded"
        and "more than" in body["error"]["message"]
    )
    # empty messages have no text to count, but each takes a token of the template at least
    many = [{"role": "user", "content": ""}] * 100_000
    for path in ("/v1/chat/completions", "/tokenize"):
        status, body, _ = raw(
            served,
            "POST",
            path,
            {"model": model(served), "messages": many, "max_tokens": 2}
            if path != "/tokenize"
            else {"messages": many},
        )
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        assert "100000 messages" in body["error"]["message"]


def test_a_client_that_hangs_up_mid_body_leaves_no_traceback(served):
    import logging

    records = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logging.getLogger("uvicorn.error").addHandler(handler)
    try:
        host, port = served.state.info["url"].removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                + served.token.encode()
                + b"\r\nContent-Length: 100\r\n\r\n{"
            )
            time.sleep(0.3)
        time.sleep(0.5)
        assert raw(served, "GET", "/health")[0] == 200
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert not records, [r.getMessage() for r in records]


def test_a_top_p_too_small_for_fp32_answers_and_fails_no_other_row(served):
    """It once gave every row of the batch a 500 (0/0 in the nucleus): now the nucleus is the
    top token, so the answer is the greedy one."""
    greedy = raw(served, "POST", "/v1/chat/completions", chat_body(served, max_tokens=6, temperature=0))[1]
    status, body, _ = raw(
        served,
        "POST",
        "/v1/chat/completions",
        chat_body(served, max_tokens=6, temperature=1.0, top_p=1e-40, seed=3),
    )
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]


def test_a_failed_batch_answers_500_counts_it_and_the_server_goes_on(served, monkeypatch):
    from specgen.serve import scheduler

    def broken(*args, **kwargs):
        raise RuntimeError("a kernel failed\nwith a second line")
        yield

    with monkeypatch.context() as patch:
        patch.setattr(scheduler, "fold", broken)
        status, body, _ = raw(served, "POST", "/v1/chat/completions", chat_body(served, max_tokens=4, n=2))
    assert status == 500 and body["error"]["code"] == "engine_error"
    assert body["error"]["message"] == "the engine failed: RuntimeError: a kernel failed"
    text = raw(served, "GET", "/metrics")[1]
    assert 'specgen_requests_total{endpoint="chat",status="500"} 1.0' in text
    assert raw(served, "POST", "/v1/chat/completions", chat_body(served, max_tokens=4))[0] == 200


# -- the command ---------------------------------------------------------------------------------------


def one_line_error(result, fragment: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0], result.output


def test_a_public_host_needs_an_api_key_and_bad_options_fail_at_once(tiny_dirs):
    one_line_error(invoke("serve", *options(tiny_dirs), "--host", "0.0.0.0"), "--api-key")
    one_line_error(invoke("serve", *options(tiny_dirs), "--idle-minutes", "nan"), "--idle-minutes")
    one_line_error(invoke("serve", *options(tiny_dirs), "--port", "70000"), "--port")
    one_line_error(invoke("serve", *options(tiny_dirs), "--max-batch-size", "0"), "--max-batch-size")
    one_line_error(invoke("serve", *options(tiny_dirs), "--max-queue", "0"), "--max-queue")
    one_line_error(invoke("serve", *options(tiny_dirs), "--max-tokens", "0"), "--max-tokens")
    one_line_error(
        invoke("serve", *options(tiny_dirs), "--host", "192.0.2.1", "--api-key", "k"), "check --host"
    )
    for key in ("abc ", " ", "k\r", "clé"):  # HTTP strips a header's spaces: no client could send these
        one_line_error(invoke("serve", *options(tiny_dirs), "--api-key", key), "--api-key")
    one_line_error(invoke("serve", *options(tiny_dirs), "--prefix-cache", "-1"), "--prefix-cache")
    one_line_error(invoke("serve", *options(tiny_dirs), "--prefill-chunk", "-1"), "--prefill-chunk")
    one_line_error(invoke("serve", "--detach", "--stop"), "one of")


def test_an_unsafe_runtime_directory_is_named_not_ignored(tmp_path, monkeypatch, tiny_dirs):
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    monkeypatch.setenv("SPECGEN_RUNTIME_DIR", str(open_dir))
    one_line_error(invoke("serve", "--list"), "can be opened by other users")
    one_line_error(invoke("serve", *options(tiny_dirs), "--stop"), "can be opened by other users")
    one_line_error(invoke("serve", *options(tiny_dirs), "--detach"), "can be opened by other users")
    local = invoke("run", "hi", *options(tiny_dirs), "-n", "2")  # runs in its own process, and says why
    assert local.exit_code == 0 and "not looking for a server: " in local.stderr
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SPECGEN_RUNTIME_DIR", str(blocker))
    one_line_error(invoke("serve", "--list"), "is not a directory")
    assert "chmod" not in invoke("serve", "--list").output
    monkeypatch.setenv("SPECGEN_RUNTIME_DIR", str(blocker / "runtime"))
    one_line_error(invoke("serve", *options(tiny_dirs), "--detach"), "cannot create")


def test_a_failed_detach_appends_to_the_log_and_says_why(tmp_path, monkeypatch, tiny_dirs):
    from specgen.serve import discovery

    runtime = tmp_path / "rt"
    monkeypatch.setenv("SPECGEN_RUNTIME_DIR", str(runtime))
    args = [
        "--target",
        str(tmp_path / "no-such-model"),
        "--draft",
        str(tiny_dirs["draft"]),
        "--device",
        "cpu",
    ]
    settings = discovery.ModelSettings(
        str(tmp_path / "no-such-model"), str(tiny_dirs["draft"]), "cpu", None, "auto", "auto", "auto", "auto"
    )
    runtime.mkdir(mode=0o700)
    log = discovery.log_path(settings)
    log.write_text("an earlier server's log\n")
    result = invoke("serve", *args, "--detach", "--port", "0")
    one_line_error(result, "did not start")
    assert "does not exist" in result.output
    assert log.read_text().startswith("an earlier server's log\n")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_server_cleanly(tmp_path, tiny_dirs, sig):
    """SIGTERM (what `--stop` sends) and Ctrl-C end the server after a graceful shutdown: it
    removes its record, which holds its token, and says why it stopped. uvicorn raised the
    signal again, and SIGTERM's default action ended the process before either."""
    runtime = tmp_path / "rt"
    env = {**os.environ, "SPECGEN_RUNTIME_DIR": str(runtime)}
    process = subprocess.Popen(
        [sys.executable, "-m", "specgen", "serve", *options(tiny_dirs), "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not list(runtime.glob("*.json")):
            assert process.poll() is None and time.monotonic() < deadline, (
                process.stderr.read() if process.poll() else ""
            )
            time.sleep(0.1)
        process.send_signal(sig)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, err
    assert "specgen server stopped: stopped by a signal" in err and "Traceback" not in err
    assert not list(runtime.glob("*.json"))


def test_a_served_run_whose_server_dies_keeps_what_it_received(tiny_dirs, pair, monkeypatch):
    """The server stops mid-answer: the JSON client prints what came, marked interrupted, and
    one error line."""
    slow_rounds(monkeypatch, 0.03)
    running, thread = start(settings_for(tiny_dirs), pair)
    killer = threading.Timer(
        1.0, lambda: setattr(running, "force_exit", True) or setattr(running, "should_exit", True)
    )
    killer.start()
    result = invoke("run", PROMPT, *options(tiny_dirs), "-n", "200", "-k", "2", "--format", "json")
    thread.join(timeout=30)
    assert result.exit_code == 1, result.output
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["interrupted"] and 0 < len(record["token_ids"]) < 200
    assert record["stats"]["new_tokens"] == len(record["token_ids"])
    assert "closed the connection" in result.stderr


def fail_mid_answer(monkeypatch, events: int = 6) -> None:
    """The server's engine raises at its `events`-th event: after some rounds of an answer."""
    from specgen.serve import scheduler

    real, calls = scheduler.Scheduler._dispatch, []

    def failing(self, report, stats):
        calls.append(1)
        if len(calls) == events:
            raise RuntimeError("a kernel failed")
        return real(self, report, stats)

    monkeypatch.setattr(scheduler.Scheduler, "_dispatch", failing)


def test_a_served_run_whose_batch_fails_mid_answer_keeps_what_it_received(tiny_dirs, pair, monkeypatch):
    """The server's engine fails after some rounds: its error chunk ends the stream; the client
    prints what came (a JSON object, marked interrupted) and then the server's one line."""
    fail_mid_answer(monkeypatch)
    running, thread = start(settings_for(tiny_dirs), pair)
    try:
        result = invoke(
            "run", "A prompt of its own", *options(tiny_dirs), "-n", "40", "-k", "2", "--format", "json"
        )
    finally:
        stop(running, thread)
    assert result.exit_code == 1, result.output
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["interrupted"] and 0 < len(record["token_ids"]) < 40
    assert "the specgen server failed: the engine failed: RuntimeError: a kernel failed" in result.stderr


def test_a_client_proves_the_server_before_sending_its_token(served, tiny_dirs, tmp_path):
    """What answers at a record's URL must show it holds the record's token (an HMAC of a fresh
    challenge) before the client sends the token: after a crash, another user could listen there."""
    import http.server

    from specgen.cli import remote as client
    from specgen.serve import discovery

    sent = []

    class Squatter(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # answers like a server, with the dead server's pid, but cannot prove the token
            sent.append(self.headers.get("Authorization"))
            body = json.dumps({"status": "ok", "pid": os.getpid(), "proof": "0" * 64}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    squatter = http.server.HTTPServer(("127.0.0.1", 0), Squatter)
    thread = threading.Thread(target=squatter.serve_forever, daemon=True)
    thread.start()
    try:
        record = {
            "url": f"http://127.0.0.1:{squatter.server_port}",
            "token": "the-secret-token",
            "pid": os.getpid(),
            "models": "m",
            "since": 0.0,
            "model": "m",
        }
        assert (
            client._answering(record, timeout=5, key=discovery.settings_key(settings_for(tiny_dirs))) is None
        )
        assert sent == [None]  # the token was never sent
    finally:
        squatter.shutdown()
    # the real server proves it: a challenge's answer is the HMAC under its token, of its options' key
    real = {**record, "url": served.state.info["url"], "token": served.token}
    key = discovery.settings_key(settings_for(tiny_dirs))
    assert served.state.info["key"] == key and client._answering(real, timeout=5, key=key) is not None
    # its record copied under another options' name leads nowhere: the proof names the options
    other = discovery.settings_key(dataclasses.replace(settings_for(tiny_dirs), dtype="bfloat16"))
    assert client._answering(real, timeout=5, key=other) is None


def test_one_server_per_model_options(tiny_dirs, tmp_path, monkeypatch):
    """Two starts of the same options (together, or beside a hung one): the second is refused
    before it loads, instead of overwriting the first's record."""
    from specgen.errors import ConfigError
    from specgen.serve import discovery

    monkeypatch.setenv("SPECGEN_RUNTIME_DIR", str(tmp_path / "rt"))
    discovery.private_dir()
    settings = settings_for(tiny_dirs)
    held = discovery.hold(settings)
    try:
        with pytest.raises(
            ConfigError, match=rf"already running or starting \(pid {os.getpid()}\)"
        ) as refused:
            discovery.hold(settings)  # named by its pid: a server whose record is lost can still be found
        assert f"kill {os.getpid()}" in refused.value.hint
        other = discovery.hold(
            dataclasses.replace(settings, dtype="bfloat16")
        )  # other options: their own lock
        os.close(other)
        result = invoke("serve", *options(tiny_dirs), "--port", "0")
        one_line_error(result, "already running or starting")
    finally:
        os.close(held)
    again = discovery.hold(settings)  # released with its descriptor (and with its process)
    os.close(again)


def test_list_and_stop_find_a_server_that_does_not_answer_yet(tiny_dirs, tmp_path, monkeypatch):
    """A server holds its options' lock from before it loads: `--list` shows one still loading
    (or whose record is lost) by that lock, with its log, and `--stop` ends it, once its
    command line proves it is `specgen serve`; a lock's holder that is something else is named,
    never signalled."""
    from specgen.serve import discovery

    monkeypatch.setenv("SPECGEN_RUNTIME_DIR", str(tmp_path / "rt"))
    discovery.private_dir()
    settings = settings_for(tiny_dirs)
    # the settings as they are (a repr of their nested settings and enums is no Python to rebuild them)
    code = (
        "import pickle, time; from specgen.serve import discovery; "
        f"discovery.hold(pickle.loads(bytes.fromhex({pickle.dumps(settings).hex()!r}))); "
        "print('held', flush=True); time.sleep(120)"
    )
    loading = subprocess.Popen(
        [sys.executable, "-c", code, "specgen", "serve"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    try:
        assert loading.stdout.readline().strip() == "held"
        listed = invoke("serve", "--list")
        assert listed.exit_code == 0, listed.output
        key = discovery.settings_key(settings)
        assert f"pid {loading.pid}  not answering yet" in listed.stdout and f"{key}.log" in listed.stdout
        assert discovery.holder(discovery.lock_path(settings)) == loading.pid  # the probe left it held
        stopped = invoke("serve", *options(tiny_dirs), "--stop")
        assert stopped.exit_code == 0, stopped.output
        assert f"stopped the specgen server (pid {loading.pid}" in stopped.stderr
        assert loading.wait(timeout=10) == -signal.SIGTERM
    finally:
        loading.kill()
        loading.wait()
    assert "no specgen server is running" in invoke("serve", "--list").stderr
    held = discovery.hold(settings)  # this process is no `specgen serve`: named, not signalled
    try:
        one_line_error(
            invoke("serve", *options(tiny_dirs), "--stop"), f"starting or not answering (pid {os.getpid()})"
        )
    finally:
        os.close(held)
    one_line_error(
        invoke("serve", *options(tiny_dirs), "--stop"), "no specgen server with these model options"
    )


def test_a_quiet_stream_sends_keep_alives_and_a_silent_server_is_given_up(tiny_dirs, pair, monkeypatch):
    """While a request waits or prefills, its stream carries SSE comments; a served run whose
    server sends nothing at all for STREAM_TIMEOUT says so, keeping what came, instead of
    waiting for ever."""
    from specgen.cli import remote as client
    from specgen.serve import app as app_module

    slow_rounds(monkeypatch, 0.3)
    monkeypatch.setattr(app_module, "KEEPALIVE_SECONDS", 0.05)
    running, thread = start(settings_for(tiny_dirs), pair)
    try:
        conn, response = stream_request(running, chat_body(running, max_tokens=2))
        text = response.read().decode()
        conn.close()
        assert ": keep-alive" in text and text.rstrip().endswith("data: [DONE]")
        monkeypatch.setattr(app_module, "KEEPALIVE_SECONDS", 60.0)
        monkeypatch.setattr(client, "STREAM_TIMEOUT", 0.5)
        slow_rounds(monkeypatch, 2.0)  # a round longer than the client waits: a hung server, to it
        result = invoke("run", "Some prompt or other", *options(tiny_dirs), "-n", "8", "--format", "json")
    finally:
        stop(running, thread)
    assert result.exit_code == 1, result.output
    assert "the specgen server stopped answering" in result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["interrupted"]


@pytest.mark.parametrize(
    "bad",
    [
        {"since": 1e20},
        {"since": float("nan")},
        {"url": ""},
        {"url": "http://h:99999"},
        {"pid": -1},
        {"model": None},
        {"url": "ftp://h:1"},
    ],
)
def test_a_record_a_server_would_not_write_is_no_server(tmp_path, monkeypatch, bad):
    """It broke `serve --list` for every server and ended `run` in 'unexpected OverflowError'."""
    from specgen.serve import discovery

    monkeypatch.setenv("SPECGEN_RUNTIME_DIR", str(tmp_path / "rt"))
    directory = discovery.private_dir()
    good = {"url": "http://127.0.0.1:8000", "token": "t", "pid": 5, "models": "m", "model": "m", "since": 1.0}
    (directory / "a.json").write_text(json.dumps(good))
    assert discovery.read_record(directory / "a.json") is not None
    (directory / "a.json").write_text(json.dumps({**good, **bad}))
    assert discovery.read_record(directory / "a.json") is None
    listed = invoke("serve", "--list")
    assert listed.exit_code == 0 and "unexpected" not in listed.output


def test_a_chat_keeps_a_reply_its_server_broke_off(tiny_dirs, pair, monkeypatch, tmp_path):
    """As on Ctrl-C: what came is kept in the conversation, marked interrupted; the error is one
    line, and the session goes on."""
    fail_mid_answer(monkeypatch)
    save = tmp_path / "chat.json"
    running, thread = start(settings_for(tiny_dirs), pair)
    try:
        result = invoke(
            "chat",
            *options(tiny_dirs),
            "-n",
            "30",
            "-k",
            "2",
            "--format",
            "plain",
            input=f"first\nsecond\n/save {save}\n",
        )
    finally:
        stop(running, thread)
    assert result.exit_code == 1, result.output
    assert "the specgen server failed: the engine failed: RuntimeError" in result.stderr
    messages = json.loads(save.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[1].get("interrupted") and messages[1]["content"] and not messages[3].get("interrupted")


@pytest.mark.parametrize("fmt", ["json", "plain", "rich"])
def test_ctrl_c_before_a_served_answer_begins_prints_an_empty_interrupted_one(
    tiny_dirs, pair, monkeypatch, fmt
):
    from specgen.cli import remote as client

    def interrupted(self, method, path, body=None, timeout=10.0, key=True):
        if method == "POST":
            raise KeyboardInterrupt
        return real(self, method, path, body, timeout, key)

    real = client.Server.request
    running, thread = start(settings_for(tiny_dirs), pair)
    try:
        monkeypatch.setattr(client.Server, "request", interrupted)
        result = invoke("run", "hi", *options(tiny_dirs), "-n", "4", "--format", fmt)
    finally:
        monkeypatch.undo()
        stop(running, thread)
    assert result.exit_code == 130 and "Traceback" not in result.output
    if fmt == "json":
        record = json.loads(result.stdout.strip().splitlines()[-1])
        assert record["interrupted"] and record["token_ids"] == []


def test_a_chat_takes_up_its_server_started_again(tiny_dirs, pair):
    """The server stopped between two turns and was started again with the same model options:
    the chat goes on there (it failed every later turn)."""
    from specgen.cli import remote as client

    settings = settings_for(tiny_dirs)
    first, thread = start(settings, pair)
    chat = client.ServerChat(client.find(settings), settings)
    messages = [{"role": "user", "content": "hi"}]
    before = chat.count(messages)
    stop(first, thread)
    second, thread = start(settings, pair)
    try:
        assert chat.count(messages) == before
        assert chat.server.token == second.token  # each server has its own token
    finally:
        stop(second, thread)


def test_a_chat_on_the_server_fits_a_conversation_far_past_the_context(tiny_dirs, pair):
    """A loaded save may hold many times the context (a save keeps dropped turns): the server
    refuses to count such a conversation, and the chat drops turns to fit instead of failing."""
    from specgen.chat.conversation import Conversation
    from specgen.cli import remote as client
    from specgen.config import GenerationConfig
    from specgen.decoding.views import Silent

    settings = settings_for(tiny_dirs)
    running, thread = start(settings, pair)
    try:
        chat = client.ServerChat(client.find(settings), settings)
        history = [
            {"role": role, "content": f"turn {i} " + "tell me more about caches " * 3}
            for i in range(400)
            for role in ("user", "assistant")
        ]
        assert chat.count(history) > chat.context_length  # the server's refusal, as a count past the context
        conversation = Conversation(chat, settings, GenerationConfig(max_new_tokens=8), messages=history)
        turn = conversation.send("and now?", Silent())
        assert turn.dropped > 390 and turn.prompt_tokens + 8 <= chat.context_length
        assert len(conversation.snapshot()["messages"]) == len(history) + 2  # every turn kept for a save
    finally:
        stop(running, thread)


def test_a_server_starts_on_a_target_whose_context_is_shorter_than_its_warm_up(tmp_path):
    """The warm-up's chat prompt (92 tokens here) did not fit a 48-token context: start-up failed."""
    from tiny import save_tiny

    target = save_tiny(tmp_path / "short", 0, context=48)
    settings = dataclasses.replace(settings_for({"target": target, "draft": target}), draft=None)
    running, thread = start(settings)
    try:
        status, body, _ = raw(
            running,
            "POST",
            "/v1/chat/completions",
            {"model": model(running), "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert status == 200, body
    finally:
        stop(running, thread)


def test_three_methods_share_one_batch_and_answer_as_alone(served, monkeypatch):
    """Three concurrent streams, plain, chain and lookup-chain, run as rows of one batch (the
    engine saw a width of 3: /metrics' batch width and each row's round), each answering what
    it answers alone."""
    from specgen.decoding.engine import Engine

    slow_rounds(monkeypatch, 0.01)
    widths: list[int] = []
    real = Engine._round

    def counted(self, rows):
        widths.append(len(rows))
        return real(self, rows)

    monkeypatch.setattr(Engine, "_round", counted)
    methods = ["plain", "chain", "lookup-chain"]

    def one(method: str) -> str:
        body = chat_body(
            served, max_tokens=24, temperature=0, ignore_eos=True, speculative={"method": method}
        )
        status, answer, _ = raw(served, "POST", "/v1/chat/completions", body)
        assert status == 200, answer
        return answer["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(one, methods))
    assert max(widths) == 3
    widths.clear()
    assert [one(m) for m in methods] == together  # alone, one after another
    assert max(widths) == 1
