"""Attention whose result for a query does not depend on how many queries share the forward.

torch's CPU flash-attention kernel blocks its work by the number of queries and keys, so the
same token attends with a last-bit difference in a 1-token step, a 5-token verify and a
300-token prefill (measured: 1.2e-7). With fp32 linears that difference stays in the last bits;
in front of int8 linears (whose activations are quantized per row) it can move an activation
across a rounding step and change a logit. So on the CPU every forward's attention runs here
in float64 and is rounded to float32: the blocking differences then sit ~1e-16 below the value
and survive the rounding only with a probability of about 1e-9 per element. A token's K/V and
logits are then the same whether it was prefilled with its whole prompt, in chunks, after a
prefix the prefix store gave back, in a chat turn's kept cache or in a verify: the server's
caches cannot change a greedy answer. Long prefills attend a block of queries at a time to the
keys that block can see: a 300-3000-token prefill of the 1.5B target costs 0-22% more than with
fp32 SDPA (benchmarks/exactness.md, "what exact prefill attention costs"). A SlotCache in front
of this attention keeps its K/V in float64 (`SlotCache.held_dtype`): the values are the float32
ones, converted once when written rather than in every layer of every step, so the arithmetic
is the same and a step over a long context reads no conversions.

Families whose attention is not SDPA's arithmetic keep theirs, in float64: Gemma 2's logit
softcap and gpt-oss's attention sinks (`eager_attention`).

`use_exact_attention(model)` switches a loaded model through transformers' public
AttentionInterface / AttentionMaskInterface registries and `set_attn_implementation`.
"""

from __future__ import annotations

import sys

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "specgen_exact"
_registered = False


def _attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
):
    exact = query.device.type == "cpu" and query.dtype == torch.float32
    # Gemma 2's logit softcap, gpt-oss's sinks: eager's arithmetic
    if softcap is not None or s_aux is not None:
        if not exact:
            eager = sys.modules[type(module).__module__].eager_attention_forward
            return eager(
                module,
                query,
                key,
                value,
                attention_mask,
                dropout=dropout,
                scaling=scaling,
                softcap=softcap,
                s_aux=s_aux,
                **kwargs,
            )
        return eager_attention(query, key, value, attention_mask, scaling, softcap, s_aux), None
    if not exact:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if attention_mask is None:  # a forward without our cache's explicit mask: causal from transformers
        out, weights = sdpa_attention_forward(
            module,
            query.double(),
            key.double(),
            value.double(),
            None,
            dropout=dropout,
            scaling=scaling,
            **kwargs,
        )
        return out.float(), weights
    return grouped_attention(query, key, value, attention_mask, scaling), None


QUERY_BLOCK = 256  # a longer forward attends this many queries at a time, each block to the keys it can see


def _blocks(mask: torch.Tensor | None, n: int, length: int) -> list[tuple[int, int, int]]:
    """(first query, end query, keys to read) per block: a block reads keys up to the last one
    any of its queries sees (a prefill's causal mask leaves half the keys unread on average).
    Decode-sized forwards are one block over every key, with no host sync."""
    if n <= QUERY_BLOCK or mask is None:
        return [(0, n, length)]
    visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    seen = visible.reshape(-1, n, length).any(0)  # [n, L]
    blocks = []
    for start in range(0, n, QUERY_BLOCK):
        end = min(n, start + QUERY_BLOCK)
        columns = seen[start:end].any(0).nonzero()
        blocks.append((start, end, int(columns[-1]) + 1 if columns.numel() else 1))
    return blocks


def grouped_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """SDPA in float64 with the query heads that share a K/V head stacked as that head's queries.

    query [b, H, n, D], key/value [b, KV, L, D], mask [b, 1 or H, n, L] (bool or additive) ->
    [b, n, H, D] float32. Stacking ([b, KV, H/KV * n, D]) is what transformers does for one
    query (`pack_gqa`); doing it for every width means the keys are read (and converted) once
    per K/V head instead of being repeated for every query head (a verify's attention otherwise
    costs several times a step's: benchmarks/code-choices.md)."""
    n, length = query.shape[2], key.shape[2]
    parts = [
        _grouped(
            query[:, :, start:end], key[:, :, :keys], value[:, :, :keys], mask[:, :, start:end, :keys], scale
        )
        for start, end, keys in _blocks(mask, n, length)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _grouped(query, key, value, mask, scale) -> torch.Tensor:
    b, heads, n, dim = query.shape
    groups = key.shape[1]
    rep = heads // groups
    q = query.reshape(b, groups, rep * n, dim).double()
    if mask.dtype != torch.bool:
        mask = mask.double()
    if mask.shape[1] == 1:
        mask = mask.expand(b, 1, n, mask.shape[-1])[:, :, None].expand(b, 1, rep, n, mask.shape[-1])
        mask = mask.reshape(b, 1, rep * n, mask.shape[-1])
    else:
        mask = mask.expand(b, heads, n, mask.shape[-1]).reshape(b, groups, rep * n, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key.double(), value.double(), attn_mask=mask, scale=scale
    )
    return out.reshape(b, heads, n, dim).float().transpose(1, 2).contiguous()


def eager_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' eager attention (Gemma 2's softcap: tanh(w / c) * c before the mask;
    gpt-oss's per-head sink logit beside the keys, dropped after the softmax) in float64,
    rounded to float32, a block of queries at a time. -> [b, n, H, D]"""
    b, heads, n, dim = query.shape
    rep = heads // key.shape[1]
    if mask is None:  # transformers' SDPA mask skipped: causal, the queries the last n positions
        length = key.shape[2]
        mask = torch.ones(n, length, dtype=torch.bool, device=query.device).tril(length - n)[None, None]
    elif mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2  # an additive mask's visible entries
    out = []
    for start, end, keys in _blocks(mask, n, key.shape[2]):
        k = key[:, :, :keys].double().repeat_interleave(rep, dim=1)
        weights = query[:, :, start:end].double() @ k.transpose(2, 3) * scale
        if softcap is not None:
            weights = torch.tanh(weights / softcap) * softcap
        weights = weights.masked_fill(~mask[:, :, start:end, :keys], torch.finfo(torch.float64).min)
        if sinks is not None:
            sink = sinks.double().reshape(1, -1, 1, 1).expand(b, heads, end - start, 1)
            weights = torch.cat([weights, sink], dim=-1)
            weights = (weights - weights.amax(-1, keepdim=True)).softmax(-1)[..., :-1]
        else:
            weights = weights.softmax(-1)
        out.append(weights @ value[:, :, :keys].double().repeat_interleave(rep, dim=1))
    return torch.cat(out, dim=2).float().transpose(1, 2).contiguous()


def _register() -> None:
    global _registered
    if not _registered:
        AttentionInterface.register(NAME, _attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True


def use_exact_attention(model) -> None:
    _register()
    model.set_attn_implementation(NAME)
