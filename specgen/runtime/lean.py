"""A lean eager forward for Llama-style decoders (Qwen2, Llama, Mistral): the same ops, less Python.

On a 2-core CPU a decode step of the 0.5B draft spends about a third of its wall time in
Python around the ops: transformers' module calls, hooks, decorators, keyword plumbing and
mask preparation, per layer. `LeanForward(model)` walks the model's own modules' weights
with the op sequence of transformers' Qwen2/Llama code and nothing else, so its logits are
bitwise those of `model.forward` (tested), for every width, row count and mask:

* embeddings, rotary tables (the model's own rotary module) and the final norm as in the model;
* per layer: RMSNorm (torch's rms_norm: the same arithmetic in one dispatch), q/k/v (one int8
  product when they are fused, `int8.Fused`), rotary for q and k together, the cache write
  through the cache's `update`, attention (SDPA and `exact_attention`'s float64 path
  called directly, with the arguments transformers passes; any other implementation through
  transformers' registry), o_proj, RMSNorm, gate/up (fused likewise), SiLU, down_proj;
* the head over the last `logits_to_keep` positions.

It cuts about a tenth of a CPU decode step, bitwise unchanged (benchmarks/avx2-epyc.md).

A draft does not need bitwise logits (any draft is lossless; only its acceptance matters), so
`LeanForward(model, exact=False)` sends int8 products of up to SHARED_SCALE_ROWS rows through
fbgemm's dynamic kernel, one dispatch instead of row_linear's six. Wider forwards keep
row_linear (one scale per row): a shared scale lets an outlier row, such as a prompt's first
token, coarsen the others. Its attention never copies the K/V heads (`_sdpa`'s `stack`).

It is called with the keyword arguments `kvcache.run` gives a model's forward and returns an
object with `.logits`, so it is a drop-in `call` there. `supported(model)` says why a model
cannot take it (None when it can); callers then keep the model's own forward.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specgen.models.compat import CACHE_ARG
from specgen.models.families import FULL
from specgen.runtime import int8
from specgen.runtime.exact_attention import NAME as EXACT_NAME
from specgen.runtime.exact_attention import grouped_attention
from specgen.runtime.pruned import PrunedHead

MODEL_TYPES = ("qwen2", "llama", "mistral")


def supported(model) -> str | None:
    """Why `model` cannot use the lean forward (None if it can)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        return f"model type {model_type!r} is not one of {', '.join(MODEL_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
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


def _single(module: nn.Module, exact: bool = True):
    """x -> module(x) without nn.Module's call machinery, for the linears we know."""
    if type(module) is int8.RowInt8Linear:
        packed, bias, wide = module._packed, module.bias, module._wide
        if not exact:
            return lambda x: _draft_product(x, packed, bias, wide)
        return lambda x: int8.row_linear(x, packed, bias, wide)
    if type(module) is nn.Linear:
        weight, bias = module.weight, module.bias
        return lambda x: nn.functional.linear(x, weight, bias)
    if type(module) is PrunedHead:  # a draft's pruned head: its products the same way
        product, blocks = _single(module.linear, exact), []

        def head(x):
            if len(blocks) < len(module.blocks):  # blocks packed since (see PrunedHead.cover)
                blocks.extend(_single(block, exact) for block in module.blocks[len(blocks) :])
            return module.spread(product(x), [block(x) for block in blocks], x)

        return head
    return module


# a draft's forward of at most this many tokens (a round's first step, a batch's rows) takes
# fbgemm's dynamic kernel, one scale for them all (`_draft_product`); wider ones, a prompt's read
# among them, take row_linear. On a Xeon with AMX, 4 against 1: a 2-token draft step 29.6
# against 31.8 ms, chain and lookup-chain 0.6-0.8% faster over 33 prompts, and at 4 rows of a
# batch 3-8% faster, with as many draft tokens accepted (benchmarks/cpu-speed.md)
SHARED_SCALE_ROWS = 4


def _draft_product(x: torch.Tensor, packed, bias: torch.Tensor | None, wide=None) -> torch.Tensor:
    """A draft's int8 product (exact=False): up to SHARED_SCALE_ROWS rows through fbgemm's
    dynamic kernel (one dispatch where row_linear takes six; a single row's own scale, as
    row_linear gives it, at a rounding apart; a few rows' shared one), more rows through
    row_linear (a shared scale over a prompt's read would let one outlier row, such as its first
    token, coarsen every other row)."""
    if x.numel() > SHARED_SCALE_ROWS * x.shape[-1] or x.dtype != torch.float32:
        return int8.row_linear(x, packed, bias, wide)
    if isinstance(packed, tuple):
        out = torch.cat([torch.ops.quantized.linear_dynamic(x, p, True) for p in packed], -1)
    else:
        out = torch.ops.quantized.linear_dynamic(x, packed, True)
    return out if bias is None else out.add_(bias)


def _group(modules: tuple[nn.Module, ...], exact: bool = True):
    """One callable x -> the outputs of sibling linears side by side in one tensor: a single
    int8 product when they are the parts of one `int8.Fused` group, in order; otherwise the
    modules one by one, concatenated."""
    fused = getattr(modules[0], "_fused", None)
    if (
        fused is not None
        and all(isinstance(m, int8.RowInt8Part) and m._fused is fused for m in modules)
        and [m._index for m in modules] == list(range(len(fused.sizes)))
    ):
        packed, bias, wide = fused.packed, fused.bias, fused.wide
        product = int8.row_linear if exact else _draft_product
        return lambda x: product(x, packed, bias, wide)
    calls = tuple(_single(m, exact) for m in modules)
    return lambda x: torch.cat([call(x) for call in calls], -1)


class _Layer:
    __slots__ = (
        "index",
        "kind",
        "attn",
        "ln1",
        "eps1",
        "qkv",
        "o_proj",
        "ln2",
        "eps2",
        "gate_up",
        "down",
        "head_dim",
        "scaling",
        "groups",
    )

    def __init__(self, index: int, layer: nn.Module, exact: bool, kind: str):
        attn, mlp = layer.self_attn, layer.mlp
        self.index, self.kind, self.attn = index, kind, attn  # kind: its layer type (which mask it reads)
        self.ln1, self.eps1 = _rms(layer.input_layernorm)
        self.ln2, self.eps2 = _rms(layer.post_attention_layernorm)
        self.qkv = _group((attn.q_proj, attn.k_proj, attn.v_proj), exact)
        self.o_proj = _single(attn.o_proj, exact)
        self.gate_up = _group((mlp.gate_proj, mlp.up_proj), exact)
        self.down = _single(mlp.down_proj, exact)
        self.head_dim, self.scaling = attn.head_dim, attn.scaling


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: one dispatch for float32 activations (torch's rms_norm: the same
    arithmetic in the same order, bitwise equal: tested), its op sequence otherwise."""
    if x.dtype == torch.float32:
        return nn.functional.rms_norm(x, weight.shape, weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class LeanForward:
    """`model.forward`'s logits for a Llama-style decoder, with the Python around the ops cut."""

    def __init__(self, model, exact: bool = True):
        why = supported(model)
        if why is not None:
            raise ValueError(f"the lean forward does not support this model: {why}")
        decoder = model.model
        self.model = model
        self.stack = not exact  # a draft's attention stacks a group's heads at every width (_sdpa)
        self.config = model.config
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.norm, self.norm_eps = _rms(decoder.norm)
        self.head = _single(model.lm_head, exact)
        kinds = getattr(self.config, "layer_types", None) or [FULL] * len(decoder.layers)
        self.layers = [
            _Layer(i, layer, exact, kind) for i, (layer, kind) in enumerate(zip(decoder.layers, kinds))
        ]
        self.heads = self.config.num_attention_heads
        self.groups = getattr(self.config, "num_key_value_heads", None) or self.heads
        self.head_dim = self.layers[0].head_dim

    def _attention_kind(self, mask) -> str:
        """'exact' and 'sdpa' are run here, op for op what transformers' functions run for an
        explicit mask; anything else ('registry') through transformers' attention registry."""
        name = self.config._attn_implementation
        if mask is None:  # causal without a mask: transformers' function decides
            return "registry"
        if name == EXACT_NAME:
            return "exact"
        if name == "sdpa" and os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA", "0") != "1":
            return "sdpa"
        return "registry"

    def _registered(self):
        """The model's attention function as its layers look it up."""
        eager = getattr(sys.modules[type(self.layers[0].attn).__module__], "eager_attention_forward", None)
        return ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        use_cache: bool = True,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> SimpleNamespace:
        cache = kwargs[CACHE_ARG]
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(hidden, position_ids)
        b, n = hidden.shape[:2]
        heads, groups, dim = self.heads, self.groups, self.head_dim
        half = dim // 2
        # [b, n, 1, D]: one rotation for q and k together. transformers' rotate_half(x) * sin is
        # cat(-x2, x1) * sin; here roll(x) * cat(-sin1, sin2) = cat(x2 * -sin1, x1 * sin2): bitwise
        # the same products (a sign commutes exactly), with one call a layer (roll) for rotate_half's
        # four (two slices, a negation, a concatenation); the signed sine is made once a forward
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        sin = torch.cat((-sin[..., :half], sin[..., half:]), -1)
        masks = attention_mask if isinstance(attention_mask, dict) else None  # by layer type: windows differ
        kind = self._attention_kind(attention_mask)
        if kind == "exact" and hidden.dtype != torch.float32:
            kind = "registry"  # exact_attention's own fallback
        stack = self.stack and kind == "sdpa" and heads != groups
        if stack:  # each stacked head's query rows with their mask rows, once a forward (_sdpa)
            if masks is not None:
                masks = {name: _stacked_mask(mask, heads // groups) for name, mask in masks.items()}
            else:
                attention_mask = _stacked_mask(attention_mask, heads // groups)
        function = self._registered() if kind == "registry" else None
        taps = getattr(cache, "taps", None)  # an EAGLE head's features (runtime/features.py)
        rows = _Rows(b, n, getattr(cache, "packed", None), hidden.device)
        hidden = rows.pack(hidden)
        for layer in self.layers:
            if taps and layer.index in taps:
                cache.capture(layer.index, rows.unpack(hidden))
            residual = hidden
            x = _norm(hidden, layer.ln1, layer.eps1)
            qkv = rows.unpack(layer.qkv(x)).view(b, n, heads + 2 * groups, dim)
            qk = qkv[:, :, : heads + groups]
            qk = ((qk * cos) + (qk.roll(half, -1) * sin)).transpose(1, 2)
            q, k = qk[:, :heads], qk[:, heads:]
            k, v = cache.update(k, qkv[:, :, heads + groups :].transpose(1, 2), layer.index)
            if masks is not None:
                attention_mask = masks[layer.kind]
            if kind == "exact":
                out = grouped_attention(q, k, v, attention_mask, layer.scaling)
            elif kind == "sdpa":
                out = _sdpa(q, k, v, attention_mask, layer.scaling, heads // groups, stack)
            else:
                out, _ = function(layer.attn, q, k, v, attention_mask, dropout=0.0, scaling=layer.scaling)
            out = layer.o_proj(rows.pack(out.reshape(b, n, -1)))
            hidden = residual + out
            residual = hidden
            x = _norm(hidden, layer.ln2, layer.eps2)
            gate, up = layer.gate_up(x).chunk(2, -1)
            hidden = residual + layer.down(nn.functional.silu(gate) * up)
        if taps and len(self.layers) in taps:
            cache.capture(len(self.layers), rows.unpack(hidden))
        hidden = _norm(hidden, self.norm, self.norm_eps)
        if logits_to_keep:
            hidden = rows.unpack(hidden)[:, -logits_to_keep:]
            return SimpleNamespace(logits=self.head(hidden))
        return SimpleNamespace(logits=rows.unpack(self.head(hidden)))


class _Rows:
    """Rows of different widths padded to the widest (`packed`: the real tokens' flat indices,
    kvcache.SlotCache.packed): every product, norm and residual runs over the real tokens only,
    [m, H]; attention, which reads each row's own slots, takes them back in [b, n] with zeros at
    the pads (a pad's K/V lands in a slot no real query sees, as before). Each real token's
    arithmetic is what it was; a round of a plain row beside a 9-token chain costs 10 tokens'
    products, not 18. With `packed` None every method is the identity."""

    __slots__ = ("b", "n", "index")

    def __init__(self, b: int, n: int, index: torch.Tensor | None, device):
        self.b, self.n = b, n
        self.index = None if index is None or index.shape[0] == b * n else index.to(device)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[b, n, ...] -> [m, ...] (the real tokens)"""
        if self.index is None:
            return x
        return x.reshape(self.b * self.n, *x.shape[2:]).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[m, ...] -> [b, n, ...], zeros at the pads"""
        if self.index is None:
            return x
        out = x.new_zeros(self.b * self.n, *x.shape[1:])
        return out.index_copy_(0, self.index, x).view(self.b, self.n, *x.shape[1:])


def _stacked_mask(mask: torch.Tensor, rep: int) -> torch.Tensor:
    """A mask [b, 1 or H, n, L] for queries stacked by K/V group: [b, 1 or groups, rep * n, L],
    each stacked head's rows with their own mask rows (one mask for every head: repeated rep times)."""
    b, heads, n, length = mask.shape
    if heads != 1:
        return mask.reshape(b, heads // rep, rep * n, length)
    if n == 1:
        return mask
    return mask[:, :, None].expand(b, 1, rep, n, length).reshape(b, 1, rep * n, length)


def _sdpa(q, k, v, mask, scale: float, rep: int, stack: bool = False) -> torch.Tensor:
    """transformers' sdpa_attention_forward for an explicit mask, op for op: one query stacks the
    heads of a K/V group (`pack_gqa`), more repeat the K/V heads (`repeat_kv`). -> [b, n, H, D]

    `stack` (a draft's forward, exact=False): more queries are stacked as well, [b, groups,
    rep * n, D], with `mask` already stacked (`_stacked_mask`, once a forward, not once a
    layer). Repeating copies the whole K/V of every layer rep times (7 for the 0.5B draft) at
    every forward wider than one token; a draft's two-token step over 200 tokens took 34.0 ms
    that way and 31.8 ms stacked. Each query's output is the same up to the kernel's blocking,
    which moves last bits with the number of queries (runtime/exact_attention.py), so a target,
    whose forwards must be transformers' own bit for bit, repeats."""
    b, heads, n, dim = q.shape
    if rep > 1:
        if n == 1 or stack:
            q = q.reshape(b, heads // rep, rep * n, dim)
            if not stack:
                mask = _stacked_mask(mask, rep)
        else:
            k = k[:, :, None].expand(b, k.shape[1], rep, *k.shape[2:]).reshape(b, heads, *k.shape[2:])
            v = v[:, :, None].expand(b, v.shape[1], rep, *v.shape[2:]).reshape(b, heads, *v.shape[2:])
    out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale)
    return out.reshape(b, heads, n, dim).transpose(1, 2)


def call_for(model, exact: bool = True):
    """What a forward over a SlotCache should call: the lean forward for a supported model on
    the CPU, else the model itself (its own forward, hooks included). `exact=False` (a draft):
    single-row int8 products take fbgemm's one-dispatch dynamic kernel (see LeanForward)."""
    try:
        device = next(model.parameters()).device
    except StopIteration:
        return model
    if device.type != "cpu" or supported(model) is not None:
        return model
    return LeanForward(model, exact)
