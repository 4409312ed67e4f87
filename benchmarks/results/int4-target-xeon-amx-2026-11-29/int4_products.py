"""torch's CPU int4 product (`_weight_int4pack_mm_for_cpu`, bf16 activations, groups of 32
with a scale and a zero each) against specgen's int8 row product, on the default target's
linear shapes, and whether the int4 product is row-exact. Throwaway measurement, kept as the
command behind int8-kernels.md's int4 section: `python int4_products.py`.

The same four weights serve all 28 "layers" here, so they stay in the caches: this flatters
the smaller int4 weights (see the end-to-end figures in int8-kernels.md)."""

import time

import torch

from specgen.runtime import int8

SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]  # qkv, o, gate/up, down
LAYERS = 28


def to_int4(w: torch.Tensor, group: int = 32):
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    low, high = wg.amin(-1), wg.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = ((wg - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    scales_zeros = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous().bfloat16()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2), scales_zeros


def int4_mm(x, packed, scales_zeros, group: int = 32):
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)


def median_ms(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e3


def main() -> None:
    torch.manual_seed(0)
    weights = [torch.randn(s) * 0.02 for s in SHAPES]
    int8s = [int8.linear_of(w) for w in weights]
    int4s = [to_int4(w) for w in weights]
    for rows in (1, 2, 6):
        xs = [torch.randn(rows, s[1]) for s in SHAPES]
        step8 = median_ms(lambda: [lin(x) for _ in range(LAYERS) for lin, x in zip(int8s, xs)])
        step4 = median_ms(
            lambda: [int4_mm(x.bfloat16(), p, sz) for _ in range(LAYERS) for (p, sz), x in zip(int4s, xs)]
        )
        print(f"{rows} rows: int8 {step8:.1f} ms, int4 {step4:.1f} ms")
    packed, scales_zeros = int4s[2]
    for rows in (1, 2, 3, 4, 5, 6, 8, 12, 16, 32):
        x = torch.randn(rows, 1536).bfloat16()
        print(f"gate/up, {rows} rows: int4 {median_ms(lambda: int4_mm(x, packed, scales_zeros), 9):.2f} ms")
    x = torch.randn(9, 1536).bfloat16()
    full = int4_mm(x, packed, scales_zeros)
    exact = all(torch.equal(full[:m], int4_mm(x[:m], packed, scales_zeros)) for m in range(1, 9))
    print(f"row-exact (each prefix of 9 rows alone equals its rows among 9): {exact}")


if __name__ == "__main__":
    main()
