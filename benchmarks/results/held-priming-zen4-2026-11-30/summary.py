"""The table of held.txt: per prompt, lookup-chain with the memory primed eagerly (HEAD before
held priming) and held, each against plain decoding of the same turn, and held against eager.

    python summary.py held.txt
"""

import statistics
import sys


def listed(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


rows: dict[str, dict[str, list]] = {}
for line in open(sys.argv[1]):
    parts = line.split()
    if len(parts) != 7 or parts[1] not in ("eager", "held", "plain"):
        continue
    prompt, label, rate, *rest = parts
    rows.setdefault(prompt, {}).setdefault(label, []).append((float(rate), rest))
print(
    "| prompt | rounds, accepted/drafted: eager -> held | eager / plain | held / plain "
    "| held / eager, per turn | median |"
)
print("|---|---|---|---|---|---|")
for prompt, runs in rows.items():
    n = min(len(runs[label]) for label in ("eager", "held", "plain"))
    eager = [runs["eager"][i][0] / runs["plain"][i][0] for i in range(n)]
    held = [runs["held"][i][0] / runs["plain"][i][0] for i in range(n)]
    gain = [runs["held"][i][0] / runs["eager"][i][0] for i in range(n)]
    e, h = runs["eager"][0][1], runs["held"][0][1]
    print(
        f"| {prompt} | {e[1]}, {e[2]}/{e[3]} -> {h[1]}, {h[2]}/{h[3]} | {statistics.median(eager):.2f} "
        f"| {statistics.median(held):.2f} | {listed(gain)} | {statistics.median(gain):.2f} |"
    )
