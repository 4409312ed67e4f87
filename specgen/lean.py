"""A lean eager forward for Llama-style decoders (Qwen2, Llama, Mistral): the same ops, less Python.

On a 2-core CPU a decode step of the 0.5B draft spends about a third of its wall time in
Python around the ops: transformers' module calls, hooks, decorators, keyword plumbing and
mask preparation, per layer. `LeanForward(model)` walks the model's own modules' weights
with the op sequence of transformers' Qwen2/Llama code and nothing else, so its logits are
bitwise those of `model.forward` (tested), for every width, row count and mask:

* embeddings, rotary tables (the model's own rotary module) and the final norm as in the model;
* per layer: RMSNorm, q/k/v (one int8 product when they are fused, `int8._Fused`), rotary,
  the cache write through `past_key_values.update`, attention through the model's own
  registered attention function (so `exact_attention` keeps its float64 decode path), o_proj,
  RMSNorm, gate/up (fused likewise), SiLU, down_proj;
* the head over the last `logits_to_keep` positions.

It is called with the keyword arguments `kvcache.run` gives a model's forward and returns an
object with `.logits`, so it is a drop-in `call` there. `supported(model)` says why a model
cannot take it (None when it can); callers then keep the model's own forward.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

MODEL_TYPES = ("qwen2", "llama", "mistral")


def supported(model) -> str | None:
    """Why `model` cannot use the lean forward (None if it can)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        return f"model type {model_type!r} is not one of {', '.join(MODEL_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        return "sliding-window layers"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    decoder = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if decoder is None or not all(hasattr(decoder, n) for n in needed) or not hasattr(model, "lm_head"):
        return "not a decoder with embed_tokens, layers, norm, rotary_emb and lm_head"
    device_map = getattr(model, "hf_device_map", None) or {}
    if len({str(d) for d in device_map.values()}) > 1:
        return "the model is split over several devices"
    for layer in decoder.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None:
            return "a layer without self_attn or mlp"
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
            return "an attention without q/k/v/o projections"
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return "an MLP without gate/up/down projections"
    return None


def _rms(norm: nn.Module):
    return norm.weight, getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))


def _group(modules: tuple[nn.Module, ...]):
    """One callable x -> tuple of outputs for sibling linears: a single int8 product when they
    are the parts of one `int8._Fused` group, in order; otherwise the modules one by one."""
    from specgen import int8

    fused = getattr(modules[0], "_fused", None)
    if (fused is not None and all(isinstance(m, int8.RowInt8Part) and m._fused is fused for m in modules)
            and [m._index for m in modules] == list(range(len(fused.sizes)))):
        packed, bias, sizes = fused.packed, fused.bias, fused.sizes
        return lambda x: int8.row_linear(x, packed, bias).split(sizes, -1)
    return lambda x: tuple(m(x) for m in modules)


class _Layer:
    __slots__ = ("index", "attn", "ln1", "eps1", "qkv", "o_proj", "ln2", "eps2", "gate_up", "down",
                 "head_dim", "scaling", "groups")

    def __init__(self, index: int, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.index, self.attn = index, attn
        self.ln1, self.eps1 = _rms(layer.input_layernorm)
        self.ln2, self.eps2 = _rms(layer.post_attention_layernorm)
        self.qkv = _group((attn.q_proj, attn.k_proj, attn.v_proj))
        self.o_proj = attn.o_proj
        self.gate_up = _group((mlp.gate_proj, mlp.up_proj))
        self.down = mlp.down_proj
        self.head_dim, self.scaling = attn.head_dim, attn.scaling


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm for float32 activations, op for op."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanForward:
    """`model.forward`'s logits for a Llama-style decoder, with the Python around the ops cut."""

    def __init__(self, model):
        why = supported(model)
        if why is not None:
            raise ValueError(f"the lean forward does not support this model: {why}")
        decoder = model.model
        self.model = model
        self.config = model.config
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.norm, self.norm_eps = _rms(decoder.norm)
        self.head = model.lm_head
        self.layers = [_Layer(i, layer) for i, layer in enumerate(decoder.layers)]

    def _attention(self):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        name = self.config._attn_implementation
        if name == "eager":
            from transformers.models.llama.modeling_llama import eager_attention_forward

            return eager_attention_forward
        return ALL_ATTENTION_FUNCTIONS[name]

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                 past_key_values, use_cache: bool = True, logits_to_keep: int = 0, **_) -> SimpleNamespace:
        attention = self._attention()
        cache = past_key_values
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        shape = hidden.shape[:-1]
        for layer in self.layers:
            residual = hidden
            x = _norm(hidden, layer.ln1, layer.eps1)
            q, k, v = layer.qkv(x)
            q = q.view(*shape, -1, layer.head_dim).transpose(1, 2)
            k = k.view(*shape, -1, layer.head_dim).transpose(1, 2)
            v = v.view(*shape, -1, layer.head_dim).transpose(1, 2)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
            k, v = cache.update(k, v, layer.index)
            out, _ = attention(layer.attn, q, k, v, attention_mask, dropout=0.0, scaling=layer.scaling)
            out = layer.o_proj(out.reshape(*shape, -1).contiguous())
            hidden = residual + out
            residual = hidden
            x = _norm(hidden, layer.ln2, layer.eps2)
            gate, up = layer.gate_up(x)
            hidden = residual + layer.down(nn.functional.silu(gate) * up)
        hidden = _norm(hidden, self.norm, self.norm_eps)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return SimpleNamespace(logits=self.head(hidden))


def call_for(model):
    """What a forward over a SlotCache should call: the lean forward for a supported model on
    the CPU, else the model itself (its own forward, hooks included)."""
    try:
        device = next(model.parameters()).device
    except StopIteration:
        return model
    if device.type != "cpu" or supported(model) is not None:
        return model
    return LeanForward(model)
