"""Bench summaries: medians over repeats, each prompt's speed-up over plain, geometric means
per method and category, pooled acceptance, and greedy exactness against plain."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from functools import reduce

from specgen.bench.prompts import ALL
from specgen.decoding.stats import Stats, histogram, rate

PLAIN = "plain"
BOUND = 0.97  # the floor's goal: no prompt below this speed-up against plain decoding


@dataclass
class PromptResult:
    """One prompt and one method: medians over repeats, and how it compares with plain."""

    prompt_id: str
    category: str
    method: str
    repeats: int
    new_tokens: int  # first repeat
    wall_tokens_per_second: float  # median
    seconds: float  # median
    ttft_seconds: float | None  # median
    speedup: float | None  # this median tok/s over plain's median tok/s on the same prompt
    identical_to_plain: bool | None  # greedy only: first-repeat ids equal plain's
    first_mismatch: int | None  # index of the first differing token, when not identical
    # each repeat's tok/s over plain's in the same repeat (empty for plain itself)
    speedups: list[float] = field(default_factory=list)


@dataclass
class Noise:
    """This machine's noise, measured: each prompt's plain tok/s in one repeat over its tok/s in
    the repeat before. Both runs decode the same text the same way, so their ratio is how far a
    single run's speed-up strays by chance. A method below `bound` in every repeat of a prompt
    loses there; one below it in some repeats may only have met this noise."""

    pairs: int
    share_below: float  # of the ratios, below `bound`
    low: float  # their 5th percentile
    high: float  # their 95th percentile
    bound: float = BOUND


@dataclass
class GroupSummary:
    """One method over one category (or `all`)."""

    method: str
    category: str
    prompts: int
    wall_tokens_per_second: float | None  # geometric mean of per-prompt medians
    speedup: float | None  # geometric mean of per-prompt speed-ups
    speedup_min: float | None
    speedup_max: float | None
    acceptance_rate: float | None  # pooled: accepted / drafted over every run
    tokens_per_target_forward: float | None  # pooled: new tokens / target forwards
    ttft_seconds: float | None  # median of per-prompt medians
    draft_seconds: float | None  # summed over every run
    verify_seconds: float | None
    accepted_length_histogram: dict[str, int] | None
    identical: int | None  # prompts identical to plain (greedy only)
    compared: int
    peak_memory_bytes: int | None
    # of the rounds that drafted, the share whose i-th draft token was accepted (i = 1, 2, ...)
    acceptance_per_position: list[float] | None = None
    # a draft step's cost in target steps: draft seconds per drafted token over plain's seconds
    # per target forward on the same prompts (an EAGLE-3 head's goal: under 0.08), the first round
    # a draft model drafted left out: its time is mostly the draft's read of the prompt
    draft_step: float | None = None


def per_position(pooled: Counter) -> list[float] | None:
    """From an accepted-length histogram (accepted -> rounds): position i's acceptance."""
    rounds = sum(pooled.values())
    if not rounds:
        return None
    longest = max(1, *(int(k) for k in pooled))  # rounds that drafted but accepted nothing: position 1 at 0%
    return [
        round(sum(n for k, n in pooled.items() if int(k) >= i) / rounds, 4) for i in range(1, longest + 1)
    ]


def geometric_mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    if not values or any(v <= 0 for v in values):
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def per_prompt(measurements: list, greedy: bool) -> list[PromptResult]:
    groups: dict[tuple[str, str], list] = {}
    for m in measurements:
        groups.setdefault((m.prompt_id, m.method), []).append(m)
    results = []
    for (prompt_id, method), runs in groups.items():
        runs.sort(key=lambda m: m.repeat)
        plain = sorted(groups.get((prompt_id, PLAIN), []), key=lambda m: m.repeat)
        tps = statistics.median(m.wall_tokens_per_second for m in runs)
        plain_tps = statistics.median(m.wall_tokens_per_second for m in plain) if plain else None
        identical = mismatch = None  # plain is the reference: it is compared with nothing
        beside = {m.repeat: m.wall_tokens_per_second for m in plain}
        paired = [
            rate(m.wall_tokens_per_second, beside[m.repeat])
            for m in runs
            if method != PLAIN and beside.get(m.repeat)
        ]
        if greedy and plain and method != PLAIN:
            mismatch = _first_mismatch(runs[0].token_ids, plain[0].token_ids)
            identical = mismatch is None
        results.append(
            PromptResult(
                prompt_id,
                runs[0].category,
                method,
                len(runs),
                runs[0].new_tokens,
                tps,
                statistics.median(m.seconds for m in runs),
                _median([m.ttft_seconds for m in runs]),
                rate(tps, plain_tps),
                identical,
                mismatch,
                paired,
            )
        )
    return results


def quantile(values: list[float], q: float) -> float:
    """The q-quantile, interpolated between the two nearest values (numpy's default): the p50 of
    two requests is their mean, not the slower one."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def noise(measurements) -> Noise | None:
    """Plain decoding against itself over the repeats of each prompt (None with fewer than two
    repeats). `measurements`: anything with method, prompt_id, repeat and wall_tokens_per_second."""
    speeds: dict[str, dict[int, float]] = {}
    for m in measurements:
        if m.method == PLAIN:
            speeds.setdefault(m.prompt_id, {})[m.repeat] = m.wall_tokens_per_second
    ratios = sorted(s[r] / s[r - 1] for s in speeds.values() for r in s if s.get(r - 1) and s[r] is not None)
    if not ratios:
        return None
    low, high = quantile(ratios, 0.05), quantile(ratios, 0.95)
    return Noise(len(ratios), sum(v < BOUND for v in ratios) / len(ratios), low, high)


def summarize(
    measurements: list, prompt_results: list[PromptResult], methods: list[str]
) -> list[GroupSummary]:
    """Per method: an `all` row, then one row per category (in order of first appearance)."""
    categories = list(dict.fromkeys(m.category for m in measurements))
    rows = []
    for method in methods:
        for category in [ALL] + categories:
            runs = [m for m in measurements if m.method == method and category in (ALL, m.category)]
            results = [r for r in prompt_results if r.method == method and category in (ALL, r.category)]
            if runs:
                plain = [m for m in measurements if m.method == PLAIN and category in (ALL, m.category)]
                rows.append(_group(method, category, runs, results, target_step(plain)))
    return rows


def target_step(plain_runs: list) -> float | None:
    """Plain decoding's seconds per target forward over these runs (its verify time: every
    forward after the prefill)."""
    seconds = [m.verify_seconds for m in plain_runs]
    forwards = [m.target_forwards for m in plain_runs]
    if not plain_runs or None in seconds or None in forwards:
        return None
    return rate(sum(seconds), sum(forwards))


def _group(
    method: str, category: str, runs: list, results: list[PromptResult], step: float | None = None
) -> GroupSummary:
    def total(attr):
        values = [getattr(m, attr) for m in runs]
        return None if any(v is None for v in values) else sum(values)

    drafted, forwards = total("drafted"), total("target_forwards")
    pooled_runs = reduce(Stats.merge, (m.measured for m in runs))  # the rates of every run together
    pooled: Counter | None = Counter()
    for m in runs:
        if m.accepted_length_histogram is None:
            pooled = None
            break
        pooled.update(m.accepted_length_histogram)
    speedups = [r.speedup for r in results if r.speedup is not None]
    compared = [r for r in results if r.identical_to_plain is not None]
    peaks = [m.peak_memory_bytes for m in runs if m.peak_memory_bytes is not None]
    return GroupSummary(
        method,
        category,
        len(results),
        geometric_mean([r.wall_tokens_per_second for r in results]),
        geometric_mean(speedups) if len(speedups) == len(results) else None,
        min(speedups, default=None),
        max(speedups, default=None),
        pooled_runs.acceptance if drafted is not None else None,
        pooled_runs.tokens_per_target_forward if forwards else None,
        _median([r.ttft_seconds for r in results]),
        total("draft_seconds"),
        total("verify_seconds"),
        None if pooled is None else histogram(pooled),
        sum(r.identical_to_plain for r in compared) if compared else None,
        len(compared),
        max(peaks) if peaks else None,
        None if pooled is None else per_position(pooled),
        _draft_step(total, drafted, step) if method != PLAIN else None,
    )


def _draft_step(total, drafted: int | None, step: float | None) -> float | None:
    """Seconds per drafted token in target steps, each generation's read round left out (None
    where a count is unknown). `total(name)`: the runs' sum of a field, None where one lacks it."""
    seconds, read, read_drafted = total("draft_seconds"), total("read_seconds"), total("read_drafted")
    if None in (seconds, read, drafted, read_drafted) or not step or drafted == read_drafted:
        return None
    return rate((seconds - read) / (drafted - read_drafted), step)


def noise_lines(noise: Noise | None, prompts: list[PromptResult], repeats: int) -> list[str]:
    """How far this run's per-prompt speed-ups can be read: plain against plain over the repeats,
    and the prompts a method lost in every repeat; with one repeat, a word that it cannot tell."""
    bound = BOUND
    compared = [p for p in prompts if p.speedup is not None]
    if noise is None:
        if any(p.speedup < bound for p in compared) and repeats < 2:
            return [
                f"one repeat: a speed-up below {bound:g}x may be this machine's noise (--repeats 3 tells)"
            ]
        return []
    lost = {}
    for p in compared:
        if len(p.speedups) > 1 and max(p.speedups) < bound:
            lost.setdefault(p.method, []).append(p.prompt_id)
    losses = "; ".join(f"{method} {_some(ids)}" for method, ids in lost.items()) or "none"
    return [
        f"noise: plain against plain, {noise.pairs} pairs of repeats: {noise.share_below:.0%} below "
        f"{bound:g}x, 5-95% {noise.low:.2f}-{noise.high:.2f}; below {bound:g}x in every repeat: {losses}"
    ]


def _some(names: list[str], shown: int = 6) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")
