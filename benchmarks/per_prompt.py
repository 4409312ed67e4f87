"""Per-prompt speed-ups of a `specgen bench --json` file: each prompt's tok/s under each method
against plain decoding's in the same run, and per method the minimum, the mean and how many
prompts fell below a bound (the floor's goal: none below 0.97x).

    python benchmarks/per_prompt.py BENCH.json [MORE.json ...] [--below 0.97] [--table]

Several files (say, 64 and 128 tokens) are summarised each on its own, then together."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def speedups(path: Path) -> dict[str, dict[str, float]]:
    """method -> prompt id -> speed-up against plain (the file's own per-prompt figures)."""
    data = json.loads(path.read_text())
    out: dict[str, dict[str, float]] = {}
    for row in data["prompts"]:
        if row["method"] != "plain" and row.get("speedup") is not None:
            out.setdefault(row["method"], {})[row["prompt_id"]] = row["speedup"]
    return out


def summary(name: str, table: dict[str, dict[str, float]], below: float) -> list[str]:
    lines = [f"{name}", f"  {'method':<14}{'prompts':>8}{'min':>8}{'mean':>8}{'geomean':>9}  below {below}x"]
    for method, values in table.items():
        ratios = list(values.values())
        low = sorted((v, p) for p, v in values.items() if v < below)
        geo = statistics.geometric_mean(ratios)
        worst = ", ".join(f"{p} {v:.2f}" for v, p in low[:6]) or "none"
        lines.append(
            f"  {method:<14}{len(ratios):>8}{min(ratios):>8.2f}{statistics.mean(ratios):>8.2f}{geo:>9.2f}  "
            f"{len(low)}: {worst}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--below", type=float, default=0.97)
    parser.add_argument("--table", action="store_true", help="also print every prompt's speed-up")
    args = parser.parse_args()
    merged: dict[str, dict[str, float]] = {}
    for path in args.files:
        table = speedups(path)
        print("\n".join(summary(path.name, table, args.below)))
        if args.table:
            for method, values in table.items():
                print(f"  {method}: " + ", ".join(f"{p} {v:.2f}" for p, v in values.items()))
        for method, values in table.items():
            merged.setdefault(method, {}).update({f"{path.stem}:{p}": v for p, v in values.items()})
    if len(args.files) > 1:
        print("\n".join(summary("all files", merged, args.below)))


if __name__ == "__main__":
    main()
