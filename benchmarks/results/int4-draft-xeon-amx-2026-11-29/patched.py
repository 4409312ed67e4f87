"""specgen with the draft's single-row int8 products replaced by torch's int4 product
(groups of 32, bf16 activations): SPECGEN_INT4_DRAFT=1 patches, anything else runs unpatched.
Throwaway measurement: python patched.py bench ..."""

import os
import sys
import time

import torch

from specgen.cli.app import main
from specgen.runtime import lean

GROUP = 32
CACHE: dict[int, tuple] = {}
PACK_SECONDS = [0.0]


def _int4_of(packed):
    key = id(packed)
    if key not in CACHE:
        start = time.perf_counter()
        parts = packed if isinstance(packed, tuple) else (packed,)
        w = torch.cat([torch.ops.quantized.linear_unpack(p)[0].dequantize() for p in parts], 0).float()
        n, k = w.shape
        if n % 16:  # the kernel's packing needs N in multiples of 16: this one stays int8
            CACHE[key] = None
            return None
        wg = w.reshape(n, k // GROUP, GROUP)
        low, high = wg.amin(-1), wg.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-8)
        q = ((wg - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
        sz = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous().bfloat16()
        CACHE[key] = (torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2), sz, packed)
        PACK_SECONDS[0] += time.perf_counter() - start
    return CACHE[key]


_original = lean._one_row_or_rows


def _one_row_int4(x, packed, bias, wide=None):
    if x.numel() != x.shape[-1] or x.dtype != torch.float32 or x.shape[-1] % GROUP:
        return _original(x, packed, bias, wide)
    packed4 = _int4_of(packed)
    if packed4 is None:
        return _original(x, packed, bias, wide)
    q, sz, _ = packed4
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(1, -1).bfloat16(), q, GROUP, sz)
    out = out.float().reshape(*x.shape[:-1], -1)
    return out if bias is None else out.add_(bias)


if os.environ.get("SPECGEN_INT4_DRAFT") == "1":
    lean._one_row_or_rows = _one_row_int4
    import atexit

    def _report() -> None:
        packed = sum(v is not None for v in CACHE.values())
        print(f"int4 draft: {packed} of {len(CACHE)} products, {PACK_SECONDS[0]:.1f} s", file=sys.stderr)

    atexit.register(_report)

sys.argv[0] = "specgen"
main()
