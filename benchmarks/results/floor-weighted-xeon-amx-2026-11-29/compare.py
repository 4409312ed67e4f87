"""Per prompt, the median over runs of each method's speed-up against the plain run of the same
file, for two variants; the files are single-repeat bench --json outputs: VARIANT-I.json."""
import glob, json, statistics, sys
from collections import defaultdict

def read(path):
    data = json.load(open(path))
    speeds = defaultdict(dict)
    for m in data["measurements"]:
        speeds[m["method"]][m["prompt_id"]] = m["tokens_per_second"]
    identical = all(r.get("identical_to_plain", True) is not False for r in data["prompts"])
    return speeds, identical

variants = sys.argv[1:] or ["before", "after"]
table = {}
for v in variants:
    runs = [read(p) for p in sorted(glob.glob(f"{v}-*.json"))]
    per = defaultdict(lambda: defaultdict(list))
    for speeds, identical in runs:
        assert identical, v
        for method, prompts in speeds.items():
            if method == "plain":
                continue
            for prompt, tps in prompts.items():
                per[method][prompt].append(tps / speeds["plain"][prompt])
    table[v] = {m: {p: statistics.median(r) for p, r in ps.items()} for m, ps in per.items()}
    for m, ps in table[v].items():
        vals = list(ps.values())
        geo = statistics.geometric_mean(vals)
        low = sorted(ps.items(), key=lambda kv: kv[1])[:4]
        below = [p for p, s in ps.items() if s < 0.97]
        print(f"{v:7s} {m:13s} runs {len(runs)} min {min(vals):.2f} geomean {geo:.3f} below 0.97: {len(below)} lowest: " + ", ".join(f"{p} {s:.2f}" for p, s in low))
methods = list(table[variants[0]])
prompts = list(table[variants[0]][methods[0]])
print("prompt".ljust(18) + "".join(f"{m[:11]:>12s} {variants[0][:6]:>6s}/{variants[1][:6]:<6s}" for m in methods))
for p in prompts:
    print(p.ljust(18) + "".join(f"{'':>12s} {table[variants[0]][m][p]:6.2f}/{table[variants[1]][m][p]:<6.2f}" for m in methods))
