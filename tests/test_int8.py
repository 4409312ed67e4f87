"""--target-quant int8: int8 linears whose rows are exact at any width keep speculation lossless.

Speculative decoding is exact only with respect to the target as it runs: a verify forward of
k+1 tokens must score each token exactly as a one-token plain step would. These tests check
that property for `RowInt8Linear` (bitwise, row by row), for the whole int8 target (every
method reproduces greedy plain decoding of the SAME int8 target, token for token, and chain
sampling follows its law), and that the checks have teeth: an int8 linear with one activation
scale per forward (what torch's `quantize_dynamic` does) is caught by the same harness, and so
is an acceptance rule without its residual. Also the on-disk cache of int8 weights, the option
parsing and the CLI's error for a bad --target-quant.
"""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from test_cli import assert_one_line_error
from test_engine import PROMPT, reference_greedy
from test_statistical import (
    CONTROL_GENERATIONS,
    ENGINE_PROMPT,
    ENGINE_SAMPLING,
    SMALL_ALPHA,
    SPEC_GENERATIONS,
    assert_pairs_follow,
    first_two_tokens,
    gof_pvalue,
    make_engine,
    rule_without_residual,
)
from tiny import build_model
from tiny import decode as decode_one
from torch import nn

import specgen.decoding.verify as engine_module
from specgen.config import GenerationConfig, Method, ModelSettings
from specgen.decoding.build import build_engine
from specgen.errors import ConfigError
from specgen.models.load import load_pair
from specgen.runtime import fp32, int8, int8_model, kvcache, quant
from specgen.runtime.pair import Pair, load

pytestmark = pytest.mark.skipif(not int8.available(), reason="torch lacks the x86/fbgemm int8 kernels")


# -- RowInt8Linear ---------------------------------------------------------------------------------

SHAPES = [(64, 128), (128, 64), (17, 33), (259, 96)]  # (in, out)


def quantized_linear(in_features: int, out_features: int, bias: bool, seed: int = 0):
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    if bias:
        nn.init.normal_(linear.bias, std=0.5)  # not the tiny default init: make the bias matter
    q, scales = int8.quantize_weight(linear.weight)
    return linear, int8.RowInt8Linear(q, scales, linear.bias)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_row_outputs_do_not_depend_on_the_batch_width(shape, bias):
    in_features, out_features = shape
    linear, qlinear = quantized_linear(in_features, out_features, bias)
    x = torch.randn(1, 7, in_features, generator=torch.Generator().manual_seed(1))
    x[0, 3] *= 40.0  # one row far larger than the rest: a shared activation scale would show it
    with torch.no_grad():
        full = qlinear(x)
        assert full.shape == (1, 7, out_features) and full.dtype == torch.float32
        for i in range(7):
            assert torch.equal(qlinear(x[:, i : i + 1]), full[:, i : i + 1]), f"row {i} alone"
        assert torch.equal(qlinear(x[:, :5]), full[:, :5]), "the first 5 rows together"
        assert torch.equal(qlinear(x[0]), full[0])  # 2-D input
        reference = linear(x)
    error = (full - reference).abs().amax() / reference.abs().amax()
    assert error < 0.05, f"relative max error {error:.4f}"
    for i in range(7):  # every row on its own scale, the small rows included
        row_error = (full[0, i] - reference[0, i]).abs().amax() / reference[0, i].abs().amax()
        assert row_error < 0.05, f"row {i}: relative max error {row_error:.4f}"
    assert (qlinear.bias is None) == (not bias)
    torch.testing.assert_close(
        qlinear.weight, linear.weight, atol=linear.weight.abs().amax().item() / 127, rtol=0
    )


def test_bfloat16_input_gives_bfloat16_output():
    linear, qlinear = quantized_linear(64, 48, True)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = qlinear(x.bfloat16())
        reference = linear(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 5, 48)
    assert (out.float() - reference).abs().amax() / reference.abs().amax() < 0.05


def test_quantize_weight_is_symmetric_per_output_channel():
    weight = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [-3.0, 3.0, 1.5]])
    q, scales = int8.quantize_weight(weight)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (3,)
    assert q.abs().amax(dim=1).tolist() == [127, 0, 127]
    torch.testing.assert_close(scales[[0, 2]], torch.tensor([2.0, 3.0]) / 127)
    assert torch.isfinite(scales).all() and (scales > 0).all()  # an all-zero row gets no 0/0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_weight_leaves_its_input_alone_and_rounds_each_row_to_its_scale(dtype):
    """It works in place on its own fp32 copy of each row block (an fp32 weight is not that copy)."""
    weight = torch.randn(20000, 24, generator=torch.Generator().manual_seed(3)).to(dtype)
    before = weight.clone()
    q, scales = int8.quantize_weight(weight)
    assert torch.equal(weight, before)
    expected = weight.float().abs().amax(dim=1).clamp(min=1e-12) / 127.0
    assert torch.equal(scales, expected)
    assert torch.equal(q, torch.round(weight.float() / expected[:, None]).clamp(-127, 127).to(torch.int8))


def test_fused_siblings_give_bitwise_what_separate_linears_give():
    """q/k/v and gate/up run as one product each: same logits to the bit, at every width."""
    separate = int8_model.quantize_model(small_model(2), fuse=False)
    fused = int8_model.quantize_model(small_model(2))
    parts = [m for m in fused.modules() if isinstance(m, int8.RowInt8Part)]
    assert len(parts) == 2 * 5  # q k v, gate up per layer
    assert not any(isinstance(m, int8.RowInt8Part) for m in separate.modules())
    with torch.no_grad():
        for width in (1, 2, 5, 7):
            ids = MODEL_INPUT[:, :width]
            assert torch.equal(fused(ids).logits, separate(ids).logits), width
    for name, module in separate.named_modules():
        if isinstance(module, int8.RowInt8Linear):
            other = fused.get_submodule(name)
            assert (other.in_features, other.out_features) == (module.in_features, module.out_features)
            assert torch.equal(other.weight, module.weight), name
            assert (other.bias is None) == (module.bias is None)
            assert other.bias is None or torch.equal(other.bias, module.bias)


def test_tall_weights_packed_in_row_chunks_give_bitwise_the_same(monkeypatch):
    """Weights taller than CHUNK_ABOVE rows are packed as chunks (fbgemm packs tall weights
    slowly, one thread per weight); the outputs are those of one packed weight, to the bit."""
    whole = int8_model.quantize_model(small_model(2))
    monkeypatch.setattr(int8, "CHUNK_ABOVE", 60)
    monkeypatch.setattr(int8, "CHUNK_ROWS", 48)
    chunked = int8_model.quantize_model(small_model(2))
    assert isinstance(chunked.lm_head._packed, tuple) and len(chunked.lm_head._packed) == 6  # 259 rows
    assert not isinstance(whole.lm_head._packed, tuple)
    fused_chunks = {type(m._fused.packed) for m in chunked.modules() if isinstance(m, int8.RowInt8Part)}
    assert tuple in fused_chunks  # gate/up (2 x 64 rows) is chunked too
    with torch.no_grad():
        for width in (1, 3, 7):
            ids = MODEL_INPUT[:, :width]
            assert torch.equal(chunked(ids).logits, whole(ids).logits), width
    assert torch.equal(chunked.lm_head.weight, whole.lm_head.weight)
    assert torch.equal(chunked.model.layers[0].mlp.up_proj.weight, whole.model.layers[0].mlp.up_proj.weight)


def test_fused_parts_called_in_any_order_or_twice_stay_right():
    separate = int8_model.quantize_model(small_model(), fuse=False).model.layers[0].self_attn
    fused = int8_model.quantize_model(small_model()).model.layers[0].self_attn
    x, y = torch.randn(1, 3, 32), torch.randn(1, 2, 32)
    with torch.no_grad():
        calls = [
            ("k_proj", x),
            ("q_proj", x),
            ("q_proj", x),
            ("v_proj", y),
            ("k_proj", x),
            ("v_proj", x),
            ("q_proj", y),
            ("k_proj", y),
            ("v_proj", y),
        ]
        for name, inp in calls:
            assert torch.equal(getattr(fused, name)(inp), getattr(separate, name)(inp)), name


# -- wide products through oneDNN (AMX CPUs) -------------------------------------------------------

# the default target's (Qwen2.5-1.5B) linear shapes (out, in), and a tall one chunked as lm_head is
TARGET_SHAPES = [(2048, 1536), (1536, 1536), (1536, 8960), (3000, 1536)]


@pytest.mark.skipif(not int8.onednn.usable(), reason="wide int8 products stay fbgemm's on this CPU")
@pytest.mark.parametrize("shape", TARGET_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_wide_products_go_through_onednn_with_fbgemm_s_numbers(shape, monkeypatch):
    """A verify (onednn.WIDE rows or more) multiplies through oneDNN, a plain step through
    fbgemm: each row's output is bitwise the same either way, at every width from 1 to 17."""
    monkeypatch.setattr(int8, "CHUNK_ABOVE", 2500)  # the tall one as row chunks, as lm_head is
    monkeypatch.setattr(int8, "CHUNK_ROWS", 1024)
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 0.02
    linear = int8.linear_of(weight)
    assert linear._wide is not None and len(linear._wide.weights) == (3 if shape[0] > 2500 else 1)
    fbgemm_only = int8.RowInt8Linear.packed(linear._packed, shape, None)
    x = torch.randn(17, shape[1], generator=torch.Generator().manual_seed(4))
    x[5] *= 30.0
    calls = []
    product = int8.onednn.product
    monkeypatch.setattr(int8.onednn, "product", lambda *a: calls.append(len(a[0])) or product(*a))
    with torch.no_grad():
        alone = torch.cat([fbgemm_only(x[i : i + 1]) for i in range(17)])
        for width in range(1, 18):
            assert torch.equal(linear(x[:width]), alone[:width]), width
            assert torch.equal(fbgemm_only(x[:width]), alone[:width]), width
    assert calls == list(range(int8.onednn.WIDE, 18))  # fbgemm below WIDE rows, oneDNN from it


@pytest.mark.skipif(not int8.onednn.usable(), reason="wide int8 products stay fbgemm's on this CPU")
def test_a_shape_where_onednn_rounds_otherwise_stays_with_fbgemm(monkeypatch):
    """oneDNN takes another kernel for toy shapes at few rows (33 x 17 up to 7 rows here): such a
    shape is packed for fbgemm only, and its rows stay exact at every width."""
    monkeypatch.setattr(int8.onednn, "_checked", {})
    linear = int8.linear_of(torch.randn(33, 17, generator=torch.Generator().manual_seed(5)))
    fbgemm_only = int8.RowInt8Linear.packed(linear._packed, (33, 17), None)
    x = torch.randn(9, 17, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(linear(x), torch.cat([fbgemm_only(x[i : i + 1]) for i in range(9)]))
    agrees = int8.onednn._checked[(33, 17)]
    assert (linear._wide is None) == (not agrees)


@pytest.fixture
def fresh_wide_choice(cache_env, monkeypatch):
    int8.onednn.usable.cache_clear()
    monkeypatch.setattr(int8.onednn, "_checked", {})
    yield
    int8.onednn.usable.cache_clear()


def test_fbgemm_serves_every_width_where_onednn_cannot_and_says_so_once(
    fresh_wide_choice, monkeypatch, capsys
):
    monkeypatch.setattr(int8.onednn, "unusable", lambda: "this CPU has no AMX")
    assert int8.linear_of(torch.randn(64, 32))._wide is None
    assert capsys.readouterr().err.count("fbgemm's kernel (this CPU has no AMX") == 1
    int8.onednn.usable.cache_clear()  # another process on the same machine: no second line
    assert not int8.onednn.usable() and capsys.readouterr().err == ""


def test_a_onednn_that_disagrees_with_fbgemm_is_not_used_and_says_so(fresh_wide_choice, monkeypatch, capsys):
    monkeypatch.setattr(int8.onednn, "unusable", lambda: None)
    monkeypatch.setattr(int8.onednn, "product", lambda scaled, *rest: torch.zeros(len(scaled), 1024))
    assert int8.linear_of(torch.randn(1024, 512))._wide is None
    assert "does not give fbgemm's numbers for 1024x512" in capsys.readouterr().err


def test_the_user_can_keep_fbgemm_for_every_width(fresh_wide_choice, monkeypatch, capsys):
    monkeypatch.setenv(int8.onednn.ENV, "fbgemm")
    assert not int8.onednn.usable() and int8.linear_of(torch.randn(64, 32))._wide is None
    assert capsys.readouterr().err == ""  # chosen, so nothing to say


@pytest.mark.skipif(not int8.onednn.usable(), reason="wide int8 products stay fbgemm's on this CPU")
def test_weights_loaded_for_short_work_are_packed_for_fbgemm_only(monkeypatch):
    """Within `fbgemm_only` (a single short answer) no weight is packed for oneDNN, and the rows
    are what they are otherwise; outside it, and with SPECGEN_INT8_WIDE=onednn inside it, they are."""
    weight = torch.randn(2048, 1536, generator=torch.Generator().manual_seed(7)) * 0.02
    wide = int8.linear_of(weight)
    with int8.onednn.fbgemm_only():
        short = int8.linear_of(weight)
    assert wide._wide is not None and short._wide is None and not int8.onednn._fbgemm_only
    x = torch.randn(6, 1536, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert torch.equal(short(x), wide(x))
    model = nn.Sequential(nn.Linear(64, 64))
    assert not int8.has_wide(model)
    assert int8.has_wide(nn.Sequential(wide)) and not int8.has_wide(nn.Sequential(short))
    monkeypatch.setenv(int8.onednn.ENV, "onednn")
    with int8.onednn.fbgemm_only():
        assert int8.linear_of(weight)._wide is not None


def test_short_work_is_one_answer_below_the_measured_break_even():
    assert int8.onednn.short_work(256, "hi")
    assert int8.onednn.short_work(int8.onednn.SHORT_TOKENS, "x" * int8.onednn.SHORT_PROMPT_CHARS)
    assert not int8.onednn.short_work(int8.onednn.SHORT_TOKENS + 1, "hi")
    assert not int8.onednn.short_work(64, "x" * (int8.onednn.SHORT_PROMPT_CHARS + 1))


# -- quantize_model and its on-disk cache ----------------------------------------------------------

MODEL_INPUT = torch.tensor([[257, 84, 82, 68, 81, 198, 71]])


def small_model(layers: int = 1):
    """A fresh copy of the same tiny random Qwen2 (same seed, same weights every call)."""
    return build_model(5, layers=layers, hidden=32)


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(MODEL_INPUT).logits


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "specgen-cache"))
    return tmp_path


def forbid_quantizing(monkeypatch):
    def refuse(weight):
        raise AssertionError("quantize_weight called: the cache was not used")

    monkeypatch.setattr(int8, "quantize_weight", refuse)


def test_quantize_model_replaces_every_linear():
    model = int8_model.quantize_model(small_model(2))
    assert not int8_model.linear_names(model)
    quantized = [m for m in model.modules() if isinstance(m, int8.RowInt8Linear)]
    assert len(quantized) == 2 * 7 + 1  # q k v o gate up down per layer, and the head
    assert all(p.dtype == torch.float32 for p in model.parameters())
    reference = logits_of(small_model(2))
    logits = logits_of(model)
    assert not torch.equal(logits, reference)  # really quantized
    assert (logits - reference).abs().amax() / reference.abs().amax() < 0.1


def test_cache_is_written_then_read(cache_env, monkeypatch):
    cache = cache_env / "int8" / "model.safetensors"
    first = quant.quantize_cached(small_model(), cache)
    assert cache.is_file() and cache.stat().st_size > 0
    assert not list(cache.parent.glob(".*.tmp"))  # the temporary file was renamed into place
    written = cache.stat().st_mtime_ns
    forbid_quantizing(monkeypatch)
    second = quant.quantize_cached(small_model(), cache)
    assert isinstance(second.lm_head, int8.RowInt8Linear)
    assert torch.equal(logits_of(second), logits_of(first))
    assert cache.stat().st_mtime_ns == written  # read, not rewritten


@pytest.mark.parametrize("damage", ["truncated", "garbage", "another-model"])
def test_a_damaged_or_foreign_cache_is_ignored_and_overwritten(cache_env, monkeypatch, capsys, damage):
    cache = cache_env / "int8" / "model.safetensors"
    expected = logits_of(quant.quantize_cached(small_model(), cache))
    if damage == "truncated":
        data = cache.read_bytes()
        cache.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        cache.write_bytes(b"\x00not a safetensors file" * 10)
    else:  # a valid cache file of a model with other linears
        cache.unlink()
        quant.quantize_cached(small_model(layers=2), cache)
    capsys.readouterr()
    again = quant.quantize_cached(
        small_model(), cache
    )  # quantizes again, no error, and says so (quiet or not)
    assert "quantizing again" in capsys.readouterr().err
    assert torch.equal(logits_of(again), expected)
    forbid_quantizing(monkeypatch)  # ... and the file now holds this model's weights
    assert torch.equal(logits_of(quant.quantize_cached(small_model(), cache)), expected)


@pytest.mark.parametrize("where", ["weights", "scales"])
def test_a_cache_scrambled_in_place_fails_its_checksum_and_is_rebuilt(cache_env, monkeypatch, capsys, where):
    """Bytes of the tensor data changed, the file's size and header intact: without the
    checksum these weights would load and decode other tokens, silently."""
    cache = cache_env / "int8" / "model.safetensors"
    expected = logits_of(quant.quantize_cached(small_model(), cache))
    data = bytearray(cache.read_bytes())
    size = int.from_bytes(data[:8], "little")
    layout = json.loads(data[8 : 8 + size])
    name = next(n for n in layout if n.endswith(".qweight" if where == "weights" else ".scales"))
    begin, end = (8 + size + offset for offset in layout[name]["data_offsets"])
    data[begin:end] = bytes((b + 1) % 256 for b in data[begin:end])  # every byte of one tensor
    cache.write_bytes(bytes(data))
    again = quant.quantize_cached(small_model(), cache, quiet=False)
    assert "do not match their checksum; quantizing again" in capsys.readouterr().err
    assert torch.equal(logits_of(again), expected)
    forbid_quantizing(monkeypatch)  # rewritten with a good checksum
    assert torch.equal(logits_of(quant.quantize_cached(small_model(), cache, quiet=False)), expected)
    assert "checksum" not in capsys.readouterr().err


def test_a_cache_path_that_is_a_directory_does_not_raise(cache_env):
    cache = cache_env / "int8" / "model.safetensors"
    cache.mkdir(parents=True)
    expected = logits_of(int8_model.quantize_model(small_model()))
    assert torch.equal(logits_of(quant.quantize_cached(small_model(), cache, quiet=False)), expected)
    assert cache.is_dir() and not list(cache.parent.glob(".*.tmp"))


def test_a_cache_under_a_regular_file_does_not_raise(cache_env):
    blocker = cache_env / "not-a-directory"
    blocker.write_text("a regular file where the cache directory should be")
    expected = logits_of(int8_model.quantize_model(small_model()))
    model = quant.quantize_cached(small_model(), blocker / "int8" / "model.safetensors", quiet=False)
    assert torch.equal(logits_of(model), expected)


try:
    from safetensors import SafetensorError
except ImportError:  # older safetensors: only the Rust module's name
    from safetensors._safetensors_rust import SafetensorError


def test_a_failing_cache_write_does_not_raise(cache_env, monkeypatch):
    cache = cache_env / "int8" / "model.safetensors"

    def failing_save(tensors, path, metadata=None):  # root ignores permissions: fail the write itself
        raise SafetensorError("disk trouble")

    monkeypatch.setattr(quant, "save_file", failing_save)
    expected = logits_of(int8_model.quantize_model(small_model()))
    assert torch.equal(logits_of(quant.quantize_cached(small_model(), cache, quiet=False)), expected)


# -- cache_file_for --------------------------------------------------------------------------------


def test_cache_file_for_needs_a_directory_with_safetensors(tiny_dirs, tmp_path, cache_env):
    weights = sorted(tiny_dirs["target"].glob("*.safetensors"))
    assert weights
    assert quant.cache_file_for(weights[0]) is None  # a file
    assert quant.cache_file_for(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert quant.cache_file_for(tmp_path / "empty") is None  # no weights to key on


def test_cache_file_for_changes_with_the_weights(tiny_dirs, tmp_path, cache_env):
    model_dir = shutil.copytree(tiny_dirs["target"], tmp_path / "model")  # never touch the shared dir
    key = quant.cache_file_for(model_dir, "target")
    assert key is not None
    assert key.parent == cache_env / "specgen-cache" / "int8" and key.suffix == ".safetensors"
    assert quant.cache_file_for(model_dir, "target") == key  # stable
    assert quant.cache_file_for(model_dir, "draft") != key  # the role is part of the key
    weights = sorted(model_dir.glob("*.safetensors"))[0]
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same size, newer
    touched = quant.cache_file_for(model_dir, "target")
    assert touched != key
    with open(weights, "ab") as fh:  # same name, another size
        fh.write(b"\0" * 8)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    resized = quant.cache_file_for(model_dir, "target")
    assert resized not in (key, touched)


def test_caching_one_model_keeps_the_cache_of_another(tmp_path, cache_env):
    caches = []
    for name in ("Qwen2.5-0.5B-Instruct", "Qwen2.5-0.5B"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(name.encode())  # only stat'ed for the key
        caches.append(quant.cache_file_for(tmp_path / name, "target"))
        quant.quantize_cached(small_model(), caches[-1])
    assert caches[0] != caches[1] and caches[1].is_file()
    assert caches[0].is_file(), "caching Qwen2.5-0.5B deleted the cache of Qwen2.5-0.5B-Instruct"


def test_two_folders_of_one_name_keep_their_caches(tmp_path, cache_env):
    """a/final and b/final (two fine-tunes saved under the same folder name) each keep their
    int8 file; a file named as before the folder's mark is replaced by the new one."""
    caches = []
    for parent in ("a", "b"):
        folder = tmp_path / parent / "final"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(parent.encode())
        caches.append(quant.cache_file_for(folder, "target"))
    legacy = caches[0].parent / "final.target.0123456789abcdef.safetensors"
    legacy.parent.mkdir(parents=True, exist_ok=True)
    legacy.write_bytes(b"old")
    for cache in caches:
        quant.quantize_cached(small_model(), cache)
    assert caches[0] != caches[1] and all(cache.is_file() for cache in caches)
    assert not legacy.exists()


# -- parse_target_quant and resolve_target_quant ---------------------------------------------------


def test_parse_target_quant():
    assert quant.parse_target_quant(None) == "none"
    assert quant.parse_target_quant(" INT8 ") == "int8"
    assert quant.parse_target_quant("auto") == "auto"
    for bad in ("int4", "int8-wo", "fp8", "prune"):
        with pytest.raises(ConfigError) as info:
            quant.parse_target_quant(bad)
        assert "--target-quant" in str(info.value) and bad in str(info.value)


def stand_in(source: str, device: str = "cpu"):
    return SimpleNamespace(model=nn.Linear(2, 2, device=device), source=source)


def test_resolve_target_quant():
    for source in ("dir", "gguf", "catalog", "hub"):
        assert quant.resolve_target_quant("int8", stand_in(source)) == "int8"
        assert quant.resolve_target_quant("int8", stand_in(source), dtype_auto=False) == "int8"
        assert quant.resolve_target_quant("none", stand_in(source)) == "none"
    assert quant.resolve_target_quant("auto", stand_in("dir")) == "none"
    assert quant.resolve_target_quant("auto", stand_in("hub")) == "none"
    for source in ("gguf", "catalog"):
        assert quant.resolve_target_quant("auto", stand_in(source), dtype_auto=True) == "int8"
        assert quant.resolve_target_quant("auto", stand_in(source), dtype_auto=False) == "none"
        assert quant.resolve_target_quant("auto", stand_in(source, device="meta")) == "none"  # not on the CPU
    with pytest.raises(ConfigError, match="--device cpu"):
        quant.resolve_target_quant("int8", stand_in("dir", device="meta"))
    with pytest.raises(ConfigError, match="--target-quant"):
        quant.resolve_target_quant("int4", stand_in("gguf"))


# -- the int8 target: greedy speculation reproduces plain decoding of the same int8 model ---------

PROMPTS = [PROMPT, [257, 84, 82, 68, 81, 198] * 3, [224]]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def int8_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("int8-cache")


@pytest.fixture(scope="module")
def int8_pair(tiny_dirs, int8_cache):
    """The tiny pair through runtime.pair.load with --target-quant int8 (the draft unquantized)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECGEN_CACHE", str(int8_cache))
        settings = ModelSettings(
            str(tiny_dirs["target"]),
            str(tiny_dirs["draft"]),
            "cpu",
            None,
            "float32",
            "none",
            "off",
            target_quant="int8",
        )
        return load(settings, Method.CHAIN, quiet=True)


@pytest.fixture(scope="module")
def fp32_target(tiny_dirs):
    target, _ = load_pair(str(tiny_dirs["target"]), None, device="cpu", dtype="float32", quiet=True)
    return target


@pytest.fixture(scope="module")
def self_draft_pair(int8_pair, fp32_target):
    """The int8 target drafted by its own fp32 weights: most drafts are accepted, so the deep
    positions of every verify forward decide tokens (the tiny draft is almost always wrong)."""
    return Pair(int8_pair.target, fp32_target, "off")


def decode(pair, method: Method, prompt: list[int], **settings) -> list[int]:
    config = GenerationConfig(method=method, max_new_tokens=NEW_TOKENS, **settings)
    _, state = decode_one(build_engine(pair, config), prompt, config)
    return state.final_ids()


@pytest.fixture(scope="module")
def int8_plain(int8_pair):
    return [decode(int8_pair, Method.PLAIN, prompt) for prompt in PROMPTS]


def test_the_target_really_is_int8(int8_pair, int8_cache, fp32_target, int8_plain):
    target = int8_pair.target
    assert target.weights == "int8" and target.dtype == torch.float32
    assert not int8_model.linear_names(target.model)  # no nn.Linear left
    quantized = [m for m in target.model.modules() if isinstance(m, int8.RowInt8Linear)]
    assert len(quantized) == 2 * 7 + 1
    assert int8_pair.draft.weights == "none"
    assert any(isinstance(m, nn.Linear) for m in int8_pair.draft.model.modules())
    # the int8 target is a different model from the fp32 one: its greedy text differs
    fp32_plain = [decode(Pair(fp32_target, None), Method.PLAIN, prompt) for prompt in PROMPTS]
    assert any(a != b for a, b in zip(int8_plain, fp32_plain))
    assert all(len(ids) == NEW_TOKENS for ids in int8_plain)
    # the int8 weights were cached where SPECGEN_CACHE pointed (not in the user's cache)
    assert len(list((int8_cache / "int8").glob("*.safetensors"))) == 1


def test_plain_with_a_cache_equals_recomputing_the_whole_sequence(int8_pair, int8_plain):
    target = int8_pair.target
    for prompt, plain in zip(PROMPTS, int8_plain):
        assert plain == reference_greedy(target.model, prompt, NEW_TOKENS, target.stop_ids)


def test_a_verify_forward_scores_each_token_bitwise_as_a_plain_step(int8_pair):
    model = int8_pair.target.model
    tokens = torch.tensor([[84, 82, 68, 81, 198, 71]])
    with torch.no_grad():
        wide = kvcache.new_cache(model)
        kvcache.forward(model, wide, torch.tensor([PROMPT]))
        together = kvcache.forward(model, wide, tokens)[0]
        narrow = kvcache.new_cache(model)
        kvcache.forward(model, narrow, torch.tensor([PROMPT]))
        steps = torch.cat(
            [kvcache.forward(model, narrow, tokens[:, i : i + 1])[0] for i in range(tokens.shape[1])]
        )
    assert torch.equal(together, steps)


# eagle drafts from a head: tests/test_eagle.py
METHOD_SETTINGS = [dict(method=method) for method in Method if method is not Method.EAGLE] + [
    dict(method=Method.CHAIN, draft_tokens=7),
    dict(method=Method.CHAIN, deterministic=True, verify_window=8),
    dict(method=Method.RSD_C, deterministic=True, verify_window=8),
]


def settings_id(settings) -> str:
    extra = "-".join(f"{k}={v}" for k, v in settings.items() if k != "method")
    return settings["method"].value + (f"-{extra}" if extra else "")


@pytest.mark.parametrize("settings", METHOD_SETTINGS, ids=settings_id)
def test_greedy_methods_reproduce_plain_decoding_of_the_int8_target(
    int8_pair, self_draft_pair, int8_plain, settings
):
    for draft_name, pair in (("tiny draft", int8_pair), ("fp32 self-draft", self_draft_pair)):
        for prompt, plain in zip(PROMPTS, int8_plain):
            out = decode(pair, prompt=prompt, **settings)
            assert out == plain, f"{settings_id(settings)} with the {draft_name}, prompt {prompt[:6]}..."


def test_self_draft_accepts_most_drafts(self_draft_pair):
    """So the test above exercises deep verify positions, not only rejected first drafts."""
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=NEW_TOKENS)
    rounds, _ = decode_one(build_engine(self_draft_pair, config), PROMPT, config)
    assert sum(r.accepted for r in rounds) >= NEW_TOKENS // 2


def shared_scale_row_linear(x, packed, bias, wide=None):
    """BROKEN on purpose: ONE activation scale for the whole forward (as torch's
    quantize_dynamic does), so a token's logits depend on the other tokens of its forward."""
    rows = x.float()
    peak = rows.abs().amax().clamp(min=1e-30)
    out = (
        torch.cat(
            [
                torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                    rows / peak, int8._INPUT_SCALE, int8._ZERO_POINT, p
                )
                for p in (packed if isinstance(packed, tuple) else (packed,))
            ],
            -1,
        )
        * peak
    )
    if bias is not None:
        out = out + bias
    return out.to(x.dtype)


def test_control_a_shared_activation_scale_is_caught(self_draft_pair, monkeypatch):
    """Negative control: the same harness with width-dependent int8 linears fails."""
    monkeypatch.setattr(int8, "row_linear", shared_scale_row_linear)
    caught = []
    for prompt in PROMPTS:
        plain = decode(self_draft_pair, Method.PLAIN, prompt)
        for method in (Method.CHAIN, Method.RSD_C):
            caught.append(decode(self_draft_pair, method, prompt) != plain)
    assert any(caught), "width-dependent int8 linears passed the exactness check"


# -- sampling: chain speculative sampling follows the int8 target's own law -----------------------


@pytest.fixture(scope="module")
def int8_law(int8_pair):
    """The int8 target's exact warped laws: q0 [V] and the pair law q0(t1) q1(t2 | t1) [V, V]."""
    from tiny import two_token_law

    return two_token_law(int8_pair.target.model, ENGINE_PROMPT, ENGINE_SAMPLING)


@pytest.mark.statistical
def test_chain_sampling_follows_the_int8_target_law(int8_pair, int8_law):
    """1200 chain generations (temperature 1, top-p 0.95, k = 1): first tokens ~ q0 and pairs
    ~ q0 q1 of the int8 target. Each chi-square fails by chance with alpha = 1e-3."""
    tokens = first_two_tokens(
        make_engine((int8_pair.target, int8_pair.draft)), Method.CHAIN, range(SPEC_GENERATIONS)
    )
    assert_pairs_follow(tokens, int8_law)


@pytest.mark.statistical
def test_control_sampling_without_residual_fails_with_the_int8_target(int8_pair, int8_law, monkeypatch):
    """Negative control: the no-residual acceptance rule must fail the first-token test."""
    monkeypatch.setattr(engine_module, "speculative_sampling", rule_without_residual)
    tokens = first_two_tokens(
        make_engine((int8_pair.target, int8_pair.draft)),
        Method.CHAIN,
        range(5000, 5000 + CONTROL_GENERATIONS),
    )
    q0, _ = int8_law
    pvalue = gof_pvalue(tokens[:, 0], q0)
    assert pvalue < SMALL_ALPHA, f"the broken rule passed: p-value {pvalue:.3g}"


# -- CLI ---------------------------------------------------------------------------------------------


def cli(*args):
    from typer.testing import CliRunner

    from specgen.cli import app

    return CliRunner().invoke(app, list(args))


def test_cli_refuses_a_bad_target_quant(tiny_dirs, cache_env):
    models = [
        "--target",
        str(tiny_dirs["target"]),
        "--draft",
        str(tiny_dirs["draft"]),
        "--device",
        "cpu",
        "--dtype",
        "float32",
    ]
    for command in (["run", "hi"], ["run", "hi", "--method", "plain"]):
        result = cli(*command, *models, "--target-quant", "bogus")
        assert_one_line_error(result, "--target-quant", "bogus")
    assert not (cache_env / "specgen-cache" / "int8").exists()


def test_cli_int8_target_chain_equals_plain(tiny_dirs, cache_env):
    models = [
        "--target",
        str(tiny_dirs["target"]),
        "--draft",
        str(tiny_dirs["draft"]),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "-n",
        "16",
        "--format",
        "json",
        "--raw",
    ]
    outputs = {}
    for method in ("plain", "chain", "rsd-c"):
        result = cli("run", "hello there", *models, "--method", method, "--target-quant", "int8")
        assert result.exit_code == 0, result.output
        outputs[method] = json.loads(result.stdout.strip().splitlines()[-1])["token_ids"]
    assert outputs["plain"] == outputs["chain"] == outputs["rsd-c"] and len(outputs["plain"]) == 16
    cached = list((cache_env / "specgen-cache" / "int8").glob("*.safetensors"))
    assert len(cached) == 1 and cached[0].name.startswith(tiny_dirs["target"].name)


def test_a_16_bit_model_quantizes_without_an_fp32_copy_and_gives_the_same_logits(monkeypatch):
    """Only what is left after the linears becomes fp32; the embedding keeps its 16-bit table and
    returns fp32 rows. Bitwise what converting the whole model to fp32 first gave, and from a
    cache no linear weight is converted at all (a memory-mapped checkpoint never pages it in)."""
    reference = int8_model.quantize_model(small_model(2).to(torch.bfloat16).float())
    weights = {}
    lean = int8_model.quantize_model(small_model(2).to(torch.bfloat16), store=weights.update)
    embedding = lean.get_input_embeddings()
    assert isinstance(embedding, fp32.Fp32Embedding) and embedding.weight.dtype == torch.bfloat16
    assert fp32.compute_dtype(lean) == torch.float32
    assert all(p.dtype == torch.float32 for n, p in lean.named_parameters() if "embed" not in n)
    assert torch.equal(logits_of(lean), logits_of(reference))

    monkeypatch.setattr(int8, "quantize_weight", lambda weight: pytest.fail("a cached linear was converted"))
    cached = int8_model.quantize_model(small_model(2).to(torch.bfloat16), cached=lambda shapes: dict(weights))
    assert torch.equal(logits_of(cached), logits_of(reference))


def test_a_torch_without_the_quantized_ops_loads_without_int8(monkeypatch):
    """torch 2.13 deprecates the quantized ops the kernel is reached by: where they are gone,
    int8 is not available, `auto` keeps the model's own weights and an explicit int8 is refused
    in one line (benchmarks/int8-kernels.md: no replacement is as fast yet)."""
    from specgen.errors import ConfigError
    from specgen.runtime import int8, quant

    assert int8.available() and not int8.has_op("no_such_op")
    monkeypatch.setattr(int8, "OPS", int8.OPS + ("no_such_op",))
    assert not int8.available()
    target = SimpleNamespace(path=None, source="catalog", model=nn.Linear(4, 4))
    assert quant.resolve_target_quant("auto", target) == "none"
    with pytest.raises(ConfigError, match="int8 kernels, which this build lacks"):
        quant.resolve_target_quant("int8", target)
