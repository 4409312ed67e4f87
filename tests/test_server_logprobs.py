"""`logprobs` on the OpenAI API (chat's `logprobs`/`top_logprobs`, completions' `logprobs`):
every answered token with the target's log-probability and the most likely alternatives,
streamed or not, cut with the answer at a stop string; speculation reports what plain decoding
reports. Driven by the official `openai` client and raw HTTP, on the tiny pair."""

from __future__ import annotations

import json
import math

import pytest
from test_server import model, pair, raw, sdk, served  # noqa: F401 (fixtures)

openai = pytest.importorskip("openai")
PROMPT = "Write a haiku about caches"
CHAIN = {"speculative": {"method": "chain", "draft_tokens": 3}}


def ask(sdk, served, method: str, **kwargs):
    kwargs = {"max_tokens": 16, **kwargs}
    return sdk.chat.completions.create(
        model=model(served),
        messages=[{"role": "user", "content": PROMPT}],
        temperature=0,
        logprobs=True,
        extra_body={"speculative": {"method": method}},
        **kwargs,
    )


def joined(content) -> str:
    """The answer rebuilt from its tokens' bytes."""
    return b"".join(bytes(entry.bytes) for entry in content).decode("utf-8", "replace")


def test_chat_logprobs_match_plain_decoding_streamed_or_not(served, sdk):
    answer = ask(sdk, served, "chain", top_logprobs=2)
    content = answer.choices[0].logprobs.content
    assert joined(content) == answer.choices[0].message.content  # byte tokens: many hold part of a character
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token and math.isclose(
            entry.top_logprobs[0].logprob, entry.logprob
        )  # greedy
    plain = ask(sdk, served, "plain", top_logprobs=2).choices[0].logprobs.content
    assert [e.token for e in plain] == [e.token for e in content]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4) for a, b in zip(plain, content))
    chunks = list(ask(sdk, served, "chain", top_logprobs=2, stream=True))
    streamed = [
        entry
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for entry in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    # the same up to float rounding: this prompt's K/V now comes from the prefix cache
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4) for a, b in zip(streamed, content))
    # without top_logprobs: the token alone; without logprobs: null, as before
    assert ask(sdk, served, "chain").choices[0].logprobs.content[0].top_logprobs == []
    plain_answer = sdk.chat.completions.create(
        model=model(served), messages=[{"role": "user", "content": PROMPT}], max_tokens=4, temperature=0
    )
    assert plain_answer.choices[0].logprobs is None


def test_completion_logprobs_in_the_legacy_shape(served, sdk):
    answer = sdk.completions.create(
        model=model(served),
        prompt="def add(a, b):",
        max_tokens=12,
        temperature=0,
        logprobs=3,
        extra_body=CHAIN,
    )
    text, logprobs = answer.choices[0].text, answer.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(logprobs.tokens) == len(logprobs.text_offset) > 0
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    for token, offset, top in zip(logprobs.tokens, logprobs.text_offset, logprobs.top_logprobs):
        assert "\ufffd" in token or text[offset : offset + len(token)] == token  # a whole character: in place
        assert len(top) <= 3 and max(top, key=top.get) == token  # greedy: the most likely one
    streamed = list(
        sdk.completions.create(
            model=model(served),
            prompt="def add(a, b):",
            max_tokens=12,
            temperature=0,
            logprobs=3,
            stream=True,
            extra_body=CHAIN,
        )
    )
    tokens = [
        t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens
    ]
    assert tokens == logprobs.tokens


def test_a_stop_string_cuts_the_logprobs_with_the_answer(served, sdk):
    whole = (
        sdk.chat.completions.create(
            model=model(served), messages=[{"role": "user", "content": PROMPT}], max_tokens=30, temperature=0
        )
        .choices[0]
        .message.content
    )
    stop = whole[8:11]
    expected = whole[: whole.index(stop)]
    for stream in (False, True):
        result = ask(sdk, served, "chain", max_tokens=30, stop=stop, stream=stream)
        if stream:
            chunks = list(result)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            content = [
                e
                for c in chunks
                if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content
            ]
        else:
            text, content = result.choices[0].message.content, result.choices[0].logprobs.content
        assert text == expected
        # the tokens that make the answer (which ones exactly: the Output tests below, on whole characters)
        assert joined(content).startswith(expected) and len(content) < 30


def test_rows_asking_and_not_asking_share_a_batch(served, sdk):
    """Concurrent greedy requests, half with logprobs: each answer is what it is alone, and each
    reports logprobs exactly when it asked."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = ["Write a haiku about caches", "def add(a, b):", "Explain KV caches", "hello", "x", "Why?"]

    def one(i: int):
        kwargs = {"logprobs": True, "top_logprobs": 1} if i % 2 else {}
        return sdk.chat.completions.create(
            model=model(served),
            messages=[{"role": "user", "content": prompts[i]}],
            max_tokens=12,
            temperature=0,
            extra_body=CHAIN,
            **kwargs,
        ).choices[0]

    alone = [one(i) for i in range(len(prompts))]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(one, range(len(prompts))))
    for i, (a, b) in enumerate(zip(alone, together)):
        assert a.message.content == b.message.content
        if i % 2:
            assert [e.token for e in a.logprobs.content] == [e.token for e in b.logprobs.content]
            assert all(
                math.isclose(x.logprob, y.logprob, abs_tol=1e-4)
                for x, y in zip(a.logprobs.content, b.logprobs.content)
            )
        else:
            assert a.logprobs is None and b.logprobs is None


@pytest.mark.parametrize(
    "body,message",
    [
        ({"top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true"),
        ({"logprobs": True, "top_logprobs": 21}, "'top_logprobs' must be an integer 0..20"),
        ({"logprobs": 1}, "'logprobs' must be true or false"),
        ({"logprobs": True, "speculative": {"deterministic": True}}, "not reported in deterministic mode"),
    ],
)
def test_bad_logprobs_requests_are_400s(served, body, message):
    status, answer, _ = raw(
        served,
        "POST",
        "/v1/chat/completions",
        {"model": model(served), "messages": [{"role": "user", "content": "hi"}], **body},
    )
    assert status == 400 and message in answer["error"]["message"], answer


def test_bad_completion_logprobs_are_400s(served):
    for value, message in (
        (-1, "'logprobs' must be an integer 0..20"),
        (True, "'logprobs' must be an integer"),
    ):
        status, answer, _ = raw(
            served, "POST", "/v1/completions", {"model": model(served), "prompt": "hi", "logprobs": value}
        )
        assert status == 400 and message in answer["error"]["message"], answer
    status, answer, _ = raw(
        served, "POST", "/v1/completions", {"model": model(served), "prompt": "hi", "top_logprobs": 2}
    )
    assert status == 400 and "unknown parameter 'top_logprobs'" in answer["error"]["message"]
    status, answer, _ = raw(
        served,
        "POST",
        "/v1/completions",
        {"model": model(served), "prompt": "hi", "logprobs": 0, "max_tokens": 3},
    )
    assert (
        status == 200 and len(answer["choices"][0]["logprobs"]["tokens"]) >= 1
    )  # 0: the tokens, no alternatives
    assert answer["choices"][0]["logprobs"]["top_logprobs"][0] == {}


# -- which tokens an answer reports: Output alone, on ASCII text (a token per character) ---------------


def _output_of(stops: list[str], stream: bool):
    from tiny import build_tokenizer

    from specgen.config import GenerationConfig, SamplingConfig
    from specgen.serve import api
    from specgen.serve.output import Output

    tokenizer = build_tokenizer()
    prompt = api.Prompt(None, "p", "prompt")
    request = api.ApiRequest(
        "completion",
        (prompt,),
        GenerationConfig(sampling=SamplingConfig(logprobs=1)),
        stops=tuple(stops),
        stream=stream,
    )
    return Output(request, prompt, tokenizer, 1), tokenizer


def _feed(output, tokenizer, text: str, middle: list[int] = ()) -> list:
    """`text` (then `middle`'s tokens, then its end again) as rounds of three tokens, ended by
    EOS as the engine ends a row; the chunks it made."""
    from specgen.decoding.events import RoundResult, StopReason, TokenLogprob
    from specgen.decoding.stats import Stats

    words = tokenizer.encode(text, add_special_tokens=False)
    ids = words + list(middle) + (words[-2:] if middle else []) + [tokenizer.eos_token_id]
    chunks = []
    for start in range(0, len(ids), 3):
        emitted = ids[start : start + 3]
        logprobs = tuple(TokenLogprob(-0.25 * (start + i), ((t, -0.1),)) for i, t in enumerate(emitted))
        event = RoundResult(
            emitted[:-1],
            tuple(range(len(emitted) - 1)),
            tuple(range(1, len(emitted))),
            emitted[-1],
            emitted=emitted,
            logprobs=logprobs,
            stop=StopReason.EOS if start + 3 >= len(ids) else None,
        )
        chunks += output.add(event, Stats("chain"))
    return ids, chunks


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_reports_the_tokens_that_make_it(stream):
    output, tokenizer = _output_of(["lo w"], stream)
    from specgen.decoding.stats import Stats

    ids, chunks = _feed(output, tokenizer, "Hello world, and more")
    if stream:
        chunks += output.finish(Stats("chain"), ids, "eos")
        fields = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    else:
        answer = output.response(Stats("chain"), ids, "eos")
        fields, text = [answer["choices"][0]["logprobs"]], answer["choices"][0]["text"]
    tokens = [t for f in fields for t in f["tokens"]]
    offsets = [o for f in fields for o in f["text_offset"]]
    assert text == "Hel"
    # the answer is cut before the stop string "lo w": its tokens H, e, l and none after
    assert tokens == ["H", "e", "l"] and offsets == [0, 1, 2]
    assert [v for f in fields for v in f["token_logprobs"]] == [0.0, -0.25, -0.5]


def test_an_answer_without_a_stop_reports_every_token_but_the_eos():
    output, tokenizer = _output_of([], stream=False)
    from specgen.decoding.stats import Stats

    ids, _ = _feed(output, tokenizer, "Hi there")
    logprobs = output.response(Stats("chain"), ids, "eos")["choices"][0]["logprobs"]
    assert "".join(logprobs["tokens"]) == "Hi there" and len(logprobs["tokens"]) == len(ids) - 1
    assert logprobs["top_logprobs"][0] == {"H": -0.1}


@pytest.mark.parametrize("stream", [False, True])
def test_a_special_token_mid_answer_has_its_entry(stream):
    """A special token decoded mid-answer (a random model's, or one under ignore_eos) is a
    completion token like any other: it has its entry, so the entries stay one per token (its text is the
    token's own, which the answer's text leaves out); only the
    end-of-sequence token that ended the row has none."""
    output, tokenizer = _output_of([], stream=stream)
    from specgen.decoding.stats import Stats

    special = tokenizer.eos_token_id
    ids, chunks = _feed(output, tokenizer, "Hi there", middle=[special])
    if stream:
        chunks += output.finish(Stats("chain"), ids, "eos")
        fields = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    else:
        fields = [output.response(Stats("chain"), ids, "eos")["choices"][0]["logprobs"]]
    tokens = [t for f in fields for t in f["tokens"]]
    values = [v for f in fields for v in f["token_logprobs"]]
    assert len(tokens) == len(ids) - 1  # every token but the last EOS
    assert tokens[len("Hi there")] == tokenizer.eos_token
    assert "".join(tokens).replace(tokenizer.eos_token, "") == "Hi therere"
    assert values == [-0.25 * i for i in range(len(ids) - 1)]


# -- `specgen run --logprobs`: in its own process, on the server, for a prompt set -----------------------


def test_run_logprobs_are_the_same_in_its_own_process_and_on_the_server(served, tiny_dirs, tmp_path):
    from test_server import invoke, last_json, options

    args = ("run", PROMPT, *options(tiny_dirs), "-n", "10", "-k", "3", "--format", "json", "--logprobs", "2")
    before = served.scheduler.served
    local, remote = last_json(invoke(*args, "--no-server")), last_json(invoke(*args))
    assert served.scheduler.served == before + 1  # the second one ran on the server
    assert remote["token_ids"] == local["token_ids"] == [e["id"] for e in local["logprobs"]]
    assert [e["id"] for e in remote["logprobs"]] == remote["token_ids"]
    for a, b in zip(local["logprobs"], remote["logprobs"]):
        assert a["token"] == b["token"] and math.isclose(a["logprob"], b["logprob"], abs_tol=1e-4)
        assert [t["id"] for t in a["top"]] == [t["id"] for t in b["top"]] and len(a["top"]) == 2
        assert a["top"][0]["id"] == a["id"] and bytes(a["bytes"]).decode("utf-8", "replace") == a["token"]
    assert b"".join(bytes(e["bytes"]) for e in local["logprobs"]).decode("utf-8", "replace") == local["text"]
    # a prompt set: each JSON line with its own tokens' logprobs, also in OUT.jsonl
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPT}\nhello\n")
    many = invoke(
        "run",
        "--prompts-file",
        str(prompts),
        *options(tiny_dirs),
        "-n",
        "6",
        "--batch-size",
        "2",
        "--format",
        "json",
        "--logprobs",
        "1",
    )
    assert many.exit_code == 0, many.output
    rows = [json.loads(line) for line in many.stdout.splitlines()]
    assert rows[0]["token_ids"] == local["token_ids"][:6]
    assert all([e["id"] for e in row["logprobs"]] == row["token_ids"] for row in rows)
    out = tmp_path / "out.jsonl"
    assert (
        invoke(
            "run",
            "--prompts-file",
            str(prompts),
            *options(tiny_dirs),
            "-n",
            "6",
            "--output",
            str(out),
            "--logprobs",
            "1",
        ).exit_code
        == 0
    )
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert all([e["id"] for e in row["logprobs"]] == row["token_ids"] for row in written)


def test_run_logprobs_need_json_output(tiny_dirs):
    from test_server import invoke, options

    for extra in (("--format", "plain"), ("--logprobs", "21", "--format", "json")):
        result = invoke("run", "hi", *options(tiny_dirs), "--no-server", "--logprobs", "1", *extra)
        assert result.exit_code == 1 and "Traceback" not in result.output
    assert (
        "add --format json"
        in invoke("run", "hi", *options(tiny_dirs), "--logprobs", "1", "--format", "plain").output
    )


@pytest.mark.parametrize("rounds", [[3], [2, 1]])  # the EOS in the round that cut the character, or alone
def test_a_character_cut_short_at_the_end_is_its_tokens_text_not_the_eos(rounds):
    """The text the stream releases at the end completes the last token that is not special:
    the EOS after it still reports nothing, wherever the rounds split."""
    from specgen.decoding.events import RoundResult, StopReason, TokenLogprob
    from specgen.decoding.stats import Stats

    output, tokenizer = _output_of([], stream=False)
    ids = tokenizer.encode("hé", add_special_tokens=False)[:-1] + [
        tokenizer.eos_token_id
    ]  # h, half of é, EOS
    start = 0
    for size in rounds:
        emitted = ids[start : start + size]
        logprobs = tuple(TokenLogprob(-0.5, ((t, -0.1),)) for t in emitted)
        output.add(
            RoundResult(
                emitted[:-1],
                tuple(range(len(emitted) - 1)),
                tuple(range(1, len(emitted))),
                emitted[-1],
                emitted=emitted,
                logprobs=logprobs,
                stop=StopReason.EOS if start + size == len(ids) else None,
            ),
            Stats("chain"),
        )
        start += size
    answer = output.response(Stats("chain"), ids, "eos")["choices"][0]
    assert answer["text"] == "h\ufffd"
    assert answer["logprobs"]["text_offset"] == [0, 1] and len(answer["logprobs"]["tokens"]) == 2
