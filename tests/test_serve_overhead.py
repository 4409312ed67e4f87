"""The served path does what `specgen run` does per round, and no more than a little: counted,
never timed.

On the tiny pair, one greedy generation in this process (the driver, as `specgen run
--no-server`) and the same request through the server's engine thread are profiled
(`sys.setprofile`): Python calls per round, reads of tensors back to the host per round, and
the token ids each detokenizer call is given (a whole answer decoded per round would show as
long inputs). And the thread that loads and warms a server hands its OpenMP workers over to the
engine thread (runtime/threads.py): on a 2-core CPU they slowed every parallel op of the engine
by 15-35%.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
import urllib.request

import pytest
import torch

from specgen.config import GenerationConfig, Method, ModelSettings
from specgen.decoding import run as driver
from specgen.decoding.build import build_engine
from specgen.decoding.prompts import encode_prompt
from specgen.decoding.views import Silent
from specgen.runtime.pair import load
from specgen.runtime.threads import release_pool

NEW = 40
PROMPT = "hello there"
HOST_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"}


class Counter:
    """Calls seen by a profile function: Python calls, tensor reads to the host, decode inputs."""

    def __init__(self):
        self.calls = 0
        self.reads = collections.Counter()
        self.decoded: list[int] = []

    def __call__(self, frame, event, arg):
        if event == "call":
            self.calls += 1
            if frame.f_code.co_name == "decode" and "tokenization" in frame.f_code.co_filename:
                ids = frame.f_locals.get("token_ids")
                if isinstance(ids, list):
                    self.decoded.append(len(ids))
        elif event == "c_call":
            self.calls += 1
            name = getattr(arg, "__name__", "")
            if name in HOST_READS and "Tensor" in getattr(arg, "__qualname__", "Tensor"):
                self.reads[name] += 1


def settings(tiny_dirs) -> ModelSettings:
    return ModelSettings(
        str(tiny_dirs["target"]), str(tiny_dirs["draft"]), "cpu", None, "float32", "auto", "off", "auto"
    )


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    return load(settings(tiny_dirs), Method.CHAIN, quiet=True)


def local(pair, method: str) -> tuple[Counter, int]:
    config = GenerationConfig(method=Method(method), max_new_tokens=NEW, draft_tokens=3)
    engine = build_engine(pair, config)
    engine.stop_ids = frozenset()
    ids = encode_prompt(pair.target.tokenizer, PROMPT)
    counter = Counter()
    sys.setprofile(counter)
    try:
        outcome = driver.generate(engine, pair.target.tokenizer, ids, config, Silent())
    finally:
        sys.setprofile(None)
    return counter, outcome.stats.target_forwards


@pytest.fixture(scope="module")
def served(tiny_dirs, pair):
    """A server on the pair whose engine thread is profiled by the current `counter`."""
    from specgen.serve.server import ServeOptions, prepare

    running = prepare(settings(tiny_dirs), ServeOptions(port=0), quiet=True, pair=pair)
    running.counter = Counter()
    run = running.scheduler._run

    def profiled():
        sys.setprofile(lambda *args: running.counter(*args))
        run()

    running.scheduler.thread = threading.Thread(target=profiled, name="specgen-engine", daemon=True)
    thread = threading.Thread(target=running.serve_until_stopped, daemon=True)
    thread.start()
    yield running
    running.should_exit = True
    thread.join(timeout=30)


def through_server(running, method: str, stream: bool) -> tuple[Counter, int]:
    body = {
        "model": running.state.model_id,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": NEW,
        "temperature": 0,
        "stream": stream,
        "speculative": {"method": method, "draft_tokens": 3},
        "stream_options": {"include_usage": True} if stream else None,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{running.sock.getsockname()[1]}/v1/chat/completions",
        json.dumps({k: v for k, v in body.items() if v is not None}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {running.token}"},
    )
    running.counter = Counter()
    with urllib.request.urlopen(request, timeout=60) as answer:
        raw = answer.read().decode()
    if stream:
        events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
        summary = [e for e in events if e.get("speculative")][-1]["speculative"]
    else:
        summary = json.loads(raw)["speculative"]
    deadline = 0
    while running.scheduler.busy() and deadline < 200:  # the row's last bookkeeping after the answer
        threading.Event().wait(0.01)
        deadline += 1
    return running.counter, summary["target_forwards"]


@pytest.mark.parametrize("method", ["plain", "chain"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_served_round_costs_what_a_local_round_costs(pair, served, method, stream):
    """Per target forward: at most 150 more Python calls than the local driver (the answer's
    chunks and the server's metrics: about 90 now, against 400-1000 per round of the decode
    itself), the same reads of tensors to the host, and every detokenizer call given a few
    tokens (TextStream's window), never the answer so far; one whole decode at the end."""
    mine, rounds = local(pair, method)
    theirs, served_rounds = through_server(served, method, stream)
    assert rounds == served_rounds >= NEW // 4
    assert theirs.calls / served_rounds <= mine.calls / rounds + 150, (
        theirs.calls / served_rounds,
        mine.calls / rounds,
    )
    for name in HOST_READS:
        assert theirs.reads[name] <= mine.reads[name] + 2, (name, theirs.reads, mine.reads)
    long = [n for n in theirs.decoded if n > 16]
    assert len(long) <= 1 and len(theirs.decoded) >= NEW, theirs.decoded


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: OpenMP starts no workers")
def test_release_pool_frees_the_calling_threads_openmp_workers():
    """A thread that ran a parallel op keeps OpenMP workers; release_pool ends them."""
    threads = torch.get_num_threads()
    seen = []

    def work():
        a = torch.randn(256, 256)
        for _ in range(5):
            a @ a
        before = len(os.listdir("/proc/self/task"))
        released = release_pool()
        deadline = time.monotonic() + 5.0  # the workers exit on their own time: on a loaded machine, later
        while len(os.listdir("/proc/self/task")) >= before and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append((before, len(os.listdir("/proc/self/task")), released))

    torch.set_num_threads(2)
    try:
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(threads)
    before, after, released = seen[0]
    assert released and after < before


def test_a_server_releases_the_loading_threads_pool(tiny_dirs, pair, monkeypatch):
    from specgen.serve import server
    from specgen.serve.server import ServeOptions, prepare

    calls = []
    monkeypatch.setattr(server, "release_pool", lambda: calls.append(threading.current_thread()))
    running = prepare(settings(tiny_dirs), ServeOptions(port=0), quiet=True, pair=pair)
    running.sock.close()
    assert calls == [threading.current_thread()]
