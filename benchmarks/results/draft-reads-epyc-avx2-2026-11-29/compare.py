"""Per group of prompts (those whose lookup-chain row skipped the draft's read, and the rest),
geometric means of each column's speed-up against plain, and every generation's identity."""

import json
import math
import sys

d = json.load(open(sys.argv[1]))
rows = {(g["prompt_id"], g["method"]): g for g in d["measurements"]}
ids = sorted({p for p, _ in rows}, key=lambda p: rows[(p, "plain")]["prompt_tokens"])


def sp(p, c):
    return rows[(p, c)]["wall_tokens_per_second"] / rows[(p, "plain")]["wall_tokens_per_second"]


def geo(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


skipped = [p for p in ids if rows[(p, "lookup-chain@default")]["draft_seconds"] < 0.05]
rest = [p for p in ids if p not in skipped]
for name, group in (("read skipped", skipped), ("read as before", rest)):
    line = f"{name}: {len(group)} prompts"
    for method in ("lookup-chain", "chain"):
        a = [sp(p, f"{method}@default") for p in group]
        b = [sp(p, f"{method}@always") for p in group]
        line += f" | {method}: default {geo(a):.3f} (min {min(a):.2f})"
        line += f", always {geo(b):.3f} (min {min(b):.2f})"
    print(line)
print("identical to plain:", all(r["identical_to_plain"] for r in d["prompts"] if r["method"] != "plain"))
print("cpu flags:", d["environment"].get("cpu_flags"))
