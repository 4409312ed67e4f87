"""Per category: plain tok/s and the geometric-mean speed-up of each method over plain, before
and after, from bench JSON files named CATEGORY-before.json and CATEGORY-after.json.

    python before_after.py DIR
"""

import json
import math
import sys
from pathlib import Path


def read(path: Path) -> dict:
    data = json.loads(path.read_text())
    out = {}
    for row in data["prompts"]:
        if row["method"] == "plain":
            out.setdefault("plain", []).append(row["tokens_per_second"])
        else:
            cell = out.setdefault(row["method"], {"ratios": [], "identical": 0})
            cell["ratios"].append(row["speedup"])
            cell["identical"] += bool(row["identical_to_plain"])
    return out


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main() -> None:
    folder = Path(sys.argv[1])
    methods = ["chain", "lookup-chain"]
    head = "| category | prompts | plain tok/s before | after |"
    for m in methods:
        head += f" {m} before | after | min before | min after |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    pooled = {v: {m: [] for m in methods + ["plain"]} for v in ("before", "after")}
    same = {v: [0, 0] for v in ("before", "after")}
    for before in sorted(folder.glob("*-before.json")):
        category = before.name[: -len("-before.json")]
        sides = {"before": read(before), "after": read(folder / f"{category}-after.json")}
        line = f"| {category} | {len(sides['before']['plain'])} |"
        line += f" {mean(sides['before']['plain']):.1f} | {mean(sides['after']['plain']):.1f} |"
        for m in methods:
            b, a = sides["before"][m]["ratios"], sides["after"][m]["ratios"]
            line += f" {geomean(b):.2f} | {geomean(a):.2f} | {min(b):.2f} | {min(a):.2f} |"
        print(line)
        for v, side in sides.items():
            pooled[v]["plain"] += side["plain"]
            for m in methods:
                pooled[v][m] += side[m]["ratios"]
                same[v][0] += side[m]["identical"]
                same[v][1] += len(side[m]["ratios"])
    line = f"| all | {len(pooled['before']['plain'])} |"
    line += f" {mean(pooled['before']['plain']):.1f} | {mean(pooled['after']['plain']):.1f} |"
    for m in methods:
        b, a = pooled["before"][m], pooled["after"][m]
        line += f" {geomean(b):.2f} | {geomean(a):.2f} | {min(b):.2f} | {min(a):.2f} |"
    print(line)
    for v in ("before", "after"):
        below = {m: sum(r < 0.97 for r in pooled[v][m]) for m in methods}
        print(f"{v}: identical to plain {same[v][0]}/{same[v][1]}; below 0.97x: {below}")


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


if __name__ == "__main__":
    main()
