"""The target's step over a long context: K/V held in float64 (today) against float32 (before).

    python benchmarks/context_steps.py [--contexts 200,600,1000,1600] [--widths 1,6] [--rounds 4]

The default pair's int8 target as `specgen` loads it, through the lean forward the decode loop
calls, its attention `exact_attention`'s float64 one. For each context and width, two caches
hold the same prompt: one keeps K/V in float64 (`SlotCache.held_dtype`, what specgen does), the
other in float32, as specgen did before, so that every layer of every step converted the whole
prefix to float64. The two take turns (ABBA over `--rounds`, five forwards a turn), so that the
VM's drift costs both the same; each line gives the medians, their ratio and whether the two
caches' logits are bitwise equal (they must be: the values held are the same float32 ones).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from specgen.runtime import kvcache
from specgen.runtime.lean import call_for

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_profile import cpu_flags  # noqa: E402
from outside_products import default_pair  # noqa: E402


def stepper(model, width: int, context: int, float32: bool):
    """One forward of `width` tokens over a `context`-token cache, cropped back after each."""
    call = call_for(model, True)
    cache = kvcache.new_cache(model)
    if float32:  # the cache as it was: K/V in the model's dtype
        cache.held_dtype = lambda key_states: key_states.dtype
    prompt = (torch.arange(1000, 1000 + context)[None] * 7) % 30000
    kvcache.forward(call, cache, prompt, keep=1)
    tokens = torch.arange(2000, 2000 + width)[None]

    def step():
        logits = kvcache.forward(call, cache, tokens, keep=width)
        kvcache.crop(cache, context)
        return logits

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="200,600,1000,1600")
    parser.add_argument("--widths", default="1,6")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pair = default_pair()
    print(f"cpu: {cpu_flags()}; torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("context  width  float32 held (ms)  float64 held (ms)  ratio  equal")
    with torch.inference_mode():
        for context in (int(c) for c in args.contexts.split(",")):
            for width in (int(w) for w in args.widths.split(",")):
                old = stepper(pair.target.model, width, context, float32=True)
                new = stepper(pair.target.model, width, context, float32=False)
                equal = torch.equal(old(), new())
                walls: dict[str, list[float]] = {"old": [], "new": []}
                for turn in range(args.rounds):
                    order = [("old", old), ("new", new)]
                    for name, step in order if turn % 2 == 0 else order[::-1]:
                        for _ in range(5):
                            started = time.perf_counter()
                            step()
                            walls[name].append(time.perf_counter() - started)
                before, after = (statistics.median(walls[k]) * 1e3 for k in ("old", "new"))
                ratio = after / before
                print(
                    f"{context:7d}  {width:5d}  {before:17.1f}  {after:17.1f}  {ratio:5.3f}  {equal}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
