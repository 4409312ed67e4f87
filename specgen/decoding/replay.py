"""Deterministic mode: keyed target choices and the fixed-shape replay of each window.

The committed output in this mode is a function of (prompt, settings, seed, weights,
hardware/software) only. Two pieces make it so:

* `keyed_choice`: the target's pick at absolute position t is argmax under greedy, and
  argmax(log q_t + Gumbel(seed, t, token)) under sampling, where the Gumbel noise comes from
  an integer hash of (seed, position, token id) computed elementwise. That is an exact draw
  from q_t (Gumbel-max), and it depends on nothing but q_t and the key, so the fast path and
  the replay agree exactly whenever their logits agree, and fast paths may verify drafts by
  matching against it (lossless: every committed token is an exact draw from q).
* `replay_window`: windows are aligned to absolute offsets from the prompt end
  [P + m*N, P + (m+1)*N). A replay crops the target cache to the window start - 1 (a prefix
  that is itself verified), runs ONE forward over [token before the window, u_a .. u_(a+N-2)]
  at the fixed shape (1, N), padding a partial window, and keeps the matching prefix plus
  the replay's own token at the first mismatch. The replay's KV overwrites the fast path's.
"""

from __future__ import annotations

import torch

from specgen.config import SamplingConfig
from specgen.decoding.sampling import warp

_MASK64 = (1 << 64) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic; shifts made logical by masking)."""
    x = x ^ ((x >> 30) & 0x3FFFFFFFF)
    x = x * -4658895280553007687  # 0xbf58476d1ce4e5b9 as a signed int64
    x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
    x = x * -7723592293110705685  # 0x94d049bb133111eb
    return x ^ ((x >> 31) & 0x1FFFFFFFF)


def keyed_uniforms(seed: int, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1) of shape [M, vocab], a pure function of (seed, position, token)."""
    device = positions.device
    token = torch.arange(vocab, device=device, dtype=torch.int64)
    key = _mix(
        positions.to(torch.int64).unsqueeze(1) * 0x9E3779B97F4A7C15 % (1 << 62)
        + _mix(torch.tensor(seed & 0x7FFFFFFFFFFFFFFF, device=device))
    )
    bits = _mix(key + token * 0x632BE59BD9B4E019 % (1 << 62))
    mantissa = (bits >> 11) & ((1 << 53) - 1)  # 53 random bits -> a double in [0, 1)
    return (mantissa.double() + 0.5) / float(1 << 53)


def keyed_choice(logits: torch.Tensor, positions: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The target's token for each row of logits [M, V] at absolute `positions` [M]."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    probs = warp(logits, sampling).double()
    gumbel = -torch.log(-torch.log(keyed_uniforms(sampling.seed or 0, positions, probs.shape[-1])))
    return (probs.log() + gumbel).argmax(dim=-1)


def window_start(verified: int, prompt_length: int, window: int) -> int:
    """Start of the aligned window that holds the first unverified position."""
    return prompt_length + ((verified - prompt_length) // window) * window


def replay_tokens(
    forward,
    cache,
    ids: list[int],
    start: int,
    window: int,
    sampling: SamplingConfig,
    device,
    pad_id: int,
    vocab: int | None,
) -> list[int]:
    """Run the fixed-shape forward for the window at `start`; return the replay's N tokens.

    The cache must hold exactly positions [0, start - 1) on entry; on return it also holds
    the replay's KV for positions [start - 1, start + window - 1) (padding included, for the
    caller to crop).
    """
    chunk = ids[start - 1 : start - 1 + window]
    chunk = chunk + [pad_id] * (window - len(chunk))
    logits = forward(cache, torch.tensor([chunk], device=device))[0, :, :vocab]
    positions = torch.arange(start, start + window, device=logits.device)
    return keyed_choice(logits, positions, sampling).tolist()
