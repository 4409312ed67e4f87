"""Per prompt, two variants side by side: each method's speed-up against the plain run of the
same process, the median over a variant's single-repeat `bench --json` files (VARIANT-I.json),
read as `per_prompt.py --processes` reads them:

    python compare.py before after
"""

import glob
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from per_prompt import as_repeats, speedups  # noqa: E402


def medians(variant: str) -> tuple[int, dict[str, dict[str, float]]]:
    runs = [json.loads(Path(p).read_text()) for p in sorted(glob.glob(f"{variant}-*.json"))]
    for data in runs:  # every generation plain decoding's, token for token
        assert all(r.get("identical_to_plain", True) is not False for r in data["prompts"]), variant
    return len(runs), speedups(as_repeats(runs))


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
