"""Named acceptance rules for a chain of draft tokens.

Notation (ALGORITHMS.md): p = draft distribution, q = target distribution, both warped.
Each rule takes the draft tokens x1..xk, what the draft reported for them, and the target's
q0..qk from one forward over [root, x1..xk]; it returns how many draft tokens are accepted and
the one token the target contributes (the correction at the first rejection, or the bonus).
Results stay on the device as 0-dim tensors so the engine can read everything in one sync.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ProposalKind(enum.Enum):
    """What a drafter's tokens are, which decides the acceptance rule."""

    SAMPLED = "sampled"  # drawn from the reported distribution p
    DETERMINISTIC = "deterministic"  # point masses: argmax drafts, lookup, scripted drafters


class Rule(enum.Enum):
    GREEDY_MATCH = "greedy-match"
    SPECULATIVE_SAMPLING = "speculative-sampling"
    POINT_MASS_SAMPLING = "point-mass-sampling"


def select_rule(greedy: bool, kind: ProposalKind) -> Rule:
    """The rule follows from the sampling settings and the proposal kind, never from a None."""
    if greedy:
        return Rule.GREEDY_MATCH
    if kind is ProposalKind.SAMPLED:
        return Rule.SPECULATIVE_SAMPLING
    return Rule.POINT_MASS_SAMPLING


@dataclass(frozen=True)
class Verdict:
    accepted: torch.Tensor  # 0-dim int64: number of draft tokens accepted
    token: torch.Tensor  # 0-dim int64: the target's own token after them


def greedy_match(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Accept the longest prefix with x_i == argmax q_(i-1); then argmax q at the stop."""
    # draft_tokens: [k]; target_logits: [k+1, V]
    target_choice = target_logits.argmax(dim=-1)  # [k+1]
    k = draft_tokens.shape[0]
    matches = (draft_tokens == target_choice[:k]).to(torch.int64)
    accepted = matches.cumprod(dim=0).sum()
    return Verdict(accepted, target_choice[accepted])


def speculative_sampling(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                         target_probs: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """Leviathan/Chen rule: accept x_i w.p. min(1, q(x_i)/p(x_i)); residual norm(max(0, q - p)).

    draft_probs [k, V] is the exact distribution each x_i was drawn from, or None for point
    masses (p = one-hot on x_i). target_probs [k+1, V]. Always consumes k uniforms and one
    categorical draw, so the generator's stream does not depend on the outcome.
    """
    k, vocab = draft_tokens.shape[0], target_probs.shape[-1]
    device = target_probs.device
    rows = torch.arange(k, device=device)
    q_x = target_probs[rows, draft_tokens]
    p_x = draft_probs[rows, draft_tokens] if draft_probs is not None else torch.ones_like(q_x)
    uniforms = torch.rand(k, generator=generator, device=device)
    accept = (uniforms * p_x < q_x).to(torch.int64)  # u < q/p without dividing
    accepted = accept.cumprod(dim=0).sum()

    # The residual row at the stop: q_a - p_a, where p_k (after full acceptance) is zero.
    stop = accepted.view(1)
    q_row = target_probs.index_select(0, stop)[0]
    if draft_probs is not None:
        padded = torch.cat([draft_probs, draft_probs.new_zeros(1, vocab)])
        p_row = padded.index_select(0, stop)[0]
    else:
        padded_tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(1)])
        p_row = torch.zeros(vocab, device=device)
        p_row.scatter_(0, padded_tokens.index_select(0, stop), (stop < k).to(p_row.dtype))
    residual = (q_row - p_row).clamp_min(0.0)
    total = residual.sum()
    # sum(r) == 0 only through rounding (q == p on the support): fall back to q itself.
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), q_row)
    token = torch.multinomial(residual, 1, generator=generator)[0]
    return Verdict(accepted, token)
