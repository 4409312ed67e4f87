"""Where an EAGLE-3 round's time goes: the head's drafting phases under torch.profiler.

    python benchmarks/eagle_profile.py OUT.txt [--shape q7] [--k 1,2] [--compile inductor]
                                       [--acceptance BENCH.json:METHOD] [--device cuda|cpu]

A random-weight target of a real shape and a random EAGLE-3 head of its shape (as
benchmarks/gpu_speed.py builds them: nothing can be downloaded on a lent GPU machine), one
engine per k, rounds accepting what the recording accepted (synthetic acceptance). After a
warm-up generation, one generation of 128 tokens runs under torch.profiler with each of the
drafter's phases (catching up, gathering the target's features, the head's forwards, picking
tokens) marked, so the table shows each phase's host time per round beside the device time
of the kernels it queued. `--device cpu --shape tiny` is a smoke check of this script.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_speed  # noqa: E402

from specgen.config import GenerationConfig, Method  # noqa: E402
from specgen.decoding import synthetic  # noqa: E402
from specgen.decoding.drafters.eagle import EagleDrafter  # noqa: E402
from specgen.decoding.engine import Engine  # noqa: E402
from specgen.decoding.events import RoundResult  # noqa: E402

PHASES = ("propose", "_start", "_catch_up", "_features", "_forward", "_draft", "_sample")
DEFAULT_RECORDING = (
    "benchmarks/results/eagle-prompts-all-xeon-amx-2026-11-26/bench.json:eagle/k2@/work/heads/coder-1.5b"
)


def marked(cls) -> None:
    """Wrap each drafter phase in a profiler range named after it."""
    for name in PHASES:
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapper(*args, _original=original, _name=name, **kwargs):
            with record_function(f"eagle.{_name}"):
                return _original(*args, **kwargs)

        setattr(cls, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--shape", default="q7")
    parser.add_argument("--k", default="1,2")
    parser.add_argument("--compile", default="inductor")
    parser.add_argument("--acceptance", default=DEFAULT_RECORDING)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    gpu_speed.DEVICE = device = torch.device(args.device)
    acceptance = synthetic.parse(args.acceptance)
    model = gpu_speed.build(args.shape)
    head = gpu_speed.eagle_head(model)
    marked(EagleDrafter)
    prompt = torch.randint(
        100, min(150000, model.config.vocab_size), (64,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    lines = [
        f"# {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}, "
        f"shape {args.shape}, compile {args.compile}, acceptance {acceptance.source}"
    ]
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for k in (int(x) for x in args.k.split(",")):
        drafter = EagleDrafter(head, device, head.config.vocab_size, compile=args.compile)
        engine = Engine(model, device, frozenset(), 32768, drafter, compile=args.compile)
        config = GenerationConfig(
            method=Method.EAGLE, max_new_tokens=args.new, draft_tokens=k, acceptance=acceptance
        )

        def run(seed: int) -> list[RoundResult]:
            cfg = replace(config, acceptance=replace(acceptance, seed=seed))
            rounds = [r.event for r in engine.generate([prompt], cfg) if isinstance(r.event, RoundResult)]
            if device.type == "cuda":
                torch.cuda.synchronize()
            return rounds

        run(10**6)  # warm-up: compiles and captures the target's steps
        started = time.perf_counter()
        rounds = run(0)
        seconds = time.perf_counter() - started
        with profile(activities=activities) as prof:
            profiled = run(1)
        n = len(profiled)
        averages = prof.key_averages()
        lines.append(
            f"\n## k={k}: {len(rounds)} rounds, {1000 * seconds / len(rounds):.2f} ms per round unprofiled; "
            f"drafting {1000 * sum(r.draft_seconds for r in rounds) / len(rounds):.2f} ms, verifying "
            f"{1000 * sum(r.verify_seconds for r in rounds) / len(rounds):.2f} ms (host clock)"
        )
        lines.append(
            "phase: host ms per round (incl. children), device ms per round of the kernels it queued"
        )
        for event in averages:
            if event.key.startswith("eagle."):
                device_us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
                lines.append(
                    f"  {event.key:18s} calls/round {event.count / n:5.2f}  "
                    f"host {event.cpu_time_total / 1000 / n:7.3f}  device {device_us / 1000 / n:7.3f}"
                )
        lines.append(averages.table(sort_by=sort, row_limit=30))
        syncs = [
            e
            for e in averages
            if "Synchronize" in e.key or e.key in ("aten::item", "aten::_local_scalar_dense")
        ]
        lines.append("syncs per round: " + ", ".join(f"{e.key} {e.count / n:.2f}" for e in syncs))
    text = "\n".join(lines)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
