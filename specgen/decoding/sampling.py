"""The one warp function and the random draws built on it.

Every distribution the acceptance rules see comes from `warp`, applied identically to the
draft and the target: temperature, then top-k, then top-p, renormalised in fp32. Greedy
(temperature 0) is a one-hot distribution on the argmax. Every draw takes an explicit
`torch.Generator`; nothing here touches the global RNG.
"""

from __future__ import annotations

import torch

from specgen.config import SamplingConfig


def warp(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] in fp32 after temperature, top-k and top-p."""
    logits = logits.float()
    if sampling.greedy:
        one_hot = torch.zeros_like(logits)
        return one_hot.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    # shift by the max before dividing, so a tiny temperature cannot overflow to inf; and keep
    # the divisor a normal float (subnormals are flushed to zero once flush-denormal is on)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / max(sampling.temperature, 1e-30)
    vocab = logits.shape[-1]
    if 0 < sampling.top_k < vocab:
        # exactly k tokens, even with ties at the k-th value (common in bf16)
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep.scatter_(-1, torch.topk(logits, sampling.top_k, dim=-1).indices, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep a token if the mass strictly before it is < top_p; the top token always stays,
        # even for a top_p that fp32 rounds to 0 (below 1.4e-45, or subnormal and flushed)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= sampling.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of probs [..., V] -> [...] (int64)."""
    flat = probs.reshape(-1, probs.shape[-1])
    drawn = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return drawn.reshape(probs.shape[:-1])


def choose(
    logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick the next token(s) from logits [..., V].

    Returns (tokens [...], probs [..., V] or None): greedy takes the argmax and needs no
    distribution; sampling returns the exact warped distribution the tokens were drawn from.
    """
    if sampling.greedy:
        return logits.argmax(dim=-1), None
    probs = warp(logits, sampling)
    return sample(probs, generator), probs


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device`, seeded from `seed` (or from fresh entropy when None)."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def on_device(generator: torch.Generator | None, device: torch.device) -> torch.Generator | None:
    """A generator for draws on `device`: `generator` itself when it lives there, else a new one
    seeded from one draw of it (a draft on another device than the target)."""
    if generator is None or generator.device == torch.device(device):
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    return make_generator(seed, device)


def gumbel(shape, generator: torch.Generator | None, device) -> torch.Tensor:
    """Standard Gumbel(0, 1) noise."""
    uniform = torch.rand(shape, generator=generator, device=device)
    return -torch.log(-torch.log(uniform.clamp(1e-20, 1.0 - 1e-7)))


def gumbel_top_k(
    probs: torch.Tensor, k: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """k draws without replacement from each row of probs [M, V], in draw order.

    Keys log p + Gumbel; the top-k keys in descending order are a sample without replacement
    (Kool et al. 2019). Returns (tokens [M, k], keys [M, k]).
    """
    keys = probs.log() + gumbel(probs.shape, generator, probs.device)
    top = torch.topk(keys, k, dim=-1)
    return top.indices, top.values


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, stable at both ends."""
    return torch.where(x > -0.6931, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
