"""Placement decisions, tested without a GPU: device parsing, dtypes, multi-GPU device maps."""

from __future__ import annotations

import pytest
import torch

from specgen.errors import ConfigError
from specgen.models import placement


def test_auto_without_gpu_is_cpu():
    kind, gpus, draft = placement.plan("auto", None, cuda_count=0)
    assert (kind, gpus, draft) == ("cpu", [], torch.device("cpu"))


def test_single_gpu_holds_both():
    kind, gpus, draft = placement.plan("cuda:1", None, cuda_count=2)
    assert (kind, gpus, draft) == ("single", [1], torch.device("cuda:1"))


def test_several_gpus_split_the_target_and_draft_goes_where_memory_is_free():
    budgets = {0: 10 << 30, 1: 30 << 30, 2: 20 << 30}
    kind, gpus, draft = placement.plan("cuda", None, cuda_count=3, budgets=budgets)
    assert kind == "split" and gpus == [0, 1, 2]
    assert draft == torch.device("cuda:1")


def test_draft_device_option_wins():
    _, _, draft = placement.plan("cuda", "cuda:0", cuda_count=2, budgets={0: 1, 1: 9})
    assert draft == torch.device("cuda:0")
    _, _, draft = placement.plan("cuda", "cpu", cuda_count=2, budgets={0: 1, 1: 9})
    assert draft == torch.device("cpu")


@pytest.mark.parametrize(
    "device, count, fragment",
    [
        ("tpu", 0, "unknown device"),
        ("cuda", 0, "no CUDA device"),
        ("cuda:2", 2, "does not exist"),
        ("cuda:x", 2, "unknown device"),
    ],
)
def test_bad_devices(device, count, fragment):
    with pytest.raises(ConfigError, match=fragment):
        placement.plan(device, None, cuda_count=count)


def test_bad_draft_device():
    with pytest.raises(ConfigError, match="not available"):
        placement.plan("cpu", "cuda:0", cuda_count=0)


def test_dtypes():
    assert placement.resolve_dtype("float32", torch.device("cpu")) is torch.float32
    assert placement.resolve_dtype("bf16", torch.device("cpu")) is torch.bfloat16
    assert placement.resolve_dtype("auto", torch.device("cpu")) in (torch.bfloat16, torch.float32)
    with pytest.raises(ConfigError, match="unknown dtype"):
        placement.resolve_dtype("int3", torch.device("cpu"))


def test_device_map_spreads_layers_over_memory_budgets():
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    # each decoder layer is ~2.4 MB in fp32, embeddings and head ~1 MB each
    device_map = placement.split_device_map(config, torch.float32, {0: "8MB", 1: "8MB", 2: "40MB"})
    used = set(device_map.values())
    assert {0, 1} <= used, device_map
    layer_devices = [device_map.get(f"model.layers.{i}", None) for i in range(8)]
    assert layer_devices == sorted(layer_devices), "layers stay in order across devices"
    assert placement.first_device(device_map) == torch.device("cuda:0")


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"avx", "avx2", "avx512f", "avx512bw", "avx512_bf16"}, torch.bfloat16),  # Zen 5, Sapphire Rapids
        ({"avx", "avx2", "amx_bf16", "amx_tile"}, torch.bfloat16),
        ({"sse4_2", "avx", "avx2", "fma"}, torch.float32),  # Zen 3: AVX2 only
        ({"sse4_2", "avx"}, torch.float32),
    ],
)
def test_cpu_format_from_flags_is_deterministic(flags, expected):
    chosen = placement.choose_cpu_dtype(frozenset(flags))
    assert chosen.dtype is expected and chosen.reason
    assert placement.choose_cpu_dtype(frozenset(flags)) == chosen


@pytest.mark.parametrize("flags", [frozenset({"avx2", "avx512f", "avx512bw"}), frozenset({"neon"}), None])
def test_cpu_format_is_measured_where_flags_do_not_say(flags):
    assert placement.choose_cpu_dtype(flags) is None  # AVX-512 without bf16, another ISA, no flags


def test_cpu_without_working_bf16_gets_fp32():
    assert placement.choose_cpu_dtype(frozenset({"avx512_bf16"}), bf16_works=False).dtype is torch.float32


def test_measured_cpu_format_is_cached_per_machine(tmp_path, monkeypatch):
    cache = tmp_path / "cpu-format.json"
    times = {torch.float32: 0.010, torch.bfloat16: 0.004}
    monkeypatch.setattr(placement, "_decode_step_seconds", lambda dtype: times[dtype])
    first = placement.measured_cpu_format(cache)
    assert first.dtype is torch.bfloat16 and "measured" in first.reason and cache.is_file()

    def never(dtype):
        raise AssertionError("measured again")

    monkeypatch.setattr(placement, "_decode_step_seconds", never)
    assert placement.measured_cpu_format(cache) == first


def test_a_measured_format_is_another_cpus_only_under_its_name(tmp_path, monkeypatch):
    """The key held `platform.processor()`, empty (or `x86_64`) on Linux: a cache shared by
    machines (a shared home, SPECGEN_CACHE on a network disk) gave every CPU the first one's choice."""
    cache = tmp_path / "cpu-format.json"
    monkeypatch.setattr(placement, "cpu_name", lambda: "CPU one")
    monkeypatch.setattr(placement, "_decode_step_seconds", {torch.float32: 0.010, torch.bfloat16: 0.004}.get)
    assert placement.measured_cpu_format(cache).dtype is torch.bfloat16
    monkeypatch.setattr(placement, "cpu_name", lambda: "CPU two")
    monkeypatch.setattr(placement, "_decode_step_seconds", {torch.float32: 0.004, torch.bfloat16: 0.010}.get)
    assert placement.measured_cpu_format(cache).dtype is torch.float32


@pytest.mark.parametrize(
    "content",
    [
        "null",
        "[1, 2]",
        '"bfloat16"',
        "{not json",
        '{"key": KEY, "dtype": null}',
        '{"key": KEY, "dtype": "int4", "reason": "x"}',
        '{"key": KEY, "dtype": "float32", "reason": 3}',
    ],
)
def test_a_cached_format_that_does_not_validate_is_measured_again(tmp_path, monkeypatch, capsys, content):
    """Whatever cpu-format.json holds (null, a list, a bad dtype), a run measures again and says so
    once; it never crashes on what it reads back."""
    import json

    cache = tmp_path / "cpu-format.json"
    key = placement.format_key()
    cache.write_text(content.replace("KEY", json.dumps(key)))
    times = {torch.float32: 0.004, torch.bfloat16: 0.010}
    monkeypatch.setattr(placement, "_decode_step_seconds", lambda dtype: times[dtype])
    chosen = placement.measured_cpu_format(cache)
    assert chosen.dtype is torch.float32
    assert "not a valid CPU format record; measuring again" in capsys.readouterr().err
    assert json.loads(cache.read_text())["dtype"] == "float32"  # written back valid


def test_auto_dtype_on_the_cpu_follows_the_chosen_format(monkeypatch):
    monkeypatch.setattr(placement, "_CHOSEN", placement.CpuFormat(torch.float32, "test"))
    assert placement.resolve_dtype("auto", torch.device("cpu")) is torch.float32
    monkeypatch.setattr(placement, "_CHOSEN", placement.CpuFormat(torch.bfloat16, "test"))
    assert placement.resolve_dtype("auto", torch.device("cpu")) is torch.bfloat16
