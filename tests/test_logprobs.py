"""Log-probabilities of committed tokens (SamplingConfig.logprobs, the server's `logprobs`): each
is the target's own log-softmax at the token's position, whatever the method, the batch or the
sampling; speculative methods report what plain decoding reports."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny import engine_with

from specgen.config import GenerationConfig, Method, SamplingConfig
from specgen.decoding.events import RoundResult
from specgen.errors import ConfigError

PROMPTS = [
    [257, 84, 82, 68, 81, 198, 71, 127, 102, 258, 198, 257, 64],  # long: first token from the prefill
    [257, 64, 80],
]  # short: its first token is speculated
TOP = 3


def reported(engine, prompts, config, batch_size=1) -> dict[int, tuple[list[int], list]]:
    """Per prompt: the emitted tokens and their TokenLogprobs, in order."""
    out = {i: ([], []) for i in range(len(prompts))}
    for report in engine.generate(prompts, config, batch_size):
        if isinstance(report.event, RoundResult):
            asked = config.sampling.logprobs is not None
            assert len(report.event.logprobs) == (len(report.event.emitted) if asked else 0)
            out[report.index][0].extend(report.event.emitted)
            out[report.index][1].extend(report.event.logprobs)
    return out


def direct(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The target's log-softmax at every generated position, from one forward without a cache."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[
            0, len(prompt) - 1 : len(prompt) + len(tokens) - 1
        ]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize(
    "method", [Method.PLAIN, Method.CHAIN, Method.LOOKUP_CHAIN, Method.RSD_C, Method.RSD_S]
)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_each_token_carries_the_targets_log_probability(tiny_pair, method, temperature):
    sampling = SamplingConfig(temperature=temperature, seed=3, logprobs=TOP)
    config = GenerationConfig(method=method, max_new_tokens=24, draft_tokens=3, sampling=sampling)
    target = tiny_pair[0].model
    for prompt, (tokens, logprobs) in zip(
        PROMPTS, reported(engine_with(tiny_pair, config), PROMPTS, config).values()
    ):
        assert 0 < len(tokens) <= 24  # a sampled EOS may end it early
        law = direct(target, prompt, tokens)
        chosen = law.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor([lp.logprob for lp in logprobs]), chosen, atol=1e-4)
        best = law.topk(TOP, dim=-1)
        for lp, values, ids in zip(logprobs, best.values, best.indices):
            assert [t for t, _ in lp.top] == ids.tolist()  # most likely first (tiny logits have no ties)
            assert torch.allclose(torch.tensor([v for _, v in lp.top]), values, atol=1e-4)
        if temperature == 0.0:  # greedy: every token is the most likely one
            assert all(lp.top[0][0] == t for lp, t in zip(logprobs, tokens))


def test_speculation_reports_what_plain_decoding_reports_in_a_batch(tiny_pair):
    sampling = SamplingConfig(logprobs=2)
    plain, chain = (
        GenerationConfig(method=m, max_new_tokens=20, draft_tokens=4, sampling=sampling)
        for m in (Method.PLAIN, Method.CHAIN)
    )
    ours = reported(engine_with(tiny_pair, chain), PROMPTS, chain, batch_size=2)
    theirs = reported(engine_with(tiny_pair, plain), PROMPTS, plain, batch_size=1)
    for i in ours:
        assert ours[i][0] == theirs[i][0]
        assert torch.allclose(
            torch.tensor([lp.logprob for lp in ours[i][1]]),
            torch.tensor([lp.logprob for lp in theirs[i][1]]),
            atol=1e-4,
        )
        assert [[t for t, _ in lp.top] for lp in ours[i][1]] == [
            [t for t, _ in lp.top] for lp in theirs[i][1]
        ]


def test_rows_that_do_not_ask_report_nothing_and_zero_alternatives_report_the_token_alone(tiny_pair):
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=8, draft_tokens=3)
    assert all(not lp for _, lp in reported(engine_with(tiny_pair, config), PROMPTS, config).values())
    config = dataclasses.replace(config, sampling=SamplingConfig(logprobs=0))
    for _, logprobs in reported(engine_with(tiny_pair, config), PROMPTS, config).values():
        assert len(logprobs) == 8 and all(lp.top == () and lp.logprob <= 0 for lp in logprobs)


def test_logprobs_are_checked_and_refused_in_deterministic_mode():
    with pytest.raises(ConfigError, match="--logprobs must be in 0..20"):
        SamplingConfig(logprobs=21)
    with pytest.raises(ConfigError, match="not reported in deterministic mode"):
        GenerationConfig(deterministic=True, sampling=SamplingConfig(logprobs=1))
    seeded = GenerationConfig(deterministic=True, sampling=SamplingConfig(temperature=0.5))
    assert seeded.sampling.seed == 0 and seeded.sampling.temperature == 0.5  # the default seed, as before


def test_a_tokens_bytes_rebuild_text_whose_characters_span_tokens():
    from tiny import build_tokenizer

    from specgen.text import TokenBytes

    tokenizer = build_tokenizer()
    text = "Héllo wörld, 日本 🙂"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode())  # a token per byte: most characters here span several
    raw = TokenBytes(tokenizer)
    assert b"".join(raw(i) for i in ids) == text.encode()
    assert raw(tokenizer.eos_token_id) == tokenizer.eos_token.encode()
