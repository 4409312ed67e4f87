"""Exact attention (the CPU's int8 path): a token's K/V and logits do not depend on the shape
of the forward that computed them, so cached prefixes, chunked prefills, batches and verifies
cannot change a greedy answer."""

from __future__ import annotations

import pytest
import torch
from families import build

from specgen.runtime import int8_model, kvcache
from specgen.runtime.exact_attention import QUERY_BLOCK, eager_attention, use_exact_attention
from specgen.runtime.lean import call_for

LENGTH = QUERY_BLOCK + 90  # a prefill of more than one query block


def int8_exact(family: str):
    model = int8_model.quantize_model(build(family, seed=5))
    use_exact_attention(model)
    return model


# dense families: an MoE's fused experts stay fp32 on the int8 path, and their grouped products
# round by how many tokens reach each expert (docs/how-it-works.md: "Model families")
MODELS = {family: int8_exact(family) for family in ("qwen2", "gemma2", "gemma3", "mistral")}


def kv(cache: kvcache.SlotCache, row: int, n: int) -> list[torch.Tensor]:
    return [t[row, :, :n] for layer in cache.layers for t in (layer.keys, layer.values)]


@pytest.mark.parametrize("family", list(MODELS))
def test_a_prompt_is_bitwise_the_same_whole_chunked_stepped_and_batched(family):
    """qwen2 and mistral (the lean forward's grouped attention; mistral slides), gemma2 (softcap,
    through eager_attention), gemma3 (local and global layers): K/V of every position and the
    last logits, bitwise."""
    model = MODELS[family]
    call = call_for(model)
    ids = torch.randint(0, 256, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        whole = kvcache.SlotCache(model.config, rows=1)
        last = kvcache.forward(call, whole, ids, keep=1)
        chunked = kvcache.SlotCache(model.config, rows=1)
        for start, end in (
            (0, 40),
            (40, 200),
            (200, LENGTH - 3),
            (LENGTH - 3, LENGTH - 1),
            (LENGTH - 1, LENGTH),
        ):
            out = kvcache.forward(call, chunked, ids[:, start:end], keep=1)
        batched = kvcache.SlotCache(model.config, rows=2)
        kvcache.forward(call, batched, ids[:, :17], rows=slice(0, 1))
        kvcache.forward(call, batched, ids[:, : LENGTH - 5], rows=slice(1, 2))
        both = kvcache.forward(call, batched, torch.cat([ids[:, 17:22], ids[:, LENGTH - 5 :]]))
    assert torch.equal(out, last)
    assert torch.equal(both[1:, -1:], last)
    assert all(torch.equal(a, b) for a, b in zip(kv(whole, 0, LENGTH), kv(chunked, 0, LENGTH)))
    assert all(torch.equal(a, b) for a, b in zip(kv(whole, 0, LENGTH), kv(batched, 1, LENGTH)))


@pytest.mark.parametrize("family,kwarg", [("gemma2", "softcap"), ("gpt-oss", "s_aux")])
def test_eager_attention_is_the_familys_own_arithmetic(family, kwarg):
    """Gemma 2's softcap and gpt-oss's sinks, in float64, against the family's eager function
    in fp32 (causal mask, GQA)."""
    import sys

    model = build(family, seed=2)
    attention = model.model.layers[0].self_attn
    eager = sys.modules[type(attention).__module__].eager_attention_forward
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 4, 7, 16, generator=g),
        torch.randn(1, 2, 12, 16, generator=g),
        torch.randn(1, 2, 12, 16, generator=g),
    )
    visible = torch.ones(7, 12, dtype=torch.bool).tril(5)[None, None]
    additive = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    extra = {"softcap": 5.0} if kwarg == "softcap" else {"s_aux": attention.sinks}
    if kwarg == "s_aux":
        torch.nn.init.normal_(attention.sinks, generator=g)
        expected, _ = eager(attention, q, k, v, additive, scaling=0.25)
        got = eager_attention(q, k, v, visible, 0.25, sinks=attention.sinks)
    else:
        expected, _ = eager(attention, q, k, v, additive, scaling=0.25, **extra)
        got = eager_attention(q, k, v, visible, 0.25, softcap=5.0)
    assert torch.allclose(got, expected, atol=1e-5)
    with_none = eager_attention(
        q[:, :, :5],
        k[:, :, :10],
        v[:, :, :10],
        None,
        0.25,
        **({"softcap": 5.0} if kwarg == "softcap" else {"sinks": attention.sinks}),
    )  # None: causal at the end
    assert torch.allclose(with_none, got[:, :5], atol=1e-6)


def test_the_cache_holds_k_v_in_float64_with_the_float32_arithmetic():
    """An exact-attention cache keeps K/V in float64 (the float32 values, converted once as they
    are written), so that a step converts nothing; the logits and K/V are bitwise what a cache
    holding float32 gives, and the prefix store keeps float32 copies that restore exactly."""
    from specgen.runtime.prefixes import PrefixStore

    model = MODELS["qwen2"]
    call = call_for(model)
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        held = kvcache.SlotCache(model.config, rows=1)
        narrow = kvcache.SlotCache(model.config, rows=1)
        narrow.held_dtype = lambda key_states: key_states.dtype  # the cache as it was
        outs = []
        for cache in (held, narrow):
            kvcache.forward(call, cache, ids[:, :50], keep=1)
            outs.append(kvcache.forward(call, cache, ids[:, 50:56]))  # a verify-sized forward
            outs.append(kvcache.forward(call, cache, ids[:, 56:57]))  # a plain step
        assert held.layers[0].keys.dtype == torch.float64 and narrow.layers[0].keys.dtype == torch.float32
        assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
        assert all(torch.equal(a.double(), b) for a, b in zip(kv(narrow, 0, 57), kv(held, 0, 57)))
        store = PrefixStore(budget=1 << 24)
        store.save(held, 0, ids[0, :57].tolist())
        (entry,) = store.entries.values()
        assert entry.keys[0].dtype == torch.float32
        assert entry.nbytes == sum(t.numel() * 4 for t in kv(narrow, 0, 57))
        restored = kvcache.SlotCache(model.config, rows=1)
        assert store.load(restored, 0, ids[0].tolist()) == 57
        assert all(torch.equal(a, b) for a, b in zip(kv(held, 0, 57), kv(restored, 0, 57)))
    # a draft's cache (SDPA, no exact attention) keeps its model's dtype
    plain = build("qwen2", seed=5)
    with torch.inference_mode():
        cache = kvcache.SlotCache(plain.config, rows=1)
        kvcache.forward(call_for(plain), cache, ids[:, :5], keep=1)
    assert cache.layers[0].keys.dtype == torch.float32
