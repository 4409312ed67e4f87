"""Per prompt: a variant's tok/s over another column's in the same bench run (same prompt, same
repeat), for pairs of columns, with the geometric mean and how many prompts each way.

    python pairs.py RUN.json A B [C D ...]     # A against B, C against D, ...
"""

import json
import math
import statistics
import sys

data = json.load(open(sys.argv[1]))
tps = {(x["prompt_id"], x["repeat"], x["method"]): x["wall_tokens_per_second"] for x in data["measurements"]}
names = sys.argv[2:]
for a, b in zip(names[::2], names[1::2]):
    keys = sorted({(p, r) for p, r, m in tps if m == a})
    ratios = [tps[(p, r, a)] / tps[(p, r, b)] for p, r in keys]
    geo = math.exp(statistics.mean(math.log(x) for x in ratios))
    up, down = sum(x > 1.03 for x in ratios), sum(x < 0.97 for x in ratios)
    print(
        f"{a} / {b}: geomean {geo:.3f}, min {min(ratios):.2f}, max {max(ratios):.2f}, "
        f"above 1.03 on {up}, below 0.97 on {down} of {len(ratios)}"
    )
