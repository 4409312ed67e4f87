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

NAME = "specgen_exact"
EXACT_WIDTH = 64
_registered = False


def _attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.device.type != "cpu" or query.shape[2] > EXACT_WIDTH or query.dtype != torch.float32:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.double()
    out, weights = sdpa_attention_forward(module, query.double(), key.double(), value.double(), attention_mask,
                                          **kwargs)
    return out.float(), weights


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    global _registered
    if not _registered:
        AttentionInterface.register(NAME, _attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True


def use_exact_attention(model) -> None:
    _register()
    model.set_attn_implementation(NAME)
