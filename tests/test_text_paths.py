"""One text for one list of ids on every path: `run --format json`, plain and rich output, a
batch's rows and the server. A byte-fallback tokenizer (Llama 2, Mistral, Gemma) decodes a run
of byte tokens that is not UTF-8 into one U+FFFD per byte, valid bytes included, so its whole
decode and a stream's text disagreed: JSON said '������' where plain printed 'de\\x1a\\x1f' and
lost the rest, and the server lost it too. A character cut short at the end was missing from
the rich view alone."""

from __future__ import annotations

import json

import pytest
from tiny import build_byte_fallback_tokenizer, build_tokenizer, save_byte_fallback_llama
from typer.testing import CliRunner

from specgen.cli import app
from specgen.decoding.events import RoundResult, StopReason
from specgen.decoding.views import round_text
from specgen.text import TextStream, text_of

runner = CliRunner()
PROMPTS = ["hello world", "abc", "hello"]  # each answer holds bytes that form no character here


def byte_ids(tokenizer, data: bytes) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in data]


def test_a_stray_byte_keeps_the_characters_around_it():
    tokenizer = build_byte_fallback_tokenizer()
    ids = byte_ids(tokenizer, b"de\x1a\x1f\x85P")  # 0x85 starts no character
    assert tokenizer.decode(ids) == "\ufffd" * 6  # the library's decode: the valid bytes lost too
    stream = TextStream(tokenizer)
    # the stray byte's decode is not a prefix of the next: the held tokens' own bytes decide
    assert [stream.push(t) for t in ids] == ["d", "e", "\x1a", "\x1f", "\ufffd", "P"]
    assert stream.text() == text_of(tokenizer, ids) == "de\x1a\x1f\ufffdP"
    for data in (
        b"d\xc3\xa9\x85",
        "\u00e9\u00e9".encode() + b"\x85",
        b"d\x85\xc3\xa9",
    ):  # one U+FFFD per stray byte
        ids = byte_ids(tokenizer, data) + [tokenizer.convert_tokens_to_ids("a")]
        again = TextStream(tokenizer)
        for token in ids:
            again.push(token)
        again.truncate(2)  # a rollback widens the decode window: the text must not change
        for token in ids[2:]:
            again.push(token)
        assert text_of(tokenizer, ids) == again.text() == data.decode("utf-8", "replace") + "a"
    assert text_of(tokenizer, byte_ids(tokenizer, "dé".encode())) == "dé"  # valid text: the decode itself


@pytest.mark.parametrize(
    "build, cut",
    [
        (build_tokenizer, None),
        (build_byte_fallback_tokenizer, None),
        (build_byte_fallback_tokenizer, "stray"),
    ],
)
def test_the_rows_last_round_flushes_what_the_stream_held_back(build, cut):
    """Into the piece of the last token with text (not the EOS after it), so every renderer,
    which writes pieces, ends with the whole text."""
    tokenizer = build()
    if build is build_tokenizer:
        ids = tokenizer.encode("hé", add_special_tokens=False)[:-1]  # 'h', then half of 'é'
        want = "h\ufffd"
    else:
        ids = byte_ids(tokenizer, b"h\xc3" if cut is None else b"h\x85P")
        want = "h\ufffd" if cut is None else "h\ufffdP"
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    stream = TextStream(tokenizer)
    first = round_text(RoundResult(target_token=ids[0], emitted=ids[:1]), stream)
    last = round_text(
        RoundResult(
            list(ids[1:]),
            tuple(range(len(ids) - 1)),
            tuple(range(1, len(ids))),
            eos,
            emitted=[*ids[1:], eos],
            stop=StopReason.EOS,
        ),
        stream,
    )
    assert "".join(first.pieces + last.pieces) + last.tail == want == stream.text()
    assert last.pieces[-1] == ""  # the EOS adds no text
    assert text_of(tokenizer, [*ids, eos]) == want
    alone = TextStream(tokenizer)  # the EOS alone in the last round: the tail is still the earlier bytes'
    pieces = round_text(
        RoundResult(
            list(ids[:-1]), tuple(range(len(ids) - 1)), tuple(range(1, len(ids))), ids[-1], emitted=list(ids)
        ),
        alone,
    ).pieces
    last = round_text(RoundResult(target_token=eos, emitted=[eos], stop=StopReason.EOS), alone)
    assert last.pieces == ("",) and "".join(pieces) + last.tail == want


def test_deterministic_mode_flushes_at_the_replay_that_ends_the_row():
    """A pending round's stop is not final: a replay may roll its EOS back and correct the
    character it cut. Flushing at the round showed the half character, then the whole one."""
    from specgen.decoding.events import ReplayResult
    from specgen.decoding.views import replay_text

    tokenizer = build_byte_fallback_tokenizer()
    h, lead, follow = byte_ids(tokenizer, "hé".encode())
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    stream = TextStream(tokenizer)
    view = round_text(
        RoundResult([h, lead], (0, 1), (1, 2), eos, emitted=[h, lead, eos], stop=StopReason.EOS),
        stream,
        pending=True,
    )
    assert view.tail == ""
    replay = replay_text(ReplayResult(0, 3, (eos,), follow, 3, 0.0, stop=StopReason.EOS), stream)
    kept = view.pieces[: len(view.pieces) - len(replay.rolled_back)]
    assert "".join(kept) + (replay.correction_text or "") + replay.tail == "hé" == stream.text()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("byte-fallback")
    return [
        "--target",
        str(save_byte_fallback_llama(root / "target", seed=3)),
        "--draft",
        str(save_byte_fallback_llama(root / "draft", seed=4, layers=1)),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "-n",
        "12",
    ]


def test_json_plain_batch_and_server_give_one_text(llama, tmp_path):
    import httpx
    from test_server import start, stop

    from specgen.config import ModelSettings

    texts = {}
    for prompt in PROMPTS:
        result = runner.invoke(app, ["run", prompt, *llama, "--no-server", "--format", "json"])
        assert result.exit_code == 0, result.output
        answer = json.loads(result.stdout)
        texts[prompt] = answer["text"]
        decoded = build_byte_fallback_tokenizer().decode(answer["token_ids"], skip_special_tokens=True)
        assert answer["text"].count("\ufffd") < decoded.count("\ufffd")  # the case at hand: bytes kept
        plain = runner.invoke(app, ["run", prompt, *llama, "--no-server", "--format", "plain"])
        assert plain.exit_code == 0 and plain.stdout == answer["text"] + "\n", (plain.stdout, answer["text"])
    batch = tmp_path / "prompts.txt"
    batch.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "out.jsonl"
    result = runner.invoke(
        app, ["run", "--prompts-file", str(batch), "--output", str(out), "--batch-size", "3", *llama]
    )
    assert result.exit_code == 0, result.output
    by_id = {record["id"]: record["text"] for record in map(json.loads, out.read_text().splitlines())}
    assert [by_id[line] for line in (1, 2, 3)] == [texts[p] for p in PROMPTS]  # ids: line numbers
    settings = ModelSettings(llama[1], llama[3], "cpu", None, "float32", "auto", "auto", "auto")
    running, thread = start(settings)
    try:
        url = running.state.info["url"]
        headers = {"Authorization": f"Bearer {running.token}"}
        for prompt in PROMPTS:
            body = {
                "model": running.state.model_id,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 12,
                "temperature": 0,
            }
            answer = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60).json()
            assert answer["choices"][0]["message"]["content"] == texts[prompt]
            with httpx.stream(
                "POST",
                f"{url}/v1/chat/completions",
                json={**body, "stream": True},
                headers=headers,
                timeout=60,
            ) as streamed:
                deltas = [
                    json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")
                ]
            assert (
                "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas if d["choices"])
                == texts[prompt]
            )
    finally:
        stop(running, thread)


def test_the_rich_view_ends_with_a_character_cut_short(tiny_dirs):
    """The tiny pair's 4-token answer ends in half a character: JSON and plain end in U+FFFD,
    and the rich view, which writes the rounds' pieces, dropped it."""
    models = [
        "--target",
        str(tiny_dirs["target"]),
        "--draft",
        str(tiny_dirs["draft"]),
        "-n",
        "4",
        "--no-server",
        "--dtype",
        "float32",
        "--device",
        "cpu",
    ]
    text = json.loads(runner.invoke(app, ["run", "hello world", *models, "--format", "json"]).stdout)["text"]
    assert text.endswith("\ufffd")
    rich = runner.invoke(app, ["run", "hello world", *models, "--format", "rich"])
    assert rich.exit_code == 0 and rich.stdout.startswith(text + "\n"), rich.stdout


@pytest.mark.parametrize(
    "build, tokens, want",
    [
        # a special token after U+FFFD: the space of the next piece stays (the decoder strips a
        # window's leading one)
        (build_byte_fallback_tokenizer, ["<0x85>", "</s>", "\u2581", "h"], "\ufffd h"),
        (
            build_byte_fallback_tokenizer,
            ["\u00e9", "<0x85>", "<unk>", "\u2581", "h", "\u2581", "e"],
            "\u00e9\ufffd h e",
        ),
        # bytes held back, then closed by a piece: their own bytes, whatever the decode window
        (build_byte_fallback_tokenizer, ["h", "<0x20>", "<0xC3>", "o"], "h \ufffdo"),
        (build_byte_fallback_tokenizer, ["<0xEF>", "<0xA5>", "\u2581"], "\ufffd "),
        # an added token marked special (skipped by decode) between the halves of a character
        (build_tokenizer, ["h", "\u00c3", "<|im_start|>", "\u00a9"], "h\u00e9"),
    ],
)
def test_the_stream_and_a_batch_row_agree_on_odd_runs(build, tokens, want):
    tokenizer = build()
    ids = tokenizer.convert_tokens_to_ids(tokens)
    stream = TextStream(tokenizer)
    pieces = [stream.push(token) for token in ids]
    assert "".join(pieces) + stream.flush() == want == text_of(tokenizer, ids)
