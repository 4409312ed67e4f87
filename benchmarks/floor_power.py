"""How many rounds a row needs before its own measurements can tell a small loss from plain decoding.

    python benchmarks/floor_power.py --prompts FILE [--ids a,b] [--methods chain,lookup-chain]
                                     [-n 64] [--turns 3] [--out FILE]

The floor (specgen/decoding/floor.py) lowers a row's draft only on a clear loss: the mean of its
rounds' speed-ups plus its standard error below 1. A round's speed-up is its tokens times a
plain step over its seconds, and rounds spread widely (a round commits 1 to k + 1 tokens), so
a loss of a few percent needs many rounds to be clear. This script measures that spread on real
prompts. The default pair as `specgen` loads it, greedy, every default, in one process: for each
prompt, `--turns` turns of plain decoding and each method, in alternating order. For each
speculative run it prints:
- the run's speed-up over its rounds (tokens x plain step / the rounds' seconds; the plain step
  is the median round of the plain runs of that prompt) and over the wall time against the
  plain run of the same turn;
- the standard deviation of one round's speed-up, and the rounds it would take for the mean of
  such rounds to differ from 1 by one standard error: (sd / (1 - mean))^2. A run with fewer
  rounds than that cannot show its loss (or gain) as clear to any per-row estimate of this kind.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from specgen.bench.prompts import encode, read_prompt_file
from specgen.config import GenerationConfig, Method, ModelSettings
from specgen.decoding.build import build_engine, resolve_draft_length
from specgen.decoding.events import RoundResult
from specgen.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specgen.runtime.pair import load

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_profile import cpu_flags  # noqa: E402  (the machine line every profile prints)


def generate(pair, ids: list[int], method: Method, tokens: int):
    """(wall seconds, new tokens, rounds as (proposed, committed, seconds)) of one generation."""
    config, _ = resolve_draft_length(
        pair,
        GenerationConfig(
            method=method, max_new_tokens=tokens, device_draft_tokens=True, device_confidence=True
        ),
    )
    pair.memories.clear()  # lookup drafts from this generation's text only, as in bench
    engine = build_engine(pair, config)
    rounds = []
    started = time.perf_counter()
    for report in engine.generate([ids], config):
        event = report.event
        if isinstance(event, RoundResult):
            seconds = event.draft_seconds + event.verify_seconds
            rounds.append((len(event.draft_tokens), len(event.emitted), seconds))
    wall = time.perf_counter() - started
    return wall, sum(r[1] for r in rounds), rounds


def summary(rounds, plain: float) -> tuple[float, float, float, int]:
    """(speed-up over the rounds, sd of one round's, rounds to one standard error, rounds)."""
    ratios = [tokens * plain / seconds for _, tokens, seconds in rounds if seconds > 0]
    mean = sum(t for _, t, _ in rounds) * plain / sum(s for _, _, s in rounds)
    spread = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    needed = (spread / (1 - mean)) ** 2 if abs(1 - mean) > 1e-9 else float("inf")
    return mean, spread, needed, len(ratios)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--ids", default="")
    parser.add_argument("--methods", default="chain,lookup-chain")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    records = read_prompt_file(Path(args.prompts))
    if args.ids:
        wanted = args.ids.split(",")
        records = [r for r in records if str(r.id) in wanted]
    methods = [Method.parse(m) for m in args.methods.split(",")]
    pair = load(
        ModelSettings(DEFAULT_TARGET, DEFAULT_DRAFT, draft_quant="auto", target_quant="auto"),
        Method.CHAIN,
        quiet=True,
    )
    lines = [f"cpu: {cpu_flags()}", f"torch {torch.__version__}, threads {torch.get_num_threads()}", ""]
    lines.append("prompt method turn: rounds, speed-up over rounds, wall vs plain, sd of a round, needed")
    print("\n".join(lines), flush=True)
    for record in records:
        ids = encode(pair.target.tokenizer, record)
        runs: dict[Method, list] = {}
        for turn in range(args.turns):
            order = [Method.PLAIN, *methods]
            for method in order if turn % 2 == 0 else order[::-1]:
                runs.setdefault(method, []).append(generate(pair, ids, method, args.max_new_tokens))
        plain = statistics.median(s for _, _, rounds in runs[Method.PLAIN] for _, _, s in rounds)
        for method in methods:
            for turn, (wall, tokens, rounds) in enumerate(runs[method]):
                mean, spread, needed, count = summary(rounds, plain)
                plain_wall, plain_tokens, _ = runs[Method.PLAIN][turn]
                wall_ratio = (tokens / wall) / (plain_tokens / plain_wall)
                lines.append(
                    f"{record.id} {method.value} {turn}: {count} rounds, {mean:.3f}x over rounds, "
                    f"{wall_ratio:.3f}x wall, sd {spread:.2f}, needed {needed:.0f}"
                )
                print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
