"""Share of each round spent outside the two models' forwards (the decode loop's own cost).

    python benchmarks/loop_overhead.py [--methods chain,lookup,rsd-c] [-n 48] [--draft-quant int8+prune]

Wraps the target's and the draft's `forward` with wall-clock timers, decodes the quick prompt
set with each method through the same Engine `specgen run` uses, and reports per method:
decode time (after prefill), time inside target forwards, inside draft forwards, and the
rest: acceptance rules, sampling, cache crops and compaction, tree building, host syncs,
Python bookkeeping. torch ops launched by the loop run synchronously on the CPU, so the
split is exact there (on CUDA it would need a synchronize in the timers).
"""

from __future__ import annotations

import argparse
import time

from specgen.bench.prompts import encode, load_prompts
from specgen.config import GenerationConfig, Method, ModelSettings
from specgen.decoding.build import build_engine
from specgen.decoding.events import Joined, RoundResult
from specgen.runtime.pair import load


class Timed:
    def __init__(self, model):
        self.model, self.seconds, self.calls = model, 0.0, 0
        self.inner = model.forward

        def forward(*args, **kwargs):
            started = time.perf_counter()
            try:
                return self.inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1

        model.forward = forward

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", default="plain,chain,lookup,rsd-c,rsd-s")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=48)
    parser.add_argument("--draft-quant", default="auto")
    args = parser.parse_args()
    pair = load(
        ModelSettings(
            "qwen2.5-coder-1.5b-instruct",
            "qwen2.5-coder-0.5b-instruct",
            "cpu",
            None,
            "auto",
            args.draft_quant,
        ),
        Method.CHAIN,
        quiet=True,
    )
    target, draft = Timed(pair.target.model), Timed(pair.draft.model)
    prompts = [encode(pair.target.tokenizer, p) for p in load_prompts("quick")]
    print(
        f"default pair, draft-quant {args.draft_quant}, quick set ({len(prompts)} prompts), "
        f"{args.max_new_tokens} new tokens, greedy"
    )
    print(
        f"{'method':<12}{'decode s':>10}{'target s':>10}{'draft s':>10}"
        f"{'outside s':>11}{'outside':>9}{'rounds':>8}"
    )
    for name in args.methods.split(","):
        method = Method(name)
        config = GenerationConfig(method=method, max_new_tokens=args.max_new_tokens)
        engine = build_engine(pair, config)
        decode = in_target = in_draft = 0.0
        rounds = 0
        for ids in prompts:
            for report in engine.generate([ids], config):
                if isinstance(report.event, Joined):  # prefill done: the round loop starts here
                    t0, d0 = target.seconds, draft.seconds
                    started = time.perf_counter()
                elif isinstance(report.event, RoundResult):
                    rounds += 1
            decode += time.perf_counter() - started
            in_target += target.seconds - t0
            in_draft += draft.seconds - d0
        outside = decode - in_target - in_draft
        print(
            f"{name:<12}{decode:>10.2f}{in_target:>10.2f}{in_draft:>10.2f}{outside:>11.3f}"
            f"{outside / decode:>9.2%}{rounds:>8}"
        )


if __name__ == "__main__":
    main()
