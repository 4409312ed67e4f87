"""The default draft length per device, from the measured cost of a draft step and a verify.

A chain round at draft length k costs k draft steps plus one target forward over k+1 tokens,
and yields (1 - a^(k+1)) / (1 - a) tokens on average at per-token acceptance a. Where a
draft step is cheap next to the target and a wide verify costs about what a single step
does (a GPU), long drafts win; where the draft costs half the target (the 0.5B/1.5B pair on
a CPU) short ones do. `choose` measures the three costs once on a short context (in turn,
7 times, about 3 s with the default pair), picks the k in 1..MAX_K with the best expected
tokens per unit of time at the typical acceptance `ACCEPTANCE`, and caches the answer per
machine, thread count and model pair in `$SPECGEN_CACHE/draft-length.json`. A draft on the
CPU also gets a confidence stop (STOP) and STOP_EXTRA more tokens of room.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass

import torch

# per-token acceptance of the default pair on the quick set, fitted to tokens per round: chain
# at k = 1 / 2 / 3 gave 1.84 / 2.59 / 3.12 tokens per target forward (int8 pair, AVX2 EPYC), i.e.
# 1 + a + ... + a^k with a = 0.84-0.87 (benchmarks/README.md). The accepted share per drafted
# token (80% at k=2) understates a: acceptances come in runs.
ACCEPTANCE = 0.85
FORMAT = 6  # bump when the engine's forwards change cost (cached choices are then measured again)
MAX_K = 6
GPU_K = 4
REPEATS = 7  # turns of the three timed forwards
# A draft on the CPU stops early when its top probability falls below STOP (ConfidenceStop),
# and may then run STOP_EXTRA tokens past the cost model's k: confident runs go on, unsure
# tokens are not drafted. Measured on an AVX2 EPYC (default pair, quick set, -n 64, variants
# in one run each): lookup-chain k=3 1.28x / 1.25x plain end to end, k=5 with the stop at 0.5
# 1.35x / 1.45x, at 0.3 1.19x, at 0.6 1.34x, k=4 1.37x and k=6 1.40x (both at 0.5). On a GPU
# the stop would add a host sync per draft step, so it stays off there.
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
    """One model's forward of `width` tokens over a short cached context, timed on demand."""

    def __init__(self, model, width: int, context: int = 32, exact: bool = True):
        from specgen import kvcache
        from specgen.lean import call_for

        self.call = call_for(model, exact)  # what the decode loop calls
        self.device = next(model.parameters()).device
        vocab = model.get_input_embeddings().num_embeddings
        self.cache, self.context = kvcache.new_cache(model), context
        kvcache.forward(self.call, self.cache, (torch.arange(100, 100 + context, device=self.device) % vocab)[None],
                        keep=1)
        self.tokens = (torch.arange(300, 300 + width, device=self.device) % vocab)[None]
        self.seconds()  # the first forward warms up

    def seconds(self) -> float:
        from specgen import kvcache

        started = time.perf_counter()
        kvcache.forward(self.call, self.cache, self.tokens, keep=1)
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
    from specgen.placement import cpu_flags, cpu_name

    return " | ".join([f"v{FORMAT}", cpu_name(), ",".join(sorted(cpu_flags() or ())), str(torch.get_num_threads()),
                       f"{pair.target.name}:{pair.target.dtype}:{pair.target.weights}",
                       f"{pair.draft.name}:{pair.draft.dtype}:{pair.draft.weights}"])


def choose(pair) -> Choice:
    """k for chain-style methods on this pair and device (measured once, then cached)."""
    if pair.draft is None:
        return Choice(GPU_K, "no draft model")
    if pair.target.device.type == "cuda" and pair.draft.device.type == "cuda":
        return Choice(GPU_K, "GPU: a wide verify costs about one step")
    from specgen.catalog import cache_root

    path = cache_root() / "draft-length.json"
    key = _key(pair)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), dict) and "k" in known[key]:
        entry = known[key]
        return Choice(int(entry["k"]), entry.get("reason", "measured earlier"), float(entry.get("confidence", 0.0)))
    with torch.inference_mode():
        draft, wide = _ratios(pair)
    verify = _interpolate(1.0, wide, 5)
    k = best_k(draft, verify)
    reason = (f"measured: draft step {draft:.2f} of a target step, 5-token verify "
              f"{wide:.2f} steps; best at {ACCEPTANCE:.0%} acceptance")
    confidence = 0.0
    if pair.draft.device.type == "cpu":
        k, confidence = min(MAX_K, k + STOP_EXTRA), STOP
        reason += f"; up to {STOP_EXTRA} more while the draft's top probability stays at {STOP} or above"
    known = known if isinstance(known, dict) else {}
    known[key] = {"k": k, "reason": reason, "confidence": confidence}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only means measuring again next time
    return Choice(k, reason, confidence)
