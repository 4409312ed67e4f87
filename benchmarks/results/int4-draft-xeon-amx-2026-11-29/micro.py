"""The default draft's 24 layers' products at one row: torch's int8 dynamic kernel (what a
draft step uses today) against its int4 product (groups of 32, bf16 activations), with
distinct random weights per layer so that they stream from memory as in a step.
Throwaway measurement: `python micro.py`."""

import sys
from pathlib import Path

import torch

# the target's measurement's int4 packing and timing, reused
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "int4-target-xeon-amx-2026-11-29"))
from int4_products import median_ms, to_int4  # noqa: E402

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # qkv, o, gate/up, down
LAYERS = 24


def to_int8(w: torch.Tensor):
    scales = w.abs().amax(1) / 127
    q = torch.quantize_per_channel(w, scales, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, None)


def main() -> None:
    torch.manual_seed(0)
    weights = [[torch.randn(s) * 0.02 for s in SHAPES] for _ in range(LAYERS)]
    int8s = [[to_int8(w) for w in layer] for layer in weights]
    int4s = [[to_int4(w) for w in layer] for layer in weights]
    xs = [torch.randn(1, s[1]) for s in SHAPES]

    def step8():
        return [torch.ops.quantized.linear_dynamic(x, p, True) for layer in int8s for p, x in zip(layer, xs)]

    def step4():
        return [
            torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), p, 32, sz).float()
            for layer in int4s
            for (p, sz), x in zip(layer, xs)
        ]

    for _ in range(2):
        print(
            f"draft layers' products, 1 row, {LAYERS} distinct layers: "
            f"int8 dynamic {median_ms(step8, 9):.1f} ms, int4 {median_ms(step4, 9):.1f} ms"
        )


if __name__ == "__main__":
    main()
