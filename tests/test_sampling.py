"""Unit tests of the warp function and the draws built on it (specgen.sampling)."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from specgen.config import SamplingConfig
from specgen.decoding.sampling import choose, make_generator, sample, warp

VOCAB = 50


def random_logits(*shape: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(*shape, generator=make_generator(seed)) * scale


def distinct_logits(vocab: int, seed: int) -> torch.Tensor:
    """A random order of well-separated values: no ties anywhere."""
    return torch.randperm(vocab, generator=make_generator(seed)).float() * 0.37 - 5.0


def reference_warp(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Slow and obvious, one row in float64: temperature, top-k, renormalise, top-p prefix."""
    values = [float(v) / sampling.temperature for v in logits]
    order = sorted(range(len(values)), key=lambda i: -values[i])
    if 0 < sampling.top_k < len(values):
        order = order[: sampling.top_k]
    top = max(values[i] for i in order)
    weights = {i: math.exp(values[i] - top) for i in order}
    total = sum(weights.values())
    kept, mass = [], 0.0
    for i in order:  # the smallest prefix whose mass reaches top_p
        kept.append(i)
        mass += weights[i] / total
        if mass >= sampling.top_p:
            break
    out = torch.zeros(len(values), dtype=torch.float64)
    kept_total = sum(weights[i] for i in kept)
    for i in kept:
        out[i] = weights[i] / kept_total
    return out


# -- warp ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(),
        SamplingConfig(temperature=0.0, top_k=3, top_p=0.2),  # greedy ignores top-k and top-p
    ],
)
def test_temperature_zero_is_one_hot_on_the_argmax(sampling):
    logits = random_logits(2, 3, VOCAB)
    probs = warp(logits, sampling)
    expected = torch.nn.functional.one_hot(logits.argmax(dim=-1), VOCAB).float()
    assert probs.dtype == torch.float32
    assert torch.equal(probs, expected)
    # the hand-built case: +100 at the chosen token, -100 elsewhere
    hand = torch.full((VOCAB,), -100.0)
    hand[17] = 100.0
    one_hot = torch.nn.functional.one_hot(torch.tensor(17), VOCAB).float()
    assert torch.equal(warp(hand.bfloat16(), sampling), one_hot)


@pytest.mark.parametrize("k", [1, 2, 7, VOCAB - 1])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_top_k_keeps_exactly_k(k, temperature):
    logits = torch.stack([distinct_logits(VOCAB, seed) for seed in range(4)])
    sampling = SamplingConfig(temperature=temperature, top_k=k)
    probs = warp(logits, sampling)
    assert ((probs > 0).sum(dim=-1) == k).all()
    top = torch.topk(logits, k, dim=-1).indices
    assert (probs.gather(-1, top) > 0).all()
    # the kept tokens keep their relative weights
    kept = torch.softmax(logits.gather(-1, top) / temperature, dim=-1)
    expected = torch.zeros_like(probs).scatter_(-1, top, kept)
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("k", [0, VOCAB, VOCAB + 5])
def test_top_k_zero_or_at_least_vocab_keeps_everything(k):
    logits = distinct_logits(VOCAB, seed=1)
    probs = warp(logits, SamplingConfig(temperature=1.0, top_k=k))
    torch.testing.assert_close(probs, torch.softmax(logits, dim=-1))
    assert (probs > 0).all()


# probs 0.5, 0.3, 0.15, 0.05 (given as logits, listed out of order)
NUCLEUS_LOGITS = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (1e-6, {1}),  # the top token always stays
        (0.45, {1}),
        (0.55, {1, 3}),
        (0.79, {1, 3}),
        (0.81, {1, 3, 0}),
        (0.94, {1, 3, 0}),
        (0.96, {1, 3, 0, 2}),
        (1.0, {1, 3, 0, 2}),
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, kept):
    probs = warp(NUCLEUS_LOGITS, SamplingConfig(temperature=1.0, top_p=top_p))
    assert {int(i) for i in probs.nonzero()} == kept
    full = torch.softmax(NUCLEUS_LOGITS, dim=-1)
    index = torch.tensor(sorted(kept))
    torch.testing.assert_close(probs[index], full[index] / full[index].sum())
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=1.0, top_p=0.9),
        SamplingConfig(temperature=0.7, top_p=0.5),
        SamplingConfig(temperature=1.3, top_k=10, top_p=0.8),
        SamplingConfig(temperature=1.0, top_k=5),
        SamplingConfig(temperature=2.0),
    ],
)
def test_warp_matches_the_slow_reference(sampling):
    """Random rows against the float64 reference (rows with a prefix mass within 1e-4 of
    top_p are skipped: there float32 and float64 may legitimately disagree)."""
    logits = random_logits(64, VOCAB, seed=3)
    probs = warp(logits, sampling)
    checked = 0
    for row, got in zip(logits, probs):
        want = reference_warp(row, sampling)
        if sampling.top_p < 1.0:
            before_top_p = reference_warp(row, SamplingConfig(sampling.temperature, sampling.top_k))
            ordered = torch.sort(before_top_p, descending=True).values
            if (ordered.cumsum(0) - sampling.top_p).abs().min() < 1e-4:
                continue
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
        checked += 1
    assert checked >= 50


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(),
        SamplingConfig(temperature=0.3),
        SamplingConfig(temperature=1.7, top_k=9),
        SamplingConfig(temperature=1.0, top_p=0.6),
        SamplingConfig(temperature=0.8, top_k=20, top_p=0.95),
    ],
)
def test_rows_are_fp32_distributions_summing_to_one(dtype, sampling):
    logits = random_logits(3, 4, 259, seed=4, scale=8.0).to(dtype)
    logits[0, 0, :100] = float("-inf")  # masked entries stay at zero mass
    probs = warp(logits, sampling)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(3, 4), atol=1e-5, rtol=0)
    assert (probs[0, 0, :100] == 0).all()


def test_tiny_temperature_still_gives_a_distribution():
    probs = warp(torch.tensor([3.0, 1.0, -2.0, 0.5]), SamplingConfig(temperature=1e-40))
    assert torch.isfinite(probs).all()


@pytest.mark.parametrize("top_p", [1e-40, 1e-46, 5e-324])
@pytest.mark.parametrize("flush", [False, True])
def test_a_top_p_that_fp32_rounds_to_zero_keeps_the_top_token(top_p, flush):
    """A top_p below fp32's smallest normal (flushed to 0 on the engine thread) or below its
    smallest subnormal used to drop every token: 0/0, and torch.multinomial failed for the
    whole batch. The nucleus is the top token."""
    flushing = (torch.tensor([1e-38]) * 0.5).item() == 0.0  # the thread's flag as it was (load_pair sets it)
    torch.set_flush_denormal(False)
    try:
        sampling = SamplingConfig(temperature=1.0, top_p=top_p)  # checked unflushed: DAZ reads 5e-324 as 0
        logits = random_logits(3, VOCAB, seed=2)
        torch.set_flush_denormal(flush)
        probs = warp(logits, sampling)
    finally:
        torch.set_flush_denormal(flushing)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs, torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float())


# -- draws -----------------------------------------------------------------------------------


def test_same_seed_same_draws_and_no_global_rng():
    probs = warp(random_logits(1000, VOCAB, seed=5), SamplingConfig(temperature=1.0))
    state = torch.random.get_rng_state()
    first = sample(probs, make_generator(123))
    assert torch.equal(sample(probs, make_generator(123)), first)
    assert not torch.equal(sample(probs, make_generator(124)), first)
    tokens, _ = choose(
        random_logits(1000, VOCAB, seed=5), SamplingConfig(temperature=1.0), make_generator(123)
    )
    assert torch.equal(tokens, first)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG was never touched


def test_unseeded_generators_differ():
    a = torch.rand(1000, generator=make_generator(None))
    b = torch.rand(1000, generator=make_generator(None))
    assert not torch.equal(a, b)


def test_sample_shapes():
    probs = warp(random_logits(2, 3, VOCAB, seed=6), SamplingConfig(temperature=1.0))
    tokens = sample(probs, make_generator(0))
    assert tokens.shape == (2, 3) and tokens.dtype == torch.int64
    assert sample(probs[0, 0], make_generator(0)).shape == ()


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=0.7),
        SamplingConfig(temperature=1.0, top_k=5),
        SamplingConfig(temperature=1.2, top_p=0.7),
    ],
)
def test_choose_returns_the_exact_distribution_it_drew_from(sampling):
    logits = random_logits(500, VOCAB, seed=7)
    tokens, probs = choose(logits, sampling, make_generator(9))
    assert torch.equal(probs, warp(logits, sampling))
    # the very same draws come from sampling those probs with the same generator stream
    assert torch.equal(tokens, sample(probs, make_generator(9)))
    assert (probs.gather(-1, tokens.unsqueeze(-1)) > 0).all()


def test_choose_greedy_is_argmax_without_a_distribution():
    logits = random_logits(4, VOCAB, seed=8)
    tokens, probs = choose(logits, SamplingConfig(), None)
    assert probs is None
    assert torch.equal(tokens, logits.argmax(dim=-1))


@pytest.mark.statistical
def test_sample_frequencies_match_probs():
    """200k draws from one warped row (top-k 8) fit its probs; fails by chance with p = 1e-4.

    Control: the same draws tested against the law at temperature 1.0 instead of 0.9 fail.
    """
    logits = distinct_logits(12, seed=10) * 0.5
    probs = warp(logits, SamplingConfig(temperature=0.9, top_k=8))
    draws = sample(probs.expand(200_000, -1), make_generator(11))
    counts = torch.bincount(draws, minlength=12).double()
    support = probs > 0
    assert counts[~support].sum() == 0

    def pvalue(law: torch.Tensor) -> float:
        expected = law[support].double()
        expected = expected / expected.sum() * 200_000
        return stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue

    assert pvalue(probs) > 1e-4, f"p-value {pvalue(probs):.3g}"
    control = pvalue(warp(logits, SamplingConfig(temperature=1.0, top_k=8)))
    assert control < 1e-4, f"control p-value {control:.3g}"


def test_top_k_keeps_exactly_k_even_with_ties():
    logits = torch.tensor([1.0, 2.0, 2.0, 2.0, 0.5]).to(torch.bfloat16)
    probs = warp(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert int((probs > 0).sum()) == 2
