"""Per prompt and method: the median over repeats of each repeat's speed-up over the plain run
beside it, in one or more bench JSON files (each file's own plain runs).

    python medians.py A.json [B.json ...]
"""

import json
import statistics
import sys

for path in sys.argv[1:]:
    data = json.load(open(path))
    by = {}
    for x in data["measurements"]:
        by.setdefault((x["prompt_id"], x["repeat"]), {})[x["method"]] = x["wall_tokens_per_second"]
    prompts = sorted({p for p, _ in by})
    repeats = sorted({r for _, r in by})
    methods = [m for m in dict.fromkeys(m for row in by.values() for m in row) if m != "plain"]
    print(f"{path}\n| prompt | " + " | ".join(methods) + " |")
    print("|---" * (len(methods) + 1) + "|")
    for prompt in prompts:
        cells = []
        for method in methods:
            ratios = [by[(prompt, r)][method] / by[(prompt, r)]["plain"] for r in repeats]
            cells.append(f"{statistics.median(ratios):.2f}")
        print(f"| {prompt} | " + " | ".join(cells) + " |")
