"""An EAGLE-3 draft head: one decoder layer on the target's own features.

A head drafts the token after next from two inputs per position p: the target's hidden states
entering three of its layers at p (low, middle, high: `HeadConfig.layers`, 3H wide), and the
embedding of the token at p + 1. One step:

    g = fc(features)                      # 3H -> H (a later draft step feeds its own output: H wide)
    x = [input_layernorm(embed(token)), hidden_norm(g)]       # 2H
    h = g + o_proj(attention(q/k/v(x)))  # its own K/V cache, rotary at the position p
    out = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(out))           # over the draft vocabulary (Vd ids)

`out` (before the norm) is the next draft step's feature. With `norm_before_residual` the
residual is hidden_norm(g) instead of g (vLLM's speculators option). A draft id d is the target
id d + d2t[d]. This is the layout SafeAILab's EAGLE-3, SpecForge and vLLM's speculators write,
and vLLM's `llama_eagle3` runs (specgen/models/eagle_format.py reads and writes both).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from specgen.models.compat import CACHE_ARG


def default_layers(layer_count: int) -> tuple[int, int, int]:
    """vLLM's aux layers for a target of `layer_count` layers when a head names none:
    (2, L // 2, L - 3). Id i is the residual stream entering layer i (transformers'
    `output_hidden_states[i]`); id L is the last layer's output before the final norm."""
    return (2, layer_count // 2, layer_count - 3)


def check_layers(ids: tuple[int, ...], count: int) -> None:
    """A ValueError unless every id names a layer of a `count`-layer target (or its output)."""
    bad = [i for i in ids if not 0 <= i <= count]
    if bad:
        raise ValueError(f"the head reads layer(s) {bad} but the target has {count} layers")


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    layers: tuple[int, ...]  # the target layers whose entering hidden states it reads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    norm_before_residual: bool = False

    def llama(self) -> LlamaConfig:
        """The head's decoder layer as a one-layer Llama config (its rotary table, its cache)."""
        config = LlamaConfig(
            hidden_size=self.hidden_size,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
        )
        config._attn_implementation = "sdpa"
        return config


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, d
        self.q_proj = nn.Linear(2 * h, config.heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, config.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, config.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.heads * d, h, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [b, heads, n, d], k and v [b, kv_heads, n, d], q and k rotated."""
        b, n = x.shape[:2]
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class MLP(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """The head's decoder layer (`midlayer` in the original format, `layers.0` in speculators')."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


class Eagle3Head(nn.Module):
    """The head's weights and its forward over a kvcache.SlotCache (one layer)."""

    def __init__(self, config: HeadConfig, embed: nn.Module | None = None):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.layers) * h, h, bias=False)
        self.midlayer = Layer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self._embed = [embed]  # the target's token embedding unless the head brings its own: not a submodule
        self.rotary = LlamaRotaryEmbedding(config.llama())
        self.cache_config = config.llama()

    @property
    def embed(self) -> nn.Module:
        return self._embed[0]

    def use_embedding(self, module: nn.Module) -> None:
        """Embed tokens with `module` (the target's, shared; a plain attribute would make it a
        submodule, whose weights would then be saved with the head's)."""
        self._embed = [module]

    def draft_to_target(self) -> torch.Tensor:
        """[Vd] the target id of each draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def step(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask,
        cache,
        logits_to_keep: int = 0,
    ):
        """(logits over the draft vocabulary [b, n|keep, Vd], the outputs before the norm [b, n, H]).
        `features` [b, n, 3H] (the target's) or [b, n, H] (a draft step's own outputs);
        `cache` a SlotCache whose slots for this forward are set (kvcache.run does)."""
        layer = self.midlayer
        embeds = self.embed(input_ids).to(self.norm.weight.dtype)
        hidden = features.to(embeds.dtype)
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(hidden)
        normed = layer.hidden_norm(hidden)
        residual = normed if self.config.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        cos, sin = self.rotary(x, position_ids)
        q, k, v = layer.self_attn.project(x, cos[:, None], sin[:, None])
        k, v = cache.update(k, v, 0)
        out = nn.functional.scaled_dot_product_attention(
            q,
            k.to(q.dtype),
            v.to(q.dtype),
            attn_mask=attention_mask,
            enable_gqa=self.config.heads != self.config.kv_heads,
        )
        b, n = x.shape[:2]
        hidden = residual + layer.self_attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        return self.lm_head(self.norm(kept)), hidden


class HeadStep(nn.Module):
    """The head as a model of fixed-shape steps (runtime.compiled.Steps: on CUDA, graphs captured
    per width). `feed` copies a forward's features into a buffer kept per shape, so a graph
    captured over it reads each replay's own; the forward returns as `logits` the head's logits
    and its outputs before the norm side by side, [b, n|keep, Vd + H], the one tensor a captured
    step hands back (`split` parts them). A drafter keeps one per kind of features (the target's,
    [.., taps * H], or the head's own, [.., H]): a graph is keyed by width, not by what it reads."""

    def __init__(self, head: Eagle3Head, widest: int):
        super().__init__()
        self.head = head
        self.widest = widest  # the widest forward a graph may capture: wider ones are never buffered
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._features: torch.Tensor | None = None

    def feed(self, features: torch.Tensor) -> None:
        if features.shape[1] > self.widest:  # a long catch-up: eager, and a buffer per length would pile up
            self._features = features
            return
        key = (tuple(features.shape), features.dtype)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = torch.empty_like(features)
        buffer.copy_(features)
        self._features = buffer

    def forward(self, input_ids, position_ids, attention_mask, use_cache=True, logits_to_keep=0, **kwargs):
        logits, hidden = self.head.step(
            input_ids, self._features, position_ids, attention_mask, kwargs[CACHE_ARG], logits_to_keep
        )
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        dtype = torch.promote_types(logits.dtype, kept.dtype)
        return SimpleNamespace(logits=torch.cat([logits.to(dtype), kept.to(dtype)], dim=-1))

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [.., Vd], outputs before the norm [.., H]) of a forward's output."""
        vd = self.head.config.draft_vocab_size
        return out[..., :vd], out[..., vd:].to(self.head.norm.weight.dtype)
