"""What a verify costs in plain steps over short and long cached contexts, and after draft steps.

    python benchmarks/verify_context.py [--contexts 32,160] [--repeats 9] [--out FILE]

The default pair as `specgen` loads it on the CPU (int8 target, int8 pruned draft). For each
context, the probes of `specgen.decoding.costs` (the forwards the decode loop calls) time, in
turn: a target step, verifies of 2, 3 and 5 tokens (every position's logits, as the loop reads
them), the step again, then a 2-token verify after two draft steps and a step after one. Each is
divided by the mean of the two steps around it, and the medians of `--repeats` turns are printed.

This is what moved the device's cost probe from 32 cached tokens to `costs.CONTEXT`: over 32 a
5-token verify cost 1.01-1.12 plain steps on a 2-core AVX2 EPYC, over 160-200 1.13-1.31 (benchmarks/floor.md,
"A verify's price over the context it meets").
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from specgen.decoding.probes import Probe

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_profile import cpu_flags  # noqa: E402  (the machine line every profile prints)
from outside_products import default_pair  # noqa: E402  (the pair as specgen loads it)


def ratios(target, draft, context: int, repeats: int) -> dict[str, float]:
    step = Probe(target, 1, context=context)
    verifies = {n: Probe(target, n, context=context, keep=0) for n in (2, 3, 5)}
    drafting = Probe(draft, 1, context=context, exact=False)
    turns: dict[str, list[float]] = {}
    for _ in range(repeats):
        before = step.seconds()
        timed = {f"{n}-token verify": probe.seconds() for n, probe in verifies.items()}
        unit = (before + step.seconds()) / 2
        drafting.seconds()
        drafting.seconds()
        timed["2-token verify after 2 draft steps"] = verifies[2].seconds()
        drafting.seconds()
        timed["step after a draft step"] = step.seconds()
        for name, seconds in timed.items():
            turns.setdefault(name, []).append(seconds / unit)
        turns.setdefault("step ms", []).append(unit * 1e3)
    return {name: statistics.median(values) for name, values in turns.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="32,160")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pair = default_pair()
    lines = [
        f"cpu: {cpu_flags()}",
        f"torch {torch.__version__}, threads {args.threads}, medians of {args.repeats}",
    ]
    for context in (int(c) for c in args.contexts.split(",")):
        measured = ratios(pair.target.model, pair.draft.model, context, args.repeats)
        lines.append(f"context {context}: " + ", ".join(f"{k} {v:.3f}" for k, v in measured.items()))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
