"""How many tokens to draft: per-round policies, a confidence stop, and the device default.

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

**The device default** (`--draft-tokens device`, `choose`): a chain round at draft length k
costs k draft steps plus one target forward over k+1 tokens. Where a draft step is cheap next
to the target and a wide verify costs about what a single step does (a GPU), long drafts win;
where the draft costs a third of the target (the default pair on a CPU) short ones do.
`choose` times the three forwards once on a short context (in turn, REPEATS times, a few
seconds), picks the k in 1..MAX_K with the best expected tokens per unit of time at the
typical acceptance `ACCEPTANCE`, and caches the answer per machine, thread count and model pair
in `$SPECGEN_CACHE/draft-length.json`; an entry that does not validate is measured again. A
draft on the CPU also gets a confidence stop (STOP) and STOP_EXTRA more tokens of room.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from specgen.config import Schedule
from specgen.models.cache import cache_root, locked, write_text
from specgen.models.placement import cpu_flags, cpu_name
from specgen.runtime import kvcache
from specgen.runtime.lean import call_for
from specgen.status import note


class LengthPolicy(Protocol):
    def next_k(self) -> int: ...

    def update(self, proposed: int, accepted: int) -> None: ...


def make_policy(schedule: Schedule, draft_tokens: int, cost: float = 0.37) -> LengthPolicy:
    """A fresh policy; `draft_tokens` is k for FIXED and the upper bound for the others.

    `cost` (ExpectedGainLength only): one draft token relative to a target forward (about a
    third for the default pair on a CPU, near 0 for prompt lookup, which only adds verification).
    """
    if schedule is Schedule.FIXED:
        return FixedLength(draft_tokens)
    if schedule is Schedule.ADDITIVE:
        return AdditiveLength(start=min(4, draft_tokens), min=1, max=draft_tokens)
    return ExpectedGainLength(cost=cost, min=1, max=draft_tokens)


@dataclass
class FixedLength:
    """Always k: the baseline, and what `--draft-tokens N` means."""

    k: int = 4

    def next_k(self) -> int:
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        pass


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
        self.successes = self.prior_accepted
        self.failures = self.prior_rejections
        self._decay = 0.5 ** (1.0 / self.halflife)
        self.k = self._best_k()

    @property
    def acceptance(self) -> float:
        return self.successes / (self.successes + self.failures)

    def next_k(self) -> int:
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.successes = self.successes * self._decay + accepted
        self.failures = self.failures * self._decay + (1.0 if accepted < proposed else 0.0)
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


@dataclass(frozen=True)
class ConfidenceStop:
    """Stop drafting once the draft's own top probability falls under `threshold`.

    Call it once per draft step on what the drafter already has: the step's logits [..., V],
    and its warped distribution when it sampled (`choose` returns it), else None (greedy:
    the warped law is a one-hot, so the confidence is read from softmax(logits) instead).
    Returns a bool tensor [...] on the logits' device, True = stop after this token.

    Lossless: the decision depends on p_i (a function of the prefix x_<i), and the token x_i
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

    threshold: float = 0.4

    def __call__(self, logits: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
        if probs is not None:
            top = probs.amax(dim=-1)
        else:
            logits = logits.float()
            top = (logits.amax(dim=-1) - logits.logsumexp(dim=-1)).exp()
        return top < self.threshold


# per-token acceptance of the default pair on the quick set, fitted to tokens per round at
# k = 1..3 (benchmarks/README.md); the accepted share per drafted token understates it, as
# acceptances come in runs.
ACCEPTANCE = 0.85
FORMAT = 6  # bump when the engine's forwards change cost (cached choices are then measured again)
MAX_K = 6
GPU_K = 4
REPEATS = 7  # turns of the three timed forwards
# A draft on the CPU stops early when its top probability falls below STOP (ConfidenceStop),
# and may then run STOP_EXTRA tokens past the cost model's k: confident runs go on, unsure
# tokens are not drafted (the variants compared: benchmarks/README.md). On a GPU the stop would
# add a host sync per draft step, so it stays off there.
STOP, STOP_EXTRA = 0.5, 2


@dataclass(frozen=True)
class Choice:
    k: int
    reason: str
    confidence: float = 0.0  # the draft confidence stop that goes with k (0: none)


def expected_rate(k: int, draft_cost: float, verify_cost: dict[int, float], acceptance: float = ACCEPTANCE) -> float:
    """Expected tokens per target-step time at draft length k (costs relative to one target step)."""
    tokens = (1 - acceptance ** (k + 1)) / (1 - acceptance)
    return tokens / (k * draft_cost + verify_cost[k + 1])


def best_k(draft_cost: float, verify_cost: dict[int, float], acceptance: float = ACCEPTANCE) -> int:
    return max(range(1, MAX_K + 1), key=lambda k: (expected_rate(k, draft_cost, verify_cost, acceptance), -k))


def _interpolate(one: float, wide: float, width: int) -> dict[int, float]:
    """Verify cost at 1..MAX_K+1 tokens from costs measured at 1 and `width` tokens (linear)."""
    slope = (wide - one) / (width - 1)
    return {n: 1.0 + slope * (n - 1) / one for n in range(1, MAX_K + 2)}


class _Probe:
    """One model's forward of `width` tokens per row over `rows` short cached contexts, timed on
    demand; `keep` logits per row, as the loop asks (a verify reads every position's)."""

    def __init__(self, model, width: int, context: int = 32, exact: bool = True, rows: int = 1, keep: int = 1):
        self.call = call_for(model, exact)  # what the decode loop calls
        self.device = next(model.parameters()).device
        vocab = model.get_input_embeddings().num_embeddings
        self.cache, self.context, self.keep = kvcache.new_cache(model, rows=rows), context, keep
        prompt = (torch.arange(100, 100 + context, device=self.device) % vocab)[None].expand(rows, context)
        kvcache.forward(self.call, self.cache, prompt, keep=1)
        self.tokens = (torch.arange(300, 300 + width, device=self.device) % vocab)[None].expand(rows, width)
        self.seconds()  # the first forward warms up

    def seconds(self) -> float:
        started = time.perf_counter()
        kvcache.forward(self.call, self.cache, self.tokens, keep=self.keep)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - started
        kvcache.crop(self.cache, self.context)
        return elapsed


def _ratios(pair, repeats: int = REPEATS) -> tuple[float, float]:
    """(draft step, 5-token verify) in target steps: the three forwards are timed in turn,
    `repeats` times, and the medians of the per-turn ratios are kept, so a machine whose speed
    drifts between forwards (shared CPUs do) moves all three together."""
    step, wide = _Probe(pair.target.model, 1), _Probe(pair.target.model, 5)
    draft = _Probe(pair.draft.model, 1, exact=False)
    draft_ratio, wide_ratio = [], []
    for _ in range(repeats):
        one, five, small = step.seconds(), wide.seconds(), draft.seconds()
        one = (one + step.seconds()) / 2  # the target step around the others
        draft_ratio.append(small / one)
        wide_ratio.append(five / one)
    return statistics.median(draft_ratio), statistics.median(wide_ratio)


def _key(pair) -> str:
    return " | ".join([f"v{FORMAT}", cpu_name(), ",".join(sorted(cpu_flags() or ())), str(torch.get_num_threads()),
                       f"{pair.target.name}:{pair.target.dtype}:{pair.target.weights}",
                       f"{pair.draft.name}:{pair.draft.dtype}:{pair.draft.weights}"])


def choose(pair) -> Choice:
    """k for chain-style methods on this pair and device (measured once, then cached)."""
    if pair.draft is None:
        return Choice(GPU_K, "no draft model")
    if pair.target.device.type == "cuda" and pair.draft.device.type == "cuda":
        return Choice(GPU_K, "GPU: a wide verify costs about one step")
    path, key = cache_root() / "draft-length.json", _key(pair)
    known = _read(path)
    if key in known:
        chosen = _entry(known[key])
        if chosen is not None:
            return chosen
        note(f"specgen: the draft length cached in {path} is not valid; measuring it again")
    chosen = _measure(pair)
    try:
        with locked("draft-length"):  # read, change one entry, write: other processes keep theirs
            known = _read(path)
            known[key] = {"k": chosen.k, "reason": chosen.reason, "confidence": chosen.confidence}
            write_text(path, json.dumps(known, indent=1))
    except OSError:
        pass  # an unwritable cache only means measuring again next time
    return chosen


def _measure(pair) -> Choice:
    with torch.inference_mode():
        draft, wide = _ratios(pair)
    k = best_k(draft, _interpolate(1.0, wide, 5))
    reason = (f"measured: draft step {draft:.2f} of a target step, 5-token verify "
              f"{wide:.2f} steps; best at {ACCEPTANCE:.0%} acceptance")
    confidence = 0.0
    if pair.draft.device.type == "cpu":
        k, confidence = min(MAX_K, k + STOP_EXTRA), STOP
        reason += f"; up to {STOP_EXTRA} more while the draft's top probability stays at {STOP} or above"
    return Choice(k, reason, confidence)


def _read(path) -> dict:
    """The cache file's entries; an unreadable or foreign file counts as empty (measured again)."""
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _entry(entry) -> Choice | None:
    """A cached entry, if it is one this version wrote: k an integer in 1..MAX_K, confidence a
    number in [0, 1), reason text. Anything else (a hand edit, another version) is None."""
    if not isinstance(entry, dict):
        return None
    k, confidence, reason = entry.get("k"), entry.get("confidence", 0.0), entry.get("reason", "measured earlier")
    if type(k) is not int or not 1 <= k <= MAX_K:
        return None
    if type(confidence) not in (int, float) or not 0.0 <= confidence < 1.0 or not isinstance(reason, str):
        return None
    return Choice(k, reason, float(confidence))


# -- how many tokens to draft at a batch width -----------------------------------------------------
WIDTH_ROWS = (1, 4, 16)  # batch widths measured; others are interpolated (and extrapolated past 16)
WIDTH_REPEATS = 3
WIDTH_MARGIN = 0.1  # the expected gain over plain rounds below which a batch does not draft


@dataclass(frozen=True)
class WidthCosts:
    """Measured forward costs at the batch widths of WIDTH_ROWS, relative to one single-row
    target step: a target verify of 1 and of 5 tokens per row, and a draft step."""

    verify_one: dict[int, float]  # rows -> cost
    verify_five: dict[int, float]
    draft: dict[int, float]

    def cap(self, width: int, k_max: int = MAX_K + STOP_EXTRA, acceptance: float = ACCEPTANCE) -> int:
        """The draft length with the best expected throughput at `width` rows; 0 unless drafting
        promises WIDTH_MARGIN more than plain rounds (a verify of width x (k+1) tokens is no
        longer memory-bound). The margin covers what the model leaves out: per-round host work
        that grows with the width, and requests whose acceptance is below `acceptance`."""
        one, five, draft = (_at(table, width) for table in (self.verify_one, self.verify_five, self.draft))
        best_k, best = 0, width / one * (1 + WIDTH_MARGIN)
        for k in range(1, k_max + 1):
            tokens = (1 - acceptance ** (k + 1)) / (1 - acceptance)
            rate = width * tokens / (k * draft + one + (five - one) * k / 4)
            if rate > best:
                best_k, best = k, rate
        return best_k

    def as_dict(self) -> dict:
        return {name: {str(r): v for r, v in getattr(self, name).items()} for name in ("verify_one", "verify_five",
                                                                                       "draft")}


def _at(table: dict[int, float], rows: int) -> float:
    """The table's value at `rows`: linear between measured widths, extended past the last."""
    points = sorted(table)
    if len(points) == 1:
        return table[points[0]]
    low, high = points[0], points[1]
    for low, high in zip(points, points[1:]):
        if rows <= high:
            break
    return table[low] + (table[high] - table[low]) * (rows - low) / (high - low)


def width_costs(pair) -> WidthCosts:
    """The pair's costs at WIDTH_ROWS (measured once per machine and pair, then cached)."""
    path, key = cache_root() / "draft-length.json", "width " + _key(pair)
    entry = _read(path).get(key)
    try:
        costs = WidthCosts(*({int(r): float(v) for r, v in entry[name].items()}
                             for name in ("verify_one", "verify_five", "draft")))
        if all(v > 0 for table in (costs.verify_one, costs.verify_five, costs.draft) for v in table.values()):
            return costs
    except (TypeError, KeyError, ValueError, AttributeError):
        pass  # absent or not valid: measured (again)
    with torch.inference_mode():
        costs = _measure_widths(pair)
    try:
        with locked("draft-length"):
            known = _read(path)
            known[key] = costs.as_dict()
            write_text(path, json.dumps(known, indent=1))
    except OSError:
        pass
    return costs


def _measure_widths(pair) -> WidthCosts:
    base = _Probe(pair.target.model, 1)
    tables = ({}, {}, {})
    for rows in WIDTH_ROWS:
        probes = (_Probe(pair.target.model, 1, rows=rows, keep=0), _Probe(pair.target.model, 5, rows=rows, keep=0),
                  _Probe(pair.draft.model, 1, exact=False, rows=rows))
        ratios = ([], [], [])
        for _ in range(WIDTH_REPEATS):
            unit = base.seconds()
            for probe, out in zip(probes, ratios):
                out.append(probe.seconds() / unit)
        for table, out in zip(tables, ratios):
            table[rows] = statistics.median(out)
    return WidthCosts(*tables)
