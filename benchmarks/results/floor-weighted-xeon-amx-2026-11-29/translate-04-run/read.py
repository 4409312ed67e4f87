"""The draft's prompt read: one forward of N prompt tokens into a fresh cache (what a chain
round's catch-up does for a new row), and the target's, as `specgen run` loads the pair
(fbgemm only for a short answer) or as bench, chat and serve load it (oneDNN for wide products
too). Throwaway measurement: python read.py fbgemm|onednn"""

import sys
import time

import torch

from specgen.config import Method, ModelSettings
from specgen.runtime import kvcache, onednn
from specgen.runtime.lean import call_for
from specgen.runtime.pair import load


def main() -> None:
    mode = sys.argv[1]
    torch.set_num_threads(2)
    settings = ModelSettings(
        "qwen2.5-coder-1.5b-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "cpu",
        None,
        "auto",
        "auto",
        "off",
        target_quant="int8",
    )
    started = time.perf_counter()
    if mode == "fbgemm":
        with onednn.fbgemm_only():
            pair = load(settings, Method.CHAIN, quiet=True)
    else:
        pair = load(settings, Method.CHAIN, quiet=True)
    print(f"{mode}: load {time.perf_counter() - started:.1f} s")
    for role, loaded, exact in (("draft", pair.draft, False), ("target", pair.target, True)):
        call = call_for(loaded.model, exact)
        for n in (1, 2, 16, 69, 200):
            times = []
            for _ in range(5):
                cache = kvcache.new_cache(loaded.model)
                ids = torch.arange(1000, 1000 + n)[None]
                started = time.perf_counter()
                kvcache.forward(call, cache, ids, keep=1)
                times.append(time.perf_counter() - started)
            times.sort()
            print(f"{mode} {role} read of {n:3d} tokens: {times[2] * 1e3:7.1f} ms (min {times[0] * 1e3:.1f})")


if __name__ == "__main__":
    main()
