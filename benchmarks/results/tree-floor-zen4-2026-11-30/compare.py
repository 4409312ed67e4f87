"""Per prompt: each method's speed-up over the plain run beside it, in two bench JSON files (before,
after); the geometric mean, the minimum and the prompts below 0.97x of each.

    python compare.py before.json after.json
"""

import json
import math
import sys


def ratios(path):
    data = json.load(open(path))
    by = {}
    for x in data["measurements"]:
        by.setdefault((x["prompt_id"], x["repeat"]), {})[x["method"]] = x
    out = {}
    for (prompt, _), row in by.items():
        plain = row["plain"]["wall_tokens_per_second"]
        for method, x in row.items():
            if method != "plain":
                out.setdefault(method, {}).setdefault(prompt, []).append(x["wall_tokens_per_second"] / plain)
    return {m: {p: sorted(v)[len(v) // 2] for p, v in r.items()} for m, r in out.items()}


files = sys.argv[1:]
runs = [ratios(f) for f in files]
print("| method | " + " | ".join(f"{f}: geomean, min, below 0.97x" for f in files) + " |")
print("|---" * (len(files) + 1) + "|")
for method in runs[0]:
    cells = []
    for run in runs:
        r = run.get(method, {})
        if not r:
            cells.append("-")
            continue
        geo = math.exp(sum(math.log(v) for v in r.values()) / len(r))
        low = sorted((v, p) for p, v in r.items() if v < 0.97)
        named = ", ".join(f"{p} {v:.2f}" for v, p in low)
        cells.append(f"{geo:.2f}, {min(r.values()):.2f}, {len(low)}: {named}")
    print(f"| {method} | " + " | ".join(cells) + " |")
