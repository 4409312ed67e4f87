"""An EAGLE-3 head's draft step against a target step (and the draft model's), on this machine.

    python benchmarks/eagle_cost.py HEAD_DIR [--target T] [--draft D] [--repeats 30]

Loads the target and the head as `specgen run --draft HEAD_DIR` does (every default: int8 linears
on a CPU), and the draft model as the default pair does, then times in turn, `--repeats` times,
one decode step of each over a 64-token context: the target's (one token, the lean forward the
loop calls), the head's (one token on its own output, as draft steps 2..k run) and the draft
model's. Prints the medians and the ratios to the target's step as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specgen.config import Method, ModelSettings
from specgen.decoding.costs import _Probe
from specgen.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specgen.models.eagle_head import HeadStep
from specgen.runtime import kvcache
from specgen.runtime.pair import load


class HeadProbe:
    def __init__(self, head, context: int = 64):
        self.head, self.context = head, context
        self.cache = kvcache.SlotCache(head.cache_config, rows=1)
        width = len(head.config.layers) * head.config.hidden_size
        feats = torch.randn(1, context, width) * 0.1
        self.step = HeadStep(head, widest=0)  # the head's forward as the drafter calls it, never buffered
        self.step.feed(feats)
        self.hidden = self.step.split(
            kvcache.forward(self.step, self.cache, torch.arange(100, 100 + context)[None], keep=1)
        )[1]
        self.token = torch.tensor([[300]])
        self.seconds()

    @torch.inference_mode()
    def seconds(self) -> float:
        started = time.perf_counter()
        self.step.feed(self.hidden)
        kvcache.forward(self.step, self.cache, self.token, keep=1)
        elapsed = time.perf_counter() - started
        kvcache.crop(self.cache, self.context)
        return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("head")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    auto = ModelSettings(args.target, args.head, "auto", None, "auto", "auto", "auto", "auto")
    pair = load(auto, Method.EAGLE, quiet=True)
    model_pair = load(
        ModelSettings(args.target, args.draft, "auto", None, "auto", "auto", "auto", "auto"),
        Method.CHAIN,
        quiet=True,
    )
    with torch.inference_mode():
        probes = {
            "target": _Probe(pair.target.model, 1, context=64),
            "head": HeadProbe(pair.draft.model),
            "draft model": _Probe(model_pair.draft.model, 1, context=64, exact=False),
        }
        times = {name: [] for name in probes}
        for _ in range(args.repeats):
            for name, probe in probes.items():
                times[name].append(probe.seconds())
    medians = {name: statistics.median(values) for name, values in times.items()}
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M"),
                "head": args.head,
                "head_weights": pair.draft.weights,
                "cpu_flags": [f for f in flags if f.startswith(("avx", "amx"))],
                "ms": {k: round(v * 1000, 3) for k, v in medians.items()},
                "in_target_steps": {k: round(v / medians["target"], 4) for k, v in medians.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
