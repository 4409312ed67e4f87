"""Each prompt's `METHOD@default` against `METHOD@before` in the same repeat of a `whole.py` run,
with the work each did (tokens drafted and accepted, target forwards) and the totals.

    python pairs.py ab-64.json
"""

from __future__ import annotations

import json
import math
import statistics
import sys

FIELDS = ("drafted", "accepted", "target_forwards", "draft_seconds", "verify_seconds", "seconds")


def main() -> None:
    measurements = json.load(open(sys.argv[1]))["measurements"]
    runs = {(m["prompt_id"], m["method"], m["repeat"]): m for m in measurements}
    prompts = sorted({key[0] for key in runs})
    repeats = sorted({key[2] for key in runs})
    methods = {m["method"] for m in measurements}
    for method in ("lookup", "lookup-chain"):
        now, before = f"{method}@default", f"{method}@before"
        if now not in methods:
            continue
        print(f"{now} against {before}: tok/s by repeat; drafted, accepted, forwards (first repeat)")
        ratios = []
        for prompt in prompts:
            cells = [
                runs[prompt, now, r]["wall_tokens_per_second"]
                / runs[prompt, before, r]["wall_tokens_per_second"]
                for r in repeats
            ]
            ratios += cells
            a, b = runs[prompt, now, repeats[0]], runs[prompt, before, repeats[0]]
            work = [f"{a[f]}/{b[f]}" for f in FIELDS[:3]]
            print(f"  {prompt:18s} {' '.join(f'{x:.3f}' for x in cells)}   {'  '.join(work)}")
        print(f"  geomean {math.exp(statistics.mean(math.log(x) for x in ratios)):.3f}")
    for method in sorted(methods):
        total = [sum(m[f] or 0 for m in measurements if m["method"] == method) for f in FIELDS]
        print(
            f"{method:22s} drafted {total[0]} accepted {total[1]} forwards {total[2]} "
            f"draft {total[3]:.1f} s verify {total[4]:.1f} s in all {total[5]:.1f} s"
        )


if __name__ == "__main__":
    main()
