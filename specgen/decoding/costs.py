"""How many tokens to draft on this device, from measured forward costs.

**The device default** (`--draft-tokens device`, `choose`): a chain round at draft length k
costs k draft steps plus one target forward over k+1 tokens. Where a draft step is cheap next
to the target and a wide verify costs about what a single step does (a GPU), long drafts win;
where the draft costs a third of the target (the default pair on a CPU) short ones do.
`choose` times six forwards once over about a request's cached tokens (a target step, a draft
step, and verifies of 2, 3, 5 and WIDE tokens, in turn: a few seconds; probes.py), picks the k
in 1..MAX_K with the best expected tokens per unit of time at the typical acceptance
`ACCEPTANCE`, and caches the answer per machine, thread count and model pair in
`$SPECGEN_CACHE/draft-length.json`; an entry that does not validate is measured again, with a
notice. The verifies' costs are kept with it (`VerifyCost`: the first proposed token's, the
second's, each one's after it up to a chain's longest, and each one's past that), for the floor
and lookup, and so is what the draft's reading of a prompt token costs (`read_price`: a draft
model reads a prompt before its first draft, and where that read costs more than drafting can
save over a request's tokens, the row does not draft with it: drafters/model.py). A draft on the
CPU also gets a confidence stop (`length.unsure`), priced by its measured cost (`stop_for`), and
STOP_EXTRA more tokens of room. An EAGLE-3 head is a draft like any other here: its step is the
head's own forward (probes.HeadProbe), and its stop is priced by that step's cost.

The server's cap on k at each batch width, measured the same way and cached in the same file,
is in `widths.py`.

The per-round policies that adapt k within these bounds are in `length.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import torch

from specgen.decoding.probes import WIDE, ratios
from specgen.files import cache_root, locked, write_text
from specgen.models.placement import cpu_flags, cpu_name
from specgen.models.vocabulary import Vocabulary
from specgen.runtime import int8
from specgen.status import note
from specgen.text import json_value

# per-token acceptance of the default pair on the quick set, fitted to tokens per round at
# k = 1..3 (benchmarks/avx2-epyc.md); the accepted share per drafted token understates it, as
# acceptances come in runs.
ACCEPTANCE = 0.85
FORMAT = 17  # bump when forwards change cost or the stored reasons change (cached choices are measured again)
MAX_K = 6
GPU_K = 4
SEP, THREADS = " | ", 3  # a pair_key's separator, and where its thread count stands
BEND = MAX_K  # proposed tokens up to which VerifyCost.slope holds (a chain's), `wide` past it
# A draft on the CPU stops early when the product of its top probabilities over the round falls
# below its stop (length.unsure), and may then run STOP_EXTRA tokens past the cost model's k:
# confident runs go on, unsure tokens are not drafted (the variants compared:
# benchmarks/avx2-epyc.md). On a GPU the stop would add a host sync per draft step, so it stays
# off there. The stop is priced by the draft's cost (`stop_for`): one more token costs a draft
# step, c plain steps (and a verify's slope, small on a CPU), and brings reach x p more tokens,
# where reach is the product so far and p the next token's chance. It pays when that beats the
# tokens a round already brings per step (E, about 1.3 on a CPU), so while reach > c E / p; with
# p about 0.65 (a drafted token's acceptance on the CPU) that is STOP_PER_COST x c, within
# [STOP_MIN, STOP_MAX]. The default pair on a CPU: c = 0.33-0.38, so about 0.7; a fixed 0.5,
# before, drafted tokens that lost on translations and chats (benchmarks/floor.md). The verify's
# slope is left out: it is 0.01-0.04 on a CPU, and the probe's noise in it moved the stop by as
# much as the slope itself. An EAGLE-3 head (c = 0.07 on a Zen 4) gets STOP_MIN: a weak head's
# top probabilities overstate its p, and over 32 prompts its chains ran 1.02x plain at a stop of
# 0.15, 1.02x at 0.3 and 1.04x at 0.5, against 0.99x with none (benchmarks/floor.md).
STOP_PER_COST, STOP_MIN, STOP_MAX, STOP_EXTRA = 2.0, 0.5, 0.8, 2


@dataclass(frozen=True)
class VerifyCost:
    """A verify's cost in plain steps, by the tokens proposed: a plain step, `first` for the
    first proposed token, `slope` for each after it up to BEND (a chain's longest), `kink` more
    for the second, and `wide` for each past BEND (a tree's nodes, a long lookup). A CPU's
    kernels step there rather than along a line: from one row to two the step leaves its
    single-row kernels, and on a Xeon with AMX a verify of 3 tokens costs what one of 5 does (2,
    3 and 5 tokens 1.11, 1.21 and 1.21 steps in the decode loop, where the line through 2 and 5
    priced 3 at 1.14: benchmarks/floor.md). Past 7 tokens each costs more again (WIDE)."""

    first: float
    slope: float
    wide: float = 0.0  # 0: not measured: `slope` past BEND too
    kink: float = 0.0  # the second token's cost beyond `slope` (0: on the line)

    def steps(self, proposed: int) -> float:
        if proposed <= 0:
            return 1.0
        near = min(proposed, BEND)
        past = (proposed - near) * max(self.wide, self.slope)
        return 1.0 + self.first + self.slope * (near - 1) + (self.kink if near >= 2 else 0.0) + past

    def per_token(self, proposed: int = 4) -> float:
        """The mean cost of a proposed token in a verify of `proposed` of them (4: a 5-token verify)."""
        return (self.steps(proposed) - 1.0) / proposed


@dataclass(frozen=True)
class DraftLength:
    """The draft length a device favours for a pair (k and the confidence stop with it), and why."""

    k: int
    reason: str
    confidence: float = 0.0  # the draft confidence stop that goes with k (0: none)
    # what a verify costs by the tokens proposed (zeros where not measured: a GPU, no draft)
    verify: VerifyCost = VerifyCost(0.0, 0.0)
    read: float = 0.0  # the draft's reading of one prompt token, in target steps (0: not measured)


def expected_rate(
    k: int, draft_cost: float, verify_cost: dict[int, float], acceptance: float = ACCEPTANCE
) -> float:
    """Expected tokens per target-step time at draft length k (costs relative to one target step)."""
    tokens = (1 - acceptance ** (k + 1)) / (1 - acceptance)
    return tokens / (k * draft_cost + verify_cost[k + 1])


def best_k(draft_cost: float, verify_cost: dict[int, float], acceptance: float = ACCEPTANCE) -> int:
    return max(range(1, MAX_K + 1), key=lambda k: (expected_rate(k, draft_cost, verify_cost, acceptance), -k))


def _verify_cost(two: float, three: float, five: float, wide: float) -> VerifyCost:
    """The verify cost from verifies of 2, 3, 5 and WIDE tokens, each in target steps: 2 gives
    `first`, 3 and 5 `slope` (their line) and `kink` (what the second token costs beyond it), and
    the WIDE-token one what its tokens past BEND cost beyond that line."""
    first = max(0.0, two - 1.0)
    slope = max(0.0, (five - three) / 2)
    line = VerifyCost(first, slope, kink=max(0.0, three - two) - slope)
    return replace(line, wide=max(0.0, (wide - line.steps(BEND)) / (WIDE - 1 - BEND)))


def verify_steps(cost: VerifyCost) -> dict[int, float]:
    """A verify's cost in target steps at 1..MAX_K+1 tokens (best_k's table)."""
    return {n: cost.steps(n - 1) for n in range(1, MAX_K + 2)}


def pair_key(pair, with_draft: bool = True) -> str:
    parts = [
        f"v{FORMAT}",
        cpu_name(),
        ",".join(sorted(cpu_flags() or ())),
        str(torch.get_num_threads()),
        f"{pair.target.name}:{pair.target.dtype}:{pair.target.weights}",
    ]
    if int8.has_wide(pair.target.model):  # oneDNN's verifies: another cost (runtime/onednn.py)
        parts.append("onednn")
    if with_draft:
        parts.append(f"{pair.draft.name}:{pair.draft.dtype}:{pair.draft.weights}")
    return SEP.join(parts)


def choose(pair) -> DraftLength:
    """k for chain-style methods on this pair and device (measured once, then cached)."""
    if pair.draft is None:
        return DraftLength(GPU_K, "no draft model")
    if pair.target.device.type == "cuda" and pair.draft.device.type == "cuda":
        return DraftLength(GPU_K, "GPU: a wide verify costs about one step")
    return cached(
        pair_key(pair),
        _entry,
        lambda: _measure(pair),
        lambda c: {
            "k": c.k,
            "reason": c.reason,
            "confidence": c.confidence,
            "verify_slope": c.verify.slope,
            "verify_first": c.verify.first,
            "verify_wide": c.verify.wide,
            "verify_kink": c.verify.kink,
            "read": c.read,
        },
        "the draft length cached in {path} is not valid; measuring it again",
    )


def _measure(pair) -> DraftLength:
    with torch.inference_mode():
        draft, two, three, five, wide, read = ratios(pair)
    verify = _verify_cost(two, three, five, wide)
    k = best_k(draft, verify_steps(verify))
    step = "head step" if pair.draft.vocabulary is Vocabulary.HEAD else "draft step"
    reason = (
        f"measured: {step} {draft:.2f} of a target step, verifies of 2, 3, 5 and {WIDE} tokens "
        f"{two:.2f}, {three:.2f}, {five:.2f} and {wide:.2f} steps, a prompt token read by the draft "
        f"{read:.3f}; best at {ACCEPTANCE:.0%} acceptance"
    )
    confidence = 0.0
    if pair.draft.device.type == "cpu":
        k, confidence = min(MAX_K, k + STOP_EXTRA), stop_for(draft)
        reason += (
            f"; up to {STOP_EXTRA} more while the product of the draft's top probabilities stays "
            f"at {confidence:.2f} or above"
        )
    return DraftLength(k, reason, confidence, verify, read)


def stop_for(draft_cost: float) -> float:
    """The confidence stop for a draft step of `draft_cost` target steps (see STOP_PER_COST)."""
    return round(min(STOP_MAX, max(STOP_MIN, STOP_PER_COST * draft_cost)), 2)


def verify_slope(pair) -> float | None:
    """What one more verified token costs in target steps, on the mean over a 5-token verify's
    four proposed tokens, where `choose` measured it for this target and device (`verify_cost`,
    read from its cache, never measured here); None elsewhere. The suffix tree's branching reads
    it (lookup prices its copies by the whole `verify_cost`)."""
    cost = verify_cost(pair)
    return cost.per_token() if cost is not None and cost.per_token() > 0 else None


def verify_cost(pair) -> VerifyCost | None:
    """A verify's cost by the tokens proposed, where `choose` measured it for this pair and
    device (read from its cache, never measured here; `_measured`: at any thread count); else, on
    a CPU, what it measured for the same target with another draft (a verify is the target's
    forward alone: a pair with an EAGLE head or without a draft has no entry of its own), at any
    thread count, the dearest where several did; None elsewhere. Without it a row's floor has no
    price for its rounds' plain steps (floor.py) and a tree row starts whole
    (floor.first_ceiling)."""

    def priced(entry: DraftLength | None) -> bool:
        return entry is not None and (entry.verify.first > 0 or entry.verify.slope > 0)

    entry = _measured(pair)
    if priced(entry):
        return entry.verify
    if pair.target.device.type != "cpu":
        return None
    target = pair_key(pair, with_draft=False).split(SEP)
    others = [
        found.verify
        for key, value in _read(cache_root() / "draft-length.json").items()
        if _alike(target, key.split(SEP)[: len(target)]) and priced(found := _entry(value))
    ]
    return max(others, key=lambda cost: cost.steps(WIDE)) if others else None


def read_price(pair) -> float | None:
    """What the draft's reading of one prompt token costs in target steps, where `choose`
    measured it for this pair and device (from its cache, never measured here); None elsewhere."""
    entry = _measured(pair)
    return entry.read if entry is not None and entry.read > 0 else None


def _measured(pair) -> DraftLength | None:
    """This pair's entry; else, where it was measured at another thread count on this machine,
    the entry of the most threads. The engine fits its threads to the cores other processes
    leave free (runtime/threads.py), so a drafter built while the machine is busy looks for the
    entry of fewer threads than `choose` measured; without one its rows would have no read rule
    and their floors no verify price."""
    if pair.draft is None or pair.target.device.type == "cuda":
        return None
    known = _read(cache_root() / "draft-length.json")
    key = pair_key(pair)
    entry = _entry(known.get(key))
    if entry is not None:
        return entry
    parts = key.split(SEP)
    others = [
        (int(other[THREADS]), found)
        for other, value in ((k.split(SEP), v) for k, v in known.items())
        if _alike(parts, other) and other[THREADS].isdigit() and (found := _entry(value))
    ]
    return max(others, key=lambda item: item[0])[1] if others else None


def _alike(key: list[str], other: list[str]) -> bool:
    """Whether two pair_keys' parts name the same machine and models, at any thread count."""
    return len(key) == len(other) and all(a == b for i, (a, b) in enumerate(zip(key, other)) if i != THREADS)


CPU_PRICE = 0.07  # one more verified token, in target steps, on the CPUs measured: 0.07-0.1


def lookup_cost(pair) -> VerifyCost | None:
    """What a verify costs by the lookup tokens it holds, in target steps: as measured for this
    target on this machine (`verify_cost`: with whichever draft it was measured), else CPU_PRICE a
    token on a CPU (the least measured, so a copy is cut no more than the cheapest CPU warrants);
    None on other devices, where a wide verify costs next to nothing."""
    if pair.target.device.type != "cpu":
        return None
    cost = verify_cost(pair)
    return cost if cost is not None else VerifyCost(CPU_PRICE, CPU_PRICE)


def cached(key: str, parse, measure, as_json, stale: str):
    """The entry `key` of draft-length.json, parsed (`parse`: None when it does not validate),
    else measured and written back: one entry changed under the lock, so other processes keep
    theirs. An entry that does not validate is measured again with the notice `stale`."""
    path = cache_root() / "draft-length.json"
    known = _read(path)
    if key in known:
        value = parse(known[key])
        if value is not None:
            return value
        note("specgen: " + stale.format(path=path))
    value = measure()
    try:
        with locked("draft-length"):
            known = _read(path)
            known[key] = as_json(value)
            write_text(path, json.dumps(known, indent=1))
    except OSError:
        pass  # an unwritable cache only means measuring again next time
    return value


def _read(path) -> dict:
    """The cache file's entries; an unreadable or foreign file counts as empty (measured again)."""
    try:
        known = json_value(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _entry(entry) -> DraftLength | None:
    """A cached entry, if it is one this version wrote: k an integer in 1..MAX_K, confidence a
    number in [0, 1), reason text. Anything else (a hand edit, another version) is None."""
    if not isinstance(entry, dict):
        return None
    k, confidence, reason, slope, first, kink, wide, read = (
        entry.get("k"),
        entry.get("confidence", 0.0),
        entry.get("reason", "measured earlier"),
        entry.get("verify_slope", 0.0),
        entry.get("verify_first", 0.0),
        entry.get("verify_kink", 0.0),
        entry.get("verify_wide", 0.0),
        entry.get("read", 0.0),
    )
    if type(k) is not int or not 1 <= k <= MAX_K:
        return None
    if type(confidence) not in (int, float) or not 0.0 <= confidence < 1.0 or not isinstance(reason, str):
        return None
    if any(type(cost) not in (int, float) or not 0.0 <= cost < 10.0 for cost in (slope, first, wide, read)):
        return None
    if type(kink) not in (int, float) or not -slope <= kink < 10.0:  # the second token costs >= 0
        return None
    verify = VerifyCost(float(first), float(slope), float(wide), float(kink))
    return DraftLength(k, reason, float(confidence), verify, float(read))
