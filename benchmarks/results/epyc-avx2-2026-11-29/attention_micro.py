"""Decode-sized attention on the CPU: today's exact attention (float64 SDPA, the flash kernel)
against three ops in float64 (scores, softmax, weighted sum), and the draft's float32 SDPA
against the same three ops in float32. Run from the repository root; prints what
attention_micro.txt holds."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from specgen.runtime.exact_attention import grouped_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from outside_products import median_ms  # noqa: E402  (the timer of the step measurements)

torch.set_num_threads(2)


def three_ops(query, key, value, mask, scale):
    """grouped_attention's arithmetic (queries of a K/V head stacked), as three ops in float64."""
    b, heads, n, dim = query.shape
    groups = key.shape[1]
    rep = heads // groups
    q = query.reshape(b, groups, rep * n, dim).double()
    mask = mask.expand(b, 1, n, mask.shape[-1])[:, :, None].expand(b, 1, rep, n, mask.shape[-1])
    mask = mask.reshape(b, 1, rep * n, mask.shape[-1])
    scores = torch.matmul(q, key.double().transpose(-1, -2)).mul_(scale)
    scores.masked_fill_(~mask, torch.finfo(torch.float64).min)
    out = torch.matmul(scores.softmax(-1), value.double())
    return out.reshape(b, heads, n, dim).float().transpose(1, 2).contiguous()


def three_ops_float32(q, k, v, mask, scale):
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    scores.masked_fill_(~mask, torch.finfo(torch.float32).min)
    return torch.matmul(scores.softmax(-1), v)


def tensors(shapes):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=generator) for shape in shapes]


def median_us(call) -> float:
    return median_ms(call, repeats=300) * 1e3


def main() -> None:
    for heads, groups, dim, length, n in [
        (12, 2, 128, 200, 1),
        (12, 2, 128, 200, 6),
        (12, 2, 128, 600, 1),
        (12, 2, 128, 600, 6),
        (12, 2, 128, 200, 17),
    ]:
        q, k, v = tensors([(1, heads, n, dim), (1, groups, length, dim), (1, groups, length, dim)])
        mask = torch.ones(1, 1, n, length, dtype=torch.bool).tril(length - n)
        args = (q, k, v, mask, dim**-0.5)
        flash, ops = grouped_attention(*args), three_ops(*args)
        t_flash = median_us(lambda: grouped_attention(*args))
        t_ops = median_us(lambda: three_ops(*args))
        print(
            f"target-like H{heads}/{groups} D{dim} L{length} n{n}: flash64 {t_flash:.1f} us, "
            f"matmul64 {t_ops:.1f} us, x{t_flash / t_ops:.2f}; max diff "
            f"{(flash - ops).abs().max().item():.1e} bitwise {torch.equal(flash, ops)}"
        )
    for heads, groups, dim, length in [(14, 2, 64, 200), (14, 2, 64, 600)]:
        # one query as the lean forward's _sdpa passes it: a K/V head's query heads stacked
        q, k, v = tensors(
            [(1, groups, heads // groups, dim), (1, groups, length, dim), (1, groups, length, dim)]
        )
        mask = torch.ones(1, 1, 1, length, dtype=torch.bool)
        scale = dim**-0.5
        sdpa = torch.nn.functional.scaled_dot_product_attention
        diff = (sdpa(q, k, v, attn_mask=mask, scale=scale) - three_ops_float32(q, k, v, mask, scale)).abs()
        t_sdpa = median_us(lambda: sdpa(q, k, v, attn_mask=mask, scale=scale))
        t_ops = median_us(lambda: three_ops_float32(q, k, v, mask, scale))
        print(
            f"draft-like H{heads}/{groups} D{dim} L{length} n1: sdpa32 {t_sdpa:.1f} us, "
            f"matmul32 {t_ops:.1f} us; max diff {diff.max().item():.1e}"
        )


if __name__ == "__main__":
    main()
