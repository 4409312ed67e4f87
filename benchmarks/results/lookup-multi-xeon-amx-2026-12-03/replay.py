"""Lookup's proposals replayed on recorded greedy outputs, under variants of how far a copy goes.

    python benchmarks/results/lookup-multi-xeon-amx-2026-12-03/replay.py BENCH.json PROMPTS.jsonl \
        [now,first,firstall,p1=A/B,min2,whole] [line|rounds]

Greedy output does not depend on what is drafted, so plain decoding's recorded tokens (bench's
JSON) are every method's. Each prompt's rounds are replayed through specgen's own
`PromptLookupDrafter`: it proposes from the context, the tokens that agree with the recorded ones
are accepted, and one more comes from the target. Each round costs what it proposed, in plain
steps: `line` (the default), the device's price as it was, a line through its 2- and 5-token
verifies (this machine's first 0.088, slope 0.048, wide 0.016); `rounds`, what lookup's rounds
cost in the decode loop (`rounds.txt`: 1, 2 and 4 tokens proposed 1.11, 1.23 and 1.23 steps). No
timing and no floor, so no machine's state enters: a ranking of the variants, not their speed.

Variants:
- `now`: as specgen drafts (every copied token priced at the verify's slope);
- `first`: the first copied token priced at `first` (the dearer step from one row to two);
- `firstall`: every copied token priced at `first`;
- `p1=A/B`: the prior after a one-token match, A accepted and B rejected (specgen: 0.5/1.5);
- `min2`: no copies after one-token matches;
- `whole`: the copy's length that brings the most tokens less its verify's cost, as a whole
  (at each token's chance p_n^i, priced by the costs of the replay).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/

from draft_reads import MODELS  # noqa: E402

from specgen.bench.prompts import encode_all, load_prompts  # noqa: E402
from specgen.config import Method  # noqa: E402
from specgen.decoding.costs import VerifyCost  # noqa: E402
from specgen.decoding.drafters import lookup  # noqa: E402
from specgen.text import common_prefix  # noqa: E402

K = 5  # the device's draft length on this machine
LINE = VerifyCost(0.088, 0.048, 0.0162)


class Rounds:
    """What lookup's rounds cost in the decode loop, by the tokens proposed (rounds.txt)."""

    first = 0.11
    table = {0: 1.0, 1: 1.11, 2: 1.23, 3: 1.23, 4: 1.23, 5: 1.25}

    def steps(self, proposed: int) -> float:
        return self.table[min(proposed, 5)]


COST = LINE


def length_first(self, n: int, k: int, price: float) -> int:
    """MatchOdds.length with the first copied token priced at COST.first."""
    chance, reach, length = self.chance(n), 1.0, 0
    while length < k:
        reach *= chance
        if reach < (COST.first if length == 0 else price):
            break
        length += 1
    return length


def length_whole(self, n: int, k: int, price: float) -> int:
    """The copy's length with the most tokens less its verify's cost (COST), as a whole."""
    chance, reach, tokens, best, length = self.chance(n), 1.0, 0.0, 0.0, 0
    for size in range(1, k + 1):
        reach *= chance
        tokens += reach
        if tokens - (COST.steps(size) - 1.0) > best:
            best, length = tokens - (COST.steps(size) - 1.0), size
    return length


def replay(prompt: list[int], out: list[int], variant: str) -> tuple[float, int, int]:
    """Tokens per plain step of the prompt's rounds, tokens proposed, tokens accepted."""
    length, priors = lookup.MatchOdds.length, dict(lookup.PRIORS)
    if variant == "first":
        lookup.MatchOdds.length = length_first
    if variant == "whole":
        lookup.MatchOdds.length = length_whole
    if variant.startswith("p1="):
        accepted, rejected = map(float, variant[3:].split("/"))
        lookup.PRIORS[1] = (accepted, rejected)
    try:
        drafter = lookup.PromptLookupDrafter(
            price=LINE.first if variant == "firstall" else LINE.slope, min_ngram=2 if variant == "min2" else 1
        )
        drafter.start(list(prompt))
        context, done, steps, proposed, accepted = list(prompt), 0, 0.0, 0, 0
        while done < len(out):
            tokens = drafter.find(context, K) or []
            agreed = common_prefix(tokens, out[done : done + len(tokens)])
            taken = min(agreed + 1, len(out) - done)
            context += out[done : done + taken]
            done += taken
            steps += COST.steps(len(tokens))
            proposed, accepted = proposed + len(tokens), accepted + agreed
        return len(out) / steps, proposed, accepted
    finally:
        lookup.MatchOdds.length = length
        lookup.PRIORS.clear()
        lookup.PRIORS.update(priors)


def geomean(values) -> float:
    return math.exp(statistics.mean(math.log(v) for v in values))


def main() -> None:
    global COST
    from specgen.runtime.pair import load

    bench, prompts_path = sys.argv[1], sys.argv[2]
    variants = sys.argv[3].split(",") if len(sys.argv) > 3 else ["now", "first", "firstall"]
    COST = Rounds() if len(sys.argv) > 4 and sys.argv[4] == "rounds" else LINE
    pair = load(MODELS, Method.LOOKUP, quiet=True)
    prompts = load_prompts(prompts_path)
    encoded = encode_all(pair.target.tokenizer, prompts, pair.target.context_length)
    ids = {p.id: e for p, e in zip(prompts, encoded)}
    outs = {
        x["prompt_id"]: x["token_ids"]
        for x in json.loads(Path(bench).read_text())["measurements"]
        if x["method"] == "plain"
    }
    results = {v: {pid: replay(ids[pid], out, v) for pid, out in outs.items()} for v in variants}
    for v in variants:
        rates = {pid: r[0] for pid, r in results[v].items()}
        below = sorted((round(rate, 3), pid) for pid, rate in rates.items() if rate < 1.0)
        print(
            f"{v:10s} geomean {geomean(rates.values()):.4f} min {min(rates.values()):.3f} "
            f"proposed {sum(r[1] for r in results[v].values())} "
            f"accepted {sum(r[2] for r in results[v].values())} below 1: {len(below)} {below[:6]}"
        )
    for category in sorted({pid.rsplit("-", 1)[0] for pid in outs}):
        members = [pid for pid in outs if pid.rsplit("-", 1)[0] == category]
        cells = " ".join(f"{v} {geomean(results[v][pid][0] for pid in members):.3f}" for v in variants)
        print(f"  {category:14s} {cells}")


if __name__ == "__main__":
    main()
