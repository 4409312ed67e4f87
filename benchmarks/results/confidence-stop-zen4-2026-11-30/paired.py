"""Per prompt, one column against another of the same bench runs: each run's ratio of their
speed-ups over plain (the same plain runs), then the geometric mean over prompts and runs, by
category, and the prompts where either column ran below plain.

    python benchmarks/results/confidence-stop-zen4-2026-11-30/paired.py BASE:VARIANT RUN.json [RUN.json ...]
"""

import json
import math
import sys
from collections import defaultdict
from statistics import median


def speedups(path: str) -> tuple[dict, dict]:
    """{prompt: {method: [speed-up over plain of each repeat]}}, {prompt: category}."""
    data = json.load(open(path))
    speed, category = defaultdict(lambda: defaultdict(dict)), {}
    for m in data["measurements"]:
        speed[m["prompt_id"]][m["method"]][m["repeat"]] = m["tokens_per_second"]
        category[m["prompt_id"]] = m["category"]
    out = {}
    for prompt, methods in speed.items():
        plain = methods["plain"]
        out[prompt] = {
            name: [v / plain[r] for r, v in sorted(runs.items())] for name, runs in methods.items()
        }
    return out, category


def geomean(values) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def main() -> None:
    base, variant = sys.argv[1].split(":")
    runs = [speedups(path) for path in sys.argv[2:]]
    category = runs[0][1]
    pairs, by_category, weak = [], defaultdict(list), []
    for prompt in runs[0][0]:
        ours = [x for run, _ in runs for x in run[prompt][base]]
        theirs = [x for run, _ in runs for x in run[prompt][variant]]
        ratios = [b / a for a, b in zip(ours, theirs)]
        pairs += ratios
        by_category[category[prompt]] += ratios
        if min(ours + theirs) < 1.0:
            weak.append((prompt, ours, theirs))
    wins = sum(r > 1 for r in pairs)
    print(f"{variant} against {base}: {geomean(pairs):.3f} (geomean of {len(pairs)} pairs, {wins} faster)")
    for name, ratios in sorted(by_category.items()):
        print(f"  {name:16} {geomean(ratios):.3f}")
    print(f"prompts where either ran below plain ({base} | {variant}; each run, then the median):")
    for prompt, ours, theirs in weak:
        print(
            f"  {prompt:14} {' '.join(f'{x:.2f}' for x in ours)} ({median(ours):.2f})"
            f" | {' '.join(f'{x:.2f}' for x in theirs)} ({median(theirs):.2f})"
        )


if __name__ == "__main__":
    main()
