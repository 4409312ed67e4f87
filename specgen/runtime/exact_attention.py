"""Attention whose result for a query does not depend on how many queries share the forward.

torch's CPU flash-attention kernel blocks its work by the number of queries and keys, so the
same token attends with a last-bit difference in a 1-token step and in a 5-token verify
(measured: 1.2e-7). With fp32 linears that difference stays in the last bits; in front of
int8 linears it can move an activation across a rounding step and change a logit. For
decode-sized forwards (up to `EXACT_WIDTH` queries) this runs the same SDPA in float64 and
rounds the result to float32: the blocking differences then sit ~1e-16 below the value and
survive the rounding only with a probability of about 1e-9 per element. Prefill-sized
forwards (the same prompt for every method) keep the fast float32 kernel.

`use_exact_attention(model)` switches a loaded model through transformers' public
AttentionInterface / AttentionMaskInterface registries and `set_attn_implementation`.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "specgen_exact"
EXACT_WIDTH = 64
_registered = False


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
               **kwargs):
    if query.device.type != "cpu" or query.shape[2] > EXACT_WIDTH or query.dtype != torch.float32:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if attention_mask is None:  # a forward without our cache's explicit mask: causal from transformers
        out, weights = sdpa_attention_forward(module, query.double(), key.double(), value.double(), None,
                                              dropout=dropout, scaling=scaling, **kwargs)
        return out.float(), weights
    return grouped_attention(query, key, value, attention_mask, scaling), None


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                      scale: float | None) -> torch.Tensor:
    """SDPA in float64 with the query heads that share a K/V head stacked as that head's queries.

    query [b, H, n, D], key/value [b, KV, L, D], mask [b, 1 or H, n, L] (bool or additive) ->
    [b, n, H, D] float32. Stacking ([b, KV, H/KV * n, D]) is what transformers does for one
    query (`pack_gqa`); doing it for every width means the keys are read (and converted) once
    per K/V head instead of being repeated for every query head (a verify's attention otherwise
    costs several times a step's: benchmarks/README.md)."""
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
    out = torch.nn.functional.scaled_dot_product_attention(q, key.double(), value.double(), attn_mask=mask,
                                                           scale=scale)
    return out.reshape(b, heads, n, dim).float().transpose(1, 2).contiguous()


def _register() -> None:
    global _registered
    if not _registered:
        AttentionInterface.register(NAME, _attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True


def use_exact_attention(model) -> None:
    _register()
    model.set_attn_implementation(NAME)
