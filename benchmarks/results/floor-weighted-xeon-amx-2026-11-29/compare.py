"""Per prompt, the median over runs of each method's speed-up against the plain run of the same
file, for two variants; the files are single-repeat `bench --json` outputs named VARIANT-I.json:

    python compare.py before after
"""

import glob
import json
import statistics
import sys
from collections import defaultdict


def read(path: str):
    data = json.load(open(path))
    speeds: dict[str, dict[str, float]] = defaultdict(dict)
    for m in data["measurements"]:
        speeds[m["method"]][m["prompt_id"]] = m["tokens_per_second"]
    identical = all(r.get("identical_to_plain", True) is not False for r in data["prompts"])
    return speeds, identical


def medians(variant: str) -> tuple[int, dict[str, dict[str, float]]]:
    runs = [read(p) for p in sorted(glob.glob(f"{variant}-*.json"))]
    per: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for speeds, identical in runs:
        assert identical, variant
        for method, prompts in speeds.items():
            if method != "plain":
                for prompt, tps in prompts.items():
                    per[method][prompt].append(tps / speeds["plain"][prompt])
    return len(runs), {m: {p: statistics.median(r) for p, r in ps.items()} for m, ps in per.items()}


def main() -> None:
    variants = sys.argv[1:] or ["before", "after"]
    table = {}
    for v in variants:
        count, table[v] = medians(v)
        for m, ps in table[v].items():
            values = list(ps.values())
            lowest = ", ".join(f"{p} {s:.2f}" for p, s in sorted(ps.items(), key=lambda kv: kv[1])[:4])
            print(
                f"{v:7s} {m:13s} runs {count} min {min(values):.2f} "
                f"geomean {statistics.geometric_mean(values):.3f} "
                f"below 0.97: {sum(s < 0.97 for s in values)} lowest: {lowest}"
            )
    first, second = variants[0], variants[1]
    methods = list(table[first])
    print("prompt".ljust(18) + "".join(f"{m[:11]:>12s} {first[:6]:>6s}/{second[:6]:<6s}" for m in methods))
    for p in table[first][methods[0]]:
        cells = "".join(f"{'':>12s} {table[first][m][p]:6.2f}/{table[second][m][p]:<6.2f}" for m in methods)
        print(p.ljust(18) + cells)


if __name__ == "__main__":
    main()
