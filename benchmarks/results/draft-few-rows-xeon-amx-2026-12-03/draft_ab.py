"""The draft's forward at widths 1-5 over a 200-token cache: K/V heads repeated for a wider
forward (as transformers does) against a group's heads stacked as queries (no K/V copy), and
row_linear against fbgemm's dynamic kernel for few rows. Variants take turns; medians."""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from draft_reads import MODELS
from torch import nn

from specgen.config import Method
from specgen.runtime import kvcache, lean
from specgen.runtime.pair import load


def old_sdpa(q, k, v, mask, scale, rep):
    b, heads, n, dim = q.shape
    if rep > 1:
        if n == 1:
            q = q.reshape(b, heads // rep, rep, dim)
            if mask.shape[1] != 1:
                mask = mask.reshape(b, heads // rep, rep, mask.shape[-1])
        else:
            k = k[:, :, None].expand(b, k.shape[1], rep, *k.shape[2:]).reshape(b, heads, *k.shape[2:])
            v = v[:, :, None].expand(b, v.shape[1], rep, *v.shape[2:]).reshape(b, heads, *v.shape[2:])
    out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale)
    return out.reshape(b, heads, n, dim).transpose(1, 2)


new_sdpa = lean._sdpa
context = int(sys.argv[1]) if len(sys.argv) > 1 else 200
torch.set_num_threads(2)
pair = load(MODELS, Method.CHAIN, quiet=True)
model = pair.draft.model
call = lean.LeanForward(model, exact=False)
cache = kvcache.new_cache(model)
prompt = torch.arange(1000, 1000 + context)[None]
with torch.inference_mode():
    kvcache.forward(call, cache, prompt, keep=1)
variants = {
    "repeat kv, 1 shared": (old_sdpa, 1),
    "stacked, 1 shared": (new_sdpa, 1),
    "stacked, 4 shared": (new_sdpa, 4),
    "stacked, 8 shared": (new_sdpa, 8),
}
times = {(v, w): [] for v in variants for w in (1, 2, 3, 5)}
outs = {}
for r in range(12):
    for name, (sdpa, rows) in variants.items() if r % 2 == 0 else reversed(variants.items()):
        lean._sdpa, lean.SHARED_SCALE_ROWS = sdpa, rows
        for w in (1, 2, 3, 5):
            tokens = torch.arange(2000, 2000 + w)[None]
            with torch.inference_mode():
                s = time.perf_counter()
                logits = kvcache.forward(call, cache, tokens, keep=1)
                times[(name, w)].append((time.perf_counter() - s) * 1e3)
                kvcache.crop(cache, context)
            outs[(name, w)] = logits
print(f"draft forward over a {context}-token cache, ms (median of 12)")
for name in variants:
    print(f"{name:24}" + "  ".join(f"w{w} {statistics.median(times[(name, w)]):6.1f}" for w in (1, 2, 3, 5)))
for w in (2, 3, 5):
    a, b = outs[("repeat kv, 1 shared", w)], outs[("stacked, 1 shared", w)]
    same = bool((outs[("stacked, 4 shared", w)].argmax(-1) == b.argmax(-1)).all())
    print(f"w{w}: stacked == repeated bitwise: {torch.equal(a, b)}; 4 shared argmax same: {same}")
