"""The table of fresh.txt: per prompt, lookup-chain with no head memory (cold) and with one (warm)
against plain decoding of the same turn, and warm against cold.

    python summary.py fresh.txt
"""

import statistics
import sys


def listed(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


rows: dict[str, dict[str, list]] = {}
for line in open(sys.argv[1]):
    prompt, label, rate, *rest = line.split()
    rows.setdefault(prompt, {}).setdefault(label, []).append((float(rate), rest))
print(
    "| prompt | rounds, accepted/drafted: cold -> warm | cold / plain (3 turns) | warm / plain "
    "| warm / cold, per turn | median warm / cold |"
)
print("|---|---|---|---|---|---|")
for prompt, runs in rows.items():
    n = min(len(runs["cold"]), len(runs["warm"]), len(runs["plain"]))
    cold = [runs["cold"][i][0] / runs["plain"][i][0] for i in range(n)]
    warm = [runs["warm"][i][0] / runs["plain"][i][0] for i in range(n)]
    gain = [runs["warm"][i][0] / runs["cold"][i][0] for i in range(n)]
    c, w = runs["cold"][0][1], runs["warm"][0][1]
    print(
        f"| {prompt} | {c[1]}, {c[2]}/{c[3]} -> {w[1]}, {w[2]}/{w[3]} "
        f"| {listed(cold)}: **{statistics.median(cold):.2f}** "
        f"| {listed(warm)}: **{statistics.median(warm):.2f}** "
        f"| {listed(gain)} | {statistics.median(gain):.2f} |"
    )
