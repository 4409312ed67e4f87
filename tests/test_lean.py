"""The lean forward (specgen/lean.py) gives bitwise the logits of the model's own forward."""

from __future__ import annotations

import pytest
import torch
from families import build
from tiny import build_model

from specgen.runtime import int8, int8_model, kvcache, lean
from specgen.runtime.compiled import Steps
from specgen.runtime.exact_attention import use_exact_attention


def llama_model(seed: int = 3):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=256,
        initializer_range=0.3,
        tie_word_embeddings=True,
        rope_theta=500.0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def variants():
    """(name, model): fp32 Qwen2 (q/k/v bias, GQA 2), tied Llama (no bias, GQA 4), Qwen2 with
    eager attention, the int8 target as specgen runs it (fused parts, exact attention), and
    sliding windows: Mistral's on every layer, Qwen2's on its top layers only."""
    yield "qwen2", build_model(11, layers=3)
    yield "llama", llama_model()
    yield "qwen2-bf16", build_model(17, layers=2).to(torch.bfloat16)  # the format auto picks with avx512_bf16
    eager = build_model(16, layers=2)
    eager.set_attn_implementation("eager")  # through transformers' registry
    yield "qwen2-eager", eager
    target = int8_model.quantize_model(build_model(12, layers=3))
    use_exact_attention(target)
    yield "qwen2-int8-exact", target
    yield "mistral-window", build("mistral", seed=4)  # every layer slides (one mask)
    # full and sliding layers (a mask per kind)
    sliding = int8_model.quantize_model(build("qwen2-sliding", seed=4))
    use_exact_attention(sliding)
    yield "qwen2-sliding-int8-exact", sliding


VARIANTS = list(variants())


def both(model, cache_ids, tokens, **kwargs):
    """Logits of the model's forward and of the lean one, each on its own identical cache."""
    out = []
    for call in (model, lean.LeanForward(model)):
        cache = kvcache.new_cache(model, rows=cache_ids.shape[0])
        with torch.inference_mode():
            kvcache.forward(call, cache, cache_ids, keep=1)
            out.append((kvcache.forward(call, cache, tokens, **kwargs), cache))
    return out


@pytest.mark.parametrize("name,model", VARIANTS, ids=[v[0] for v in VARIANTS])
@pytest.mark.parametrize("width", [1, 2, 5, 9])
def test_lean_logits_and_cache_are_bitwise_the_models(name, model, width):
    assert lean.supported(model) is None
    prompt = torch.arange(3, 40)[None]
    tokens = torch.arange(50, 50 + width)[None]
    (reference, ref_cache), (got, cache) = both(model, prompt, tokens, keep=0)
    assert got.shape == reference.shape == (1, width, 259)
    assert torch.equal(got, reference)
    for mine, theirs in zip(cache.layers, ref_cache.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


@pytest.mark.parametrize("name,model", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_lean_is_bitwise_for_prefills_rows_and_tree_masks(name, model):
    # a prefill longer than the exact-attention width, no cache before it
    ids = torch.arange(1, 90)[None]
    for keep in (0, 1):
        outs = []
        for call in (model, lean.LeanForward(model)):
            with torch.inference_mode():
                outs.append(kvcache.forward(call, kvcache.new_cache(model), ids, keep=keep))
        assert torch.equal(*outs)
    # two rows, a tree of 4 nodes (root, two children, a grandchild) at depths 0 1 1 2
    prompt = torch.stack([torch.arange(3, 30), torch.arange(100, 127)])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    depth = torch.tensor([0, 1, 1, 2])
    tokens = torch.tensor([[7, 8, 9, 10], [11, 12, 13, 14]])
    (reference, _), (got, _) = both(model, prompt, tokens, tree=tree, depth=depth)
    assert torch.equal(got, reference)


@pytest.mark.parametrize("name,model", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_rows_of_different_widths_run_their_products_over_real_tokens_only(name, model):
    """A verify of rows 1, 6 and 3 tokens wide, padded to 6, with `packed` naming the real
    tokens: every real token's logits and every committed slot's K/V are those of the padded
    forward without packing (the products see fewer rows, each row's arithmetic its own)."""
    prompt = torch.stack([torch.arange(3, 30), torch.arange(100, 127), torch.arange(40, 67)])
    widths = [1, 6, 3]
    tokens = torch.tensor([[5, 0, 0, 0, 0, 0], [7, 8, 9, 10, 11, 12], [13, 14, 15, 0, 0, 0]])
    packed = torch.tensor([row * 6 + j for row, n in enumerate(widths) for j in range(n)])
    call = lean.LeanForward(model)
    out = []
    for index in (None, packed):
        cache = kvcache.new_cache(model, rows=3)
        with torch.inference_mode():
            kvcache.forward(call, cache, prompt, keep=1)
            out.append((kvcache.forward(call, cache, tokens, packed=index), cache))
    (reference, ref_cache), (got, cache) = out
    for row, n in enumerate(widths):
        # bitwise on the Xeon with AMX; a product's blocking may vary with its row count elsewhere
        torch.testing.assert_close(got[row, :n], reference[row, :n], rtol=1e-5, atol=1e-5)
        for mine, theirs in zip(cache.layers, ref_cache.layers):
            torch.testing.assert_close(mine.keys[row, :, : 27 + n], theirs.keys[row, :, : 27 + n])
            torch.testing.assert_close(mine.values[row, :, : 27 + n], theirs.values[row, :, : 27 + n])
    assert cache.packed is None  # the forward's own, gone with it


def repeated_kv_attention(q, k, v, mask, scale):
    """transformers' way for more than one query: every K/V head copied to its query heads."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_drafts_attention_stacks_a_groups_heads_as_queries_and_a_targets_repeats_the_keys(dtype):
    """_sdpa with `stack` (a draft's forward) stacks the query heads of a K/V group as one head's
    queries, each with its mask row, instead of copying the K/V rep times: each query's output
    is that of the repeated keys up to the kernel's last bits, for causal and tree masks, one
    mask for all heads or one per head, and contexts past one block of the kernel's keys;
    without it (a target) wider forwards repeat the keys, transformers' own op sequence."""
    torch.manual_seed(0)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for groups, rep, dim in ((2, 7, 64), (2, 6, 128), (1, 4, 16)):
        for n, length in ((1, 30), (2, 40), (5, 200), (9, 600), (17, 1100)):
            q = torch.randn(2, groups * rep, n, dim, dtype=dtype)
            k, v = (torch.randn(2, groups, length, dim, dtype=dtype) for _ in range(2))
            causal = torch.ones(n, length, dtype=torch.bool).tril(length - n)
            tree = causal.clone()
            tree[n // 2 :, length - n : length - n + n // 2] = False  # a second branch
            for mask in (causal, tree):
                for heads in (1, groups * rep):
                    full = mask[None, None].expand(2, heads, n, length)
                    expected = repeated_kv_attention(q, k, v, full, 0.125)
                    torch.testing.assert_close(
                        lean._sdpa(q, k, v, lean._stacked_mask(full, rep), 0.125, rep, stack=True),
                        expected,
                        **tolerance,
                    )
                    if n > 1:
                        assert torch.equal(lean._sdpa(q, k, v, full, 0.125, rep), expected)


def test_steps_use_the_lean_forward_on_the_cpu_and_keep_the_model_otherwise():
    model = build_model(13)
    assert isinstance(Steps(model).call, lean.LeanForward)
    assert isinstance(Steps(model, "fixed").call, lean.LeanForward)
    gpt2 = __import__("transformers").GPT2LMHeadModel(
        __import__("transformers").GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    )
    assert "gpt2" in lean.supported(gpt2)
    assert Steps(gpt2).call is gpt2
    with pytest.raises(ValueError, match="does not support"):
        lean.LeanForward(gpt2)


def test_the_lean_forward_follows_a_pruned_head():
    from specgen.runtime.quant import apply_draft_quant

    model = apply_draft_quant(build_model(14), "int8+prune", keep=100)
    (reference, _), (got, _) = both(model, torch.arange(3, 20)[None], torch.tensor([[5, 150, 7]]))
    assert torch.equal(got, reference)  # 150, read in the second forward, is proposable in it
    assert torch.isfinite(got[..., 150]).all()
    assert torch.isinf(got[..., 100:150]).all() and torch.isinf(got[..., 151:200]).all()


def test_the_lean_forward_follows_a_pruned_head_once_it_widens():
    from specgen.runtime.quant import apply_draft_quant

    model = apply_draft_quant(build_model(14), "int8+prune", keep=100)
    outside = (100 + torch.arange(80) * 7 % 158)[None]  # mostly past the kept ids: the head widens
    (reference, _), (got, _) = both(model, outside, torch.tensor([[5, 150, 7]]))
    assert model.get_output_embeddings().complete
    assert torch.equal(got, reference) and torch.isfinite(got).all()


def test_a_draft_forward_takes_one_dispatch_for_a_few_rows_and_row_int8_for_more():
    """exact=False (drafts): up to SHARED_SCALE_ROWS rows go through fbgemm's dynamic kernel (a
    scale for them all: close to the row-exact product, not bitwise); wider forwards are bitwise
    the exact ones."""
    fp32 = build_model(15, layers=2)
    model = int8_model.quantize_model(build_model(15, layers=2))
    exact, draft = lean.LeanForward(model), lean.LeanForward(model, exact=False)
    prompt = torch.arange(3, 40)[None]
    outs = {}
    for name, call in (("fp32", fp32), ("exact", exact), ("draft", draft)):
        cache = kvcache.new_cache(model)
        with torch.inference_mode():
            kvcache.forward(call, cache, prompt, keep=1)
            one = kvcache.forward(call, cache, torch.tensor([[41]]))
            few = kvcache.forward(call, cache, torch.tensor([[42, 43, 44]]))
        outs[name] = (one, few)
    assert lean.SHARED_SCALE_ROWS >= 3
    for i in range(2):  # one row and three: the dynamic kernel's scale, as close as a scale per row
        assert not torch.equal(outs["draft"][i], outs["exact"][i])
        error = {name: (outs[name][i] - outs["fp32"][i]).abs().amax() for name in ("draft", "exact")}
        assert error["draft"] < 1.25 * error["exact"]  # int8 of a random model: 9-15% of the logits' scale
        assert error["exact"] < 0.2 * outs["fp32"][i].abs().amax()
    # wider forwards on the same cache: bitwise the exact lean forward
    wide = torch.arange(41, 42 + lean.SHARED_SCALE_ROWS)[None]
    (reference, _), (_, _) = both(model, prompt, wide)
    cache = kvcache.new_cache(model)
    with torch.inference_mode():
        kvcache.forward(draft, cache, prompt, keep=1)
        got = kvcache.forward(draft, cache, wide)
    assert torch.equal(got, reference)
    assert isinstance(Steps(model, exact=False).call, lean.LeanForward)


def test_forwards_pass_the_cache_by_the_name_this_transformers_takes():
    """transformers 5.24 renamed a forward's `past_key_values` to `cache` (the old name warns and
    is to go in 5.40): every forward specgen makes, the model's own and the lean one, uses the name
    the installed version takes, so none warns and none breaks when the old name goes."""
    import inspect
    import warnings

    from transformers import Qwen2ForCausalLM

    from specgen.models.compat import CACHE_ARG

    assert CACHE_ARG in inspect.signature(Qwen2ForCausalLM.forward).parameters
    model = build_model(11, layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for call in (model, lean.LeanForward(model)):
            cache = kvcache.new_cache(model, rows=1)
            with torch.inference_mode():
                kvcache.forward(call, cache, torch.arange(3, 9)[None], keep=1)
