"""Per prompt and column: the median over repeats of each repeat's ratio to the plain run beside
it, with the first repeat's target forwards and accepted/drafted tokens.

    python paired.py FILE.json
"""

import json
import statistics
import sys

data = json.load(open(sys.argv[1]))
by, meta = {}, {}
for x in data["measurements"]:
    by.setdefault((x["prompt_id"], x["repeat"]), {})[x["method"]] = x["wall_tokens_per_second"]
    meta.setdefault((x["prompt_id"], x["method"]), (x["target_forwards"], x["accepted"], x["drafted"]))
methods = sorted({m for row in by.values() for m in row if m != "plain"})
prompts = sorted({p for p, _ in by})
repeats = sorted({r for _, r in by})
print("| prompt | " + " | ".join(methods) + " |")
print("|---" * (len(methods) + 1) + "|")
for prompt in prompts:
    cells = []
    for method in methods:
        ratio = statistics.median(by[(prompt, r)][method] / by[(prompt, r)]["plain"] for r in repeats)
        forwards, accepted, drafted = meta[(prompt, method)]
        cells.append(f"{ratio:.2f} ({forwards} fwd, {accepted}/{drafted})")
    print(f"| {prompt} | " + " | ".join(cells) + " |")
