"""Before and after of two bench files (plain, chain, lookup-chain): speed-ups and greedy counts.

python compare_ab.py ab-before.json ab-after.json
"""

from __future__ import annotations

import json
import math
import sys

METHODS = ("chain", "lookup-chain")


def load(path: str) -> dict:
    data = json.load(open(path))
    return {(m["method"], m["prompt_id"]): m for m in data["measurements"]}


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def speedups(runs: dict, method: str, ids: list[str]) -> list[float]:
    return [runs[(method, i)]["tokens_per_second"] / runs[("plain", i)]["tokens_per_second"] for i in ids]


def total(runs: dict, method: str, ids: list[str], field: str) -> float:
    return sum(runs[(method, i)][field] for i in ids)


def main() -> None:
    before, after = load(sys.argv[1]), load(sys.argv[2])
    ids = sorted({key[1] for key in before})
    same = all(
        runs[(method, i)]["token_ids"] == before[("plain", i)]["token_ids"]
        for runs in (before, after)
        for method in ("plain", *METHODS)
        for i in ids
    )
    print("all outputs identical to plain:", same)
    for method in METHODS:
        old, new = speedups(before, method, ids), speedups(after, method, ids)
        counts = "; ".join(
            f"{field} {total(before, method, ids, field):.0f} -> {total(after, method, ids, field):.0f}"
            for field in ("target_forwards", "drafted", "accepted", "draft_seconds")
        )
        print(
            f"{method}: geomean {geomean(old):.3f} -> {geomean(new):.3f}; min {min(old):.2f} -> "
            f"{min(new):.2f}; below 0.97: {sum(x < 0.97 for x in old)} -> {sum(x < 0.97 for x in new)}; "
            + counts
        )
    print("per prompt, lookup-chain before -> after (target forwards; chain's after):")
    for i in ids:
        b, a = before[("lookup-chain", i)], after[("lookup-chain", i)]
        print(
            f"  {i}: {b['tokens_per_second'] / before[('plain', i)]['tokens_per_second']:.2f} -> "
            f"{a['tokens_per_second'] / after[('plain', i)]['tokens_per_second']:.2f}  "
            f"forwards {b['target_forwards']} -> {a['target_forwards']} "
            f"(chain {after[('chain', i)]['target_forwards']})"
        )


if __name__ == "__main__":
    main()
