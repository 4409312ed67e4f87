"""specgen with the draft's single-row int8 products replaced by torch's int4 product
(groups of 32, bf16 activations): SPECGEN_INT4_DRAFT=1 patches, anything else runs unpatched.
Throwaway measurement: python patched.py bench ..."""

import os
import sys
import time
from pathlib import Path

import torch

from specgen.cli.app import main
from specgen.runtime import int8, lean

# the int4 packing the target's measurement used, groups of 32 with a scale and a zero each
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "int4-target-xeon-amx-2026-11-29"))
from int4_products import to_int4  # noqa: E402

GROUP = 32
CACHE: dict[int, tuple | None] = {}
PACK_SECONDS = [0.0]


def _int4_of(packed):
    key = id(packed)
    if key not in CACHE:
        start = time.perf_counter()
        w = int8._unpacked(packed).float()  # the int8 rows, dequantized
        # the kernel's packing needs N in multiples of 16: such a product stays int8
        CACHE[key] = None if w.shape[0] % 16 else to_int4(w, GROUP)
        PACK_SECONDS[0] += time.perf_counter() - start
    return CACHE[key]


_original = lean._one_row_or_rows


def _one_row_int4(x, packed, bias, wide=None):
    if x.numel() != x.shape[-1] or x.dtype != torch.float32 or x.shape[-1] % GROUP:
        return _original(x, packed, bias, wide)
    packed4 = _int4_of(packed)
    if packed4 is None:
        return _original(x, packed, bias, wide)
    q, sz = packed4
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
