"""Per-prompt speed-ups of a `specgen bench --json` file: each prompt's tok/s under each method
against plain decoding's in the same run, and per method the minimum, the mean and how many
prompts fell below a bound (the floor's goal: none below 0.97x).

    python benchmarks/per_prompt.py BENCH.json [MORE.json ...] [--below 0.97] [--table]
    python benchmarks/per_prompt.py RUN-1.json RUN-2.json RUN-3.json --processes

Several files (say, 64 and 128 tokens) are summarised each on its own, then together. With
`--processes` they are runs of the same prompts, each `bench` in a process of its own, and are
read as the repeats of one run. A user's `specgen run` is a fresh process, so that is what it
sees: a cost paid once per process (the draft head packing a script's blocks in its first answer
of that script) shows in every such repeat, where `--repeats N` in one process shows it in the
first only.

A file of several repeats (`--repeats N`, N >= 2) is also read repeat by repeat, to tell a loss
from this machine's noise:
- per method, each prompt's speed-up in each repeat (the method against plain decoding of the
  same repeat, run next to it), their median, and the prompts below the bound in every repeat;
- plain against plain, the control: each prompt's plain tok/s in one repeat against the
  repeat before. Two runs of the same method differ only by noise, so the share of these
  ratios below the bound is how often a single run falls below it by chance."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from types import SimpleNamespace

from specgen.bench.summary import Noise, noise


def speedups(data: dict) -> dict[str, dict[str, float]]:
    """method -> prompt id -> speed-up against plain (a bench file's own per-prompt figures)."""
    out: dict[str, dict[str, float]] = {}
    for row in data["prompts"]:
        if row["method"] != "plain" and row.get("speedup") is not None:
            out.setdefault(row["method"], {})[row["prompt_id"]] = row["speedup"]
    return out


def by_repeat(data: dict) -> tuple[dict[str, dict[str, list[float]]], Noise | None]:
    """(method -> prompt id -> its speed-up in each repeat, plain against plain), from the
    file's per-repeat measurements; the control is bench's own (`specgen.bench.summary.noise`):
    each prompt's plain tok/s in one repeat over its tok/s in the repeat before."""
    runs: dict[tuple[str, str], dict[int, float]] = {}
    for m in data.get("measurements", []):
        runs.setdefault((m["method"], m["prompt_id"]), {})[m["repeat"]] = m["tokens_per_second"]
    paired: dict[str, dict[str, list[float]]] = {}
    for (method, prompt), speeds in runs.items():
        plain = runs.get(("plain", prompt), {})
        ratios = [speeds[r] / plain[r] for r in sorted(speeds) if r in plain]
        if ratios and method != "plain":
            paired.setdefault(method, {})[prompt] = ratios
    measured = [
        SimpleNamespace(method=method, prompt_id=prompt, repeat=r, wall_tokens_per_second=tps)
        for (method, prompt), speeds in runs.items()
        for r, tps in speeds.items()
    ]
    return paired, noise(measured)


def noise_summary(
    name: str,
    paired: dict[str, dict[str, list[float]]],
    control: Noise | None,
    below: float,
    control_name: str = "plain against plain",
) -> list[str]:
    """Repeat by repeat: per method the medians of the paired speed-ups, and the prompts below
    `below` in every repeat; then the plain-against-plain control (counted against bench's
    bound, 0.97x)."""
    lines = [f"{name}, repeat by repeat (each repeat's method against the plain run next to it)"]
    for method, prompts in paired.items():
        medians = {p: statistics.median(r) for p, r in prompts.items()}
        low = sorted((v, p) for p, v in medians.items() if v < below)
        every = sorted(p for p, r in prompts.items() if len(r) > 1 and max(r) < below)
        lines.append(
            f"  {method:<14}median of repeats: min {min(medians.values()):.2f}, "
            f"{len(low)} below {below}x ({', '.join(f'{p} {v:.2f}' for v, p in low[:6]) or 'none'}); "
            f"below in every repeat: {len(every)} ({', '.join(every[:6]) or 'none'})"
        )
    if control is not None:
        lines.append(
            f"  control: {control_name}, {control.pairs} pairs of single runs: "
            f"{control.share_below:.0%} below {control.bound}x, "
            f"5-95% range {control.low:.2f}-{control.high:.2f}"
        )
    return lines


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


def as_repeats(runs: list[dict]) -> dict:
    """Bench files of the same prompts, each from a process of its own, as one file whose
    repeats are theirs in turn; each prompt's speed-up is the median of its paired ratios."""
    measurements = []
    offset = 0
    for data in runs:
        repeats = [m["repeat"] for m in data.get("measurements", [])]
        measurements += [{**m, "repeat": m["repeat"] + offset} for m in data.get("measurements", [])]
        offset += max(repeats, default=-1) + 1
    paired, _ = by_repeat({"measurements": measurements})
    prompts = [
        {"method": method, "prompt_id": prompt, "speedup": statistics.median(ratios)}
        for method, by_prompt in paired.items()
        for prompt, ratios in by_prompt.items()
    ]
    return {"prompts": prompts, "measurements": measurements}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--below", type=float, default=0.97)
    parser.add_argument("--table", action="store_true", help="also print every prompt's speed-up")
    parser.add_argument(
        "--processes", action="store_true", help="the files are runs of one prompt set, each a process"
    )
    args = parser.parse_args()
    if args.processes:
        data = as_repeats([json.loads(path.read_text()) for path in args.files])
        name = f"{len(args.files)} processes ({', '.join(path.name for path in args.files)})"
        table = speedups(data)
        print("\n".join(summary(name, table, args.below)))
        paired, control = by_repeat(data)
        across = "plain against plain of the process before (the VM's drift between processes too)"
        print("\n".join(noise_summary(name, paired, control, args.below, across)))
        if args.table:
            for method, values in table.items():
                print(f"  {method}: " + ", ".join(f"{p} {v:.2f}" for p, v in values.items()))
        return
    merged: dict[str, dict[str, float]] = {}
    for path in args.files:
        data = json.loads(path.read_text())
        table = speedups(data)
        print("\n".join(summary(path.name, table, args.below)))
        paired, control = by_repeat(data)
        if control is not None:
            print("\n".join(noise_summary(path.name, paired, control, args.below)))
        if args.table:
            for method, values in table.items():
                print(f"  {method}: " + ", ".join(f"{p} {v:.2f}" for p, v in values.items()))
        for method, values in table.items():
            merged.setdefault(method, {}).update({f"{path.stem}:{p}": v for p, v in values.items()})
    if len(args.files) > 1:
        print("\n".join(summary("all files", merged, args.below)))


if __name__ == "__main__":
    main()
