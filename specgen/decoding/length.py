"""How many tokens to draft each round: per-round policies and the confidence stop (`unsure`).

**Policies** (`--draft-schedule`): `next_k()` before a round and `update(proposed, accepted)`
after it, with the number of draft tokens the drafter actually proposed and how many the
target's rule accepted (before any EOS / length cut: that is what says how good the drafter is).
Adapting k is safe: k is chosen from past rounds only, before the round's draft exists, and each
draft position is verified by the usual rule; the output law (and greedy output) is the same
for every k, only the speed changes. A round with k drafts costs about 1 + c*k target forwards
(c = one draft token's cost relative to a target forward, plus the marginal cost of verifying
one more token) and emits sum_{i=0..k} a^i tokens on average when each token is accepted with
probability a (Leviathan et al. 2023): drafting too little wastes target forwards on easy text,
drafting too much wastes draft forwards on tokens that follow a rejection.

The device's default k and the width caps come from measured costs: `costs.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specgen.config import Schedule


class LengthPolicy(Protocol):
    def next_k(self) -> int: ...

    def update(self, proposed: int, accepted: int) -> None: ...


def make_policy(schedule: Schedule, draft_tokens: int, cost: float = 0.37) -> LengthPolicy:
    """A fresh policy; `draft_tokens` is k for FIXED and the upper bound for the others.

    `cost` (ExpectedGainLength only): one draft token relative to a target forward (about a
    third for the default pair on a CPU, near 0 for prompt lookup, which only adds verification).
    """
    if schedule is Schedule.FIXED:  # bounds that meet: always k
        return AdditiveLength(start=draft_tokens, min=draft_tokens, max=draft_tokens)
    if schedule is Schedule.ADDITIVE:
        return AdditiveLength(start=min(4, draft_tokens), min=1, max=draft_tokens)
    return ExpectedGainLength(cost=cost, min=1, max=draft_tokens)


@dataclass
class AdditiveLength:
    """Grow by `grow` after a fully accepted round, drop to accepted + 1 after a rejection.

    The scheme transformers calls "heuristic" (there +2 / -1). Reacting to each round follows
    runs of easy text (code, quotes, loops) quickly and gives up after one bad round, which
    suits acceptance that comes in bursts; the price is noise: one unlucky rejection in easy
    text halves k for a few rounds. Rounds that proposed nothing (a lookup without a match)
    say nothing about the drafter and leave k alone; a fully accepted round that proposed
    fewer than k (a short proposal, or the end of the budget) does not grow it either, as k
    was not what limited it.

    With min = start = max it is the fixed length (`--draft-schedule fixed`, the default): always
    k, the baseline, and what `--draft-tokens N` means.
    """

    start: int = 4
    min: int = 1
    max: int = 8
    grow: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.start <= self.max:
            raise ValueError(f"need 1 <= min <= start <= max, got {self.min}, {self.start}, {self.max}")
        self.k = self.start

    def next_k(self) -> int:
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        if accepted >= proposed:
            if proposed >= self.k:
                self.k = min(self.max, self.k + self.grow)
        else:
            self.k = max(self.min, min(self.k, accepted + 1))


class Acceptance:
    """A per-token acceptance estimate from runs of proposed tokens: a run that had j of its
    tokens accepted adds j successes and, if it stopped at a rejection, one failure (the
    maximum-likelihood estimate for a geometric run length cut off at the run's end), with an
    exponential forgetting over `halflife` runs, prior included."""

    def __init__(self, halflife: float, successes: float, failures: float):
        self.successes, self.failures = successes, failures
        self._decay = 0.5 ** (1.0 / halflife)

    @property
    def value(self) -> float:
        return self.successes / (self.successes + self.failures)

    def update(self, proposed: int, accepted: int) -> None:
        self.successes = self.successes * self._decay + accepted
        self.failures = self.failures * self._decay + (1.0 if accepted < proposed else 0.0)


@dataclass
class ExpectedGainLength:
    """Pick the k that maximises expected tokens per unit of cost, from an acceptance estimate.

    The per-token acceptance a is estimated from recent rounds: a round that accepted j of
    its proposed tokens contributes j successes and, if it stopped at a rejection, one
    failure (the maximum-likelihood estimate for a geometric run length cut off at k), with
    an exponential forgetting of `halflife` rounds and a weak prior. Then
        k = argmax_k  sum_{i=0..k} a^i / (1 + cost * k),   min <= k <= max.
    This is steadier than AdditiveLength (one rejection moves it little) and knows what a
    draft token costs, but it assumes acceptances are independent; real ones come in runs,
    which AdditiveLength follows faster.
    """

    cost: float = 0.37
    min: int = 1
    max: int = 8
    halflife: float = 8.0
    prior_accepted: float = 3.0  # a prior worth a = 0.75 from 4 token trials
    prior_rejections: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.max or self.cost < 0 or self.halflife <= 0:
            raise ValueError("need 1 <= min <= max, cost >= 0 and halflife > 0")
        self.estimate = Acceptance(self.halflife, self.prior_accepted, self.prior_rejections)
        self.k = self._best_k()

    @property
    def acceptance(self) -> float:
        return self.estimate.value

    def next_k(self) -> int:
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.estimate.update(proposed, accepted)
        self.k = self._best_k()

    def _best_k(self) -> int:
        a = self.acceptance
        expected, power = 1.0, 1.0  # sum_{i=0..k} a^i, running
        best_k, best = self.min, float("-inf")
        for k in range(1, self.max + 1):
            power *= a
            expected += power
            gain = expected / (1.0 + self.cost * k)
            if k >= self.min and gain > best:  # ties keep the shorter draft
                best_k, best = k, gain
        return best_k


def unsure(
    threshold: float,
    logits: torch.Tensor,
    probs: torch.Tensor | None = None,
    reach: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The confidence stop: whether the chance that the draft is still right after this token
    falls under `threshold`, so drafting stops after it (a drafter's `confidence`; 0 stops nothing).

    That chance, `reach`, is the product of the draft's own top probabilities over the round's
    tokens so far: the i-th token is worth a draft step only if the i - 1 before it are accepted
    too, so a run of 0.6s stops after two (0.36 < 0.5), not at the round's end, and a run of
    0.95s goes on for as long as a per-token threshold would. (A per-token threshold, the first
    version, kept drafting text the draft was lukewarm about: chats and translations paid
    for tokens past the first rejection; benchmarks/floor.md.)

    Call it once per draft step on what the drafter already has: the step's logits [..., V],
    its warped distribution when it sampled (`choose` returns it), else None (greedy: the warped
    law is a one-hot, so the confidence is read from softmax(logits) instead), and the `reach`
    it returned the step before (None at a round's first step). Returns (stop, reach): a bool
    tensor [...] on the logits' device, True = stop after this token, and the new reach.

    Lossless: the decision depends on p_1..p_i (functions of the prefix), and the token x_i
    that was just drawn is kept, never dropped because of its value; so every proposed x_i is
    still distributed as the p_i reported for it, and the acceptance rule stays exact. (What
    would NOT be safe: drawing x_i and then discarding it because p_i(x_i) was low.)

    Cost: reading the flag (`bool(flag)`) is one small host sync per draft step. On CPU that
    is free; on CUDA it makes the host wait for each step's kernels before it can launch the
    next, so the launch latency of every draft step is no longer hidden (use it with a
    captured CUDA graph for the draft step, or check every other step). The alternative with
    no extra sync keeps drafting k tokens, stacks the flags, and cuts the proposal after the
    first True in the round's single sync: that saves verification work but not the draft
    forwards, which is where the time goes here.
    """
    if probs is not None:
        top = probs.amax(dim=-1)
    else:
        logits = logits.float()
        top = (logits.amax(dim=-1) - logits.logsumexp(dim=-1)).exp()
    reach = top if reach is None else reach * top
    return reach < threshold, reach


class ChainStops:
    """The confidence stop over a batch's chains, step by step (`unsure` per step): where each
    row's draft ends. A row's draft is at most its k; with a stop it ends after the first token
    whose reach fell under the stop. Rows with k = 0, or `out` (sitting the round out), are done
    from the start; the drafter stops stepping once every row is done (`after`)."""

    def __init__(self, threshold: float, ks: list[int], out: list[bool] | None = None):
        self.threshold = threshold
        self.ends = [0 if out is not None and out[i] else k for i, k in enumerate(ks)]
        self.reach: torch.Tensor | None = None

    def after(self, step: int, logits: torch.Tensor, law: torch.Tensor | None) -> bool:
        """Step `step` (from 0) drafted its tokens from `logits` [rows, V] (`law` when sampled):
        whether every row is done, so no further step runs. One small host sync per step where
        the stop is on; none where it is off (the rows' k alone decide). A reach only falls, so a
        row's first stop is its end."""
        if self.threshold > 0:
            stop, self.reach = unsure(self.threshold, logits, law, self.reach)
            self.ends = [min(end, step + 1) if flag else end for end, flag in zip(self.ends, stop.tolist())]
        return all(end <= step + 1 for end in self.ends)


def level_stop(
    threshold: float,
    frontier: list[int],
    parents: list[int],
    logits: torch.Tensor,
    probs: torch.Tensor | None,
    reach: torch.Tensor | None,
) -> tuple[torch.Tensor, bool]:
    """The confidence stop over a tree, level by level (`unsure`): the `frontier`'s nodes drew
    children (each child's parent node in `parents`) from their laws (`logits` [F, V], `probs`
    when sampled); each child's reach is its parent's (`reach` [F], None at the root) times the
    top probability of the law it came from. Returns (the children's reach, whether the tree grows
    no deeper: every child's reach is under the stop). The decision reads the frontier's laws
    only, never the children drawn from them, so each node's children are still draws of the law
    reported for it (ALGORITHMS.md section 5). One host sync per level."""
    _, per_parent = unsure(threshold, logits, probs, reach)
    index = {node: i for i, node in enumerate(frontier)}
    reach = per_parent[torch.tensor([index[p] for p in parents], device=per_parent.device)]
    return reach, bool(reach.max() < threshold)
