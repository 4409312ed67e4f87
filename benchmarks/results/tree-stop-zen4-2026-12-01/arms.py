"""Per method: geometric mean, minimum and count below 0.97x of the per-prompt medians (over
repeats) of each repeat's speed-up over the plain run beside it, for each bench JSON given.

    python arms.py A.json [B.json ...]
"""

import json
import math
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
    plain = statistics.mean(by[(p, r)]["plain"] for p in prompts for r in repeats)
    cells = []
    for method in methods:
        medians = [
            statistics.median(by[(p, r)][method] / by[(p, r)]["plain"] for r in repeats) for p in prompts
        ]
        geo = math.exp(statistics.mean(math.log(m) for m in medians))
        below = sum(m < 0.97 for m in medians)
        cells.append(f"{method} {geo:.3f}x min {min(medians):.2f} below {below}/{len(medians)}")
    print(f"{path} (plain {plain:.1f} tok/s): " + "; ".join(cells))
