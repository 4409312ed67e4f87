"""What exact attention costs a prefill: the int8 target's prompt forward with its attention in
float64 (exact_attention.grouped_attention, a query block at a time) against torch's fp32 SDPA
(what prefills of more than 64 queries used before every width became exact).

    python benchmarks/exact_prefill.py [--lengths 300,1000,3000] [--repeats 3]

Runs the default target on the CPU's default path (int8 linears, lean forward), alternating
the two attentions, and prints the median seconds per prompt length and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import specgen.runtime.lean as lean
from specgen.config import Method, ModelSettings
from specgen.models.catalog import DEFAULT_TARGET
from specgen.runtime import kvcache
from specgen.runtime.pair import load


def fp32(q, k, v, mask, scale):
    return lean._sdpa(q, k, v, mask, scale, q.shape[1] // k.shape[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="300,1000,3000")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    pair = load(ModelSettings(DEFAULT_TARGET, None, target_quant="auto"), Method.PLAIN, quiet=True)
    model = pair.target.model
    call = lean.call_for(model)
    exact = lean.grouped_attention
    print(f"target {pair.target.name}, weights {pair.target.weights}, {torch.get_num_threads()} threads")
    for n in (int(x) for x in args.lengths.split(",")):
        ids = torch.randint(
            0, model.config.vocab_size - 1000, (1, n), generator=torch.Generator().manual_seed(n)
        )
        seconds = {"fp32 SDPA": [], "exact (float64)": []}
        for _ in range(args.repeats):
            for name, attention in (("fp32 SDPA", fp32), ("exact (float64)", exact)):
                lean.grouped_attention = attention
                cache = kvcache.SlotCache(model.config, rows=1)
                started = time.perf_counter()
                kvcache.forward(call, cache, ids, keep=1)
                seconds[name].append(time.perf_counter() - started)
        lean.grouped_attention = exact
        base, new = (statistics.median(v) for v in seconds.values())
        print(
            f"{n:5d} tokens: fp32 SDPA {base:.2f} s, exact {new:.2f} s, ratio {new / base:.3f} "
            f"(runs: {', '.join(f'{a:.2f}/{b:.2f}' for a, b in zip(*seconds.values()))})",
            flush=True,
        )


if __name__ == "__main__":
    main()
