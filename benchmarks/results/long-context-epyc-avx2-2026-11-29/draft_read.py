"""How long the default pair's draft takes to read a prompt of 69, 512 and 1,700 tokens, fed in
256-token chunks as a CPU drafter's catch-up feeds it (two passes, in the order printed)."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from outside_products import default_pair  # noqa: E402

from specgen.runtime import kvcache  # noqa: E402
from specgen.runtime.lean import call_for  # noqa: E402

torch.set_num_threads(2)
model = default_pair().draft.model
call = call_for(model, False)
with torch.inference_mode():
    prompt = (torch.arange(1000, 1000 + 1700)[None] * 7) % 30000
    kvcache.forward(call, kvcache.new_cache(model), prompt[:, :64], keep=1)
    for n in (69, 512, 1700, 512, 69, 1700):
        cache = kvcache.new_cache(model)
        started = time.perf_counter()
        for start in range(0, n, 256):
            kvcache.forward(call, cache, prompt[:, start : min(n, start + 256)], keep=1)
        print(n, f"tokens: {time.perf_counter() - started:.2f} s", flush=True)
