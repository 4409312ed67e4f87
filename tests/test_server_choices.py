"""`n` choices per request: a row of the batch each; choice i with a seed samples as a request
with seed + i does; streamed under their indices with one usage chunk; one request in the
metrics; a queue without room for all of them answers 503; a client that leaves frees every
row. Driven by the official `openai` client and raw HTTP, on the tiny pair."""

from __future__ import annotations

import pytest
from test_server import model, pair, raw, sdk, served, settings_for, slow_rounds, start, stop  # noqa: F401
from test_server_load import chat_body, leave_mid_stream

openai = pytest.importorskip("openai")
PROMPT = "Write a haiku about caches"
MESSAGES = [{"role": "user", "content": PROMPT}]


def test_choice_i_is_the_request_with_seed_plus_i(served, sdk):
    """In deterministic mode a sampled answer depends on its seed alone (not on the batch), so
    choice i is exactly the request with seed + i."""
    kwargs = dict(
        model=model(served),
        messages=MESSAGES,
        max_tokens=10,
        temperature=0.9,
        extra_body={
            "speculative": {"method": "chain", "draft_tokens": 3, "deterministic": True, "verify_window": 4}
        },
    )
    answer = sdk.chat.completions.create(n=3, seed=5, **kwargs)
    alone = [sdk.chat.completions.create(seed=5 + i, **kwargs) for i in range(3)]
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.message.content for c in answer.choices] == [a.choices[0].message.content for a in alone]
    assert len({c.message.content for c in answer.choices}) > 1  # sampled: the choices differ
    assert answer.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert answer.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    totals = answer.model_extra["speculative"]
    assert totals["drafted"] == sum(c.model_extra["speculative"]["drafted"] for c in answer.choices)
    assert totals["accepted"] == sum(c.model_extra["speculative"]["accepted"] for c in answer.choices)
    # not deterministic: the choices still differ (each row its own random stream)
    kwargs["extra_body"] = {"speculative": {"method": "chain", "draft_tokens": 3}}
    assert len({c.message.content for c in sdk.chat.completions.create(n=3, seed=5, **kwargs).choices}) > 1


def test_streamed_choices_come_under_their_indices_with_one_usage_chunk(served, sdk):
    # a draft length of the request's own: the server's measured rates (timings) could otherwise
    # choose another k for the second request, and a sampled chain's draws follow k
    kwargs = dict(
        model=model(served),
        messages=MESSAGES,
        max_tokens=8,
        temperature=0.7,
        seed=11,
        extra_body={"speculative": {"draft_tokens": 3}},
    )
    whole = sdk.chat.completions.create(n=2, **kwargs)
    chunks = list(
        sdk.chat.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    texts = [
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(2)
    ]
    assert texts == [c.message.content for c in whole.choices]
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1]
    usage = [c for c in chunks if not c.choices]
    assert len(usage) == 1 and chunks[-1] is usage[0]
    assert usage[0].usage.completion_tokens == whole.usage.completion_tokens == 16
    completions = sdk.completions.create(
        model=model(served), prompt="def add(a, b):", max_tokens=6, temperature=0, n=2
    )
    assert [c.index for c in completions.choices] == [0, 1]
    assert completions.choices[0].text == completions.choices[1].text  # greedy: one answer, twice


def test_a_request_of_n_choices_is_one_request_in_the_metrics(served):
    def count() -> float:
        text = raw(served, "GET", "/metrics")[1]
        # every outcome: a sampled choice 0 may end on EOS ("stop") as well as on max_tokens ("length")
        return sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith('specgen_requests_total{endpoint="chat"')
        )

    before = count()
    status, body, _ = raw(served, "POST", "/v1/chat/completions", chat_body(served, max_tokens=3, n=4))
    assert status == 200 and len(body["choices"]) == 4
    assert count() == before + 1


def test_more_choices_than_the_queue_ever_holds_answer_400(tiny_dirs, pair):  # noqa: F811
    """Not a 503: a retry could never succeed (and the SDK retries 503s by itself)."""
    running, thread = start(settings_for(tiny_dirs), pair, max_batch_size=2, max_queue=2)
    try:
        status, body, headers = raw(
            running, "POST", "/v1/chat/completions", chat_body(running, max_tokens=3, n=3)
        )
        assert status == 400 and body["error"]["param"] == "n" and "at most 2" in body["error"]["message"]
        assert not running.scheduler.busy()  # none of the three was queued
        status, body, _ = raw(running, "POST", "/v1/chat/completions", chat_body(running, max_tokens=3, n=2))
        assert status == 200 and len(body["choices"]) == 2
    finally:
        stop(running, thread)


def test_a_client_leaving_frees_every_choices_row(served, monkeypatch):
    slow_rounds(monkeypatch, 0.02)
    leave_mid_stream(served, chat_body(served, max_tokens=200, temperature=0, n=3))


def test_choices_seeds_wrap_past_the_largest_seed_and_stay_distinct():
    from specgen.config import SEED_MAX, GenerationConfig, SamplingConfig
    from specgen.serve import api, scheduler

    request = api.ApiRequest(
        "completion",
        (api.Prompt(None, "x", "prompt"), api.Prompt(None, "y", "prompt")),
        GenerationConfig(sampling=SamplingConfig(temperature=1.0, seed=SEED_MAX)),
        n=3,
    )
    rows = scheduler.tickets(request, [[1], [2]], lambda choice: None)
    assert [t.config.sampling.seed for t in rows] == [SEED_MAX, 0, 1] * 2
    assert [(t.choice, t.prompt.text, t.ids) for t in rows] == [
        (0, "x", [1]),
        (1, "x", [1]),
        (2, "x", [1]),
        (3, "y", [2]),
        (4, "y", [2]),
        (5, "y", [2]),
    ]
