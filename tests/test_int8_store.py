"""The int8 store (runtime/int8_store.py): a GGUF model on the int8 path loads from int8 linears
plus the non-linear tensors, never from a full-precision copy, and runs bitwise as the model
quantized from a converted copy does."""

from __future__ import annotations

import json

import pytest
import torch
from gguf_factory import write_tiny_gguf
from safetensors.torch import load_file

from specgen.config import Method, ModelSettings
from specgen.models import cache as cache_mod
from specgen.models import convert
from specgen.models.load import load_model, read_model
from specgen.models.plan import plan_model
from specgen.runtime import forms, int8, int8_store, pair, quant, store_shards

IDS = torch.tensor([[5, 17, 99, 3, 40, 200, 7, 7, 120]])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def ggufs(tmp_path):
    return {
        "target": write_tiny_gguf(tmp_path / "g" / "target.gguf", arch="qwen2", seed=3, tied=True),
        "draft": write_tiny_gguf(tmp_path / "g" / "draft.gguf", arch="qwen2", seed=4, hidden=32, tied=True),
        "untied": write_tiny_gguf(tmp_path / "g" / "untied.gguf", arch="llama", seed=5),
    }


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def from_store(gguf):
    """The model of a GGUF source read from its int8 store (built first), as a pair on the int8
    path reads it: planned, its store checked, read with its linears on the meta device."""
    planned = plan_model(str(gguf), dtype=torch.bfloat16, device_map=None, input_device=torch.device("cpu"))
    return read_model(
        planned.reading(*int8_store.checked(planned.resolved, planned.dtype, quiet=True)), quiet=True
    )


def settings(target, draft, **kwargs) -> ModelSettings:
    return ModelSettings(target=str(target), draft=str(draft), device="cpu", dtype="bfloat16", **kwargs)


def test_a_gguf_pair_on_the_int8_path_loads_from_its_store_bitwise_as_from_a_converted_copy(
    cache, ggufs, capsys, monkeypatch
):
    monkeypatch.setattr(forms.os, "cpu_count", lambda: 2)  # the draft's store is built beside the target's
    loaded = pair.load(
        settings(ggufs["target"], ggufs["draft"], target_quant="int8", draft_quant="int8"), Method.CHAIN
    )
    assert "building the int8 weights of draft.gguf alongside" in capsys.readouterr().err  # a first run
    assert not (cache / "converted").exists()  # no full-precision copy was made
    stores = sorted(p.name for p in (cache / "int8").iterdir())
    assert stores == [f"{convert.file_key(ggufs[r])}-bfloat16.store" for r in ("draft", "target")]
    assert loaded.target.weights == "int8" and loaded.draft.weights == "int8"
    assert int8_store.is_store(loaded.target.path) and loaded.target.tokenizer.eos_token == "<|im_end|>"
    # the same models quantized from converted copies (the path of a local directory)
    dirs = {
        role: convert.ensure_converted(ggufs[role], torch.bfloat16, quiet=True)
        for role in ("target", "draft")
    }
    reference = pair.load(
        settings(dirs["target"], dirs["draft"], target_quant="int8", draft_quant="int8"), Method.CHAIN
    )
    assert torch.equal(logits(loaded.target.model), logits(reference.target.model))
    assert torch.equal(logits(loaded.draft.model), logits(reference.draft.model))
    assert not any(p.is_meta for p in loaded.target.model.parameters())


@pytest.mark.parametrize("name", ["draft", "untied"])
def test_a_pruned_int8_draft_from_the_store_is_the_one_from_a_converted_copy(cache, ggufs, name, monkeypatch):
    monkeypatch.setattr(convert, "SHARD_BYTES", 5_000)  # many shards: a weight and its scales may be apart
    stored = from_store(ggufs[name])
    directory = convert.ensure_converted(ggufs[name], torch.bfloat16, quiet=True)
    plain = load_model(
        str(directory), dtype=torch.bfloat16, device_map=None, input_device=torch.device("cpu"), quiet=True
    )
    models = [
        quant.apply_draft_quant(m.model, "int8+prune", keep=100, special_ids=(318, 319), source=m.path)
        for m in (stored, plain)
    ]
    ours, theirs = logits(models[0]), logits(models[1])
    static = list(range(100)) + [318, 319]
    assert torch.equal(ours[..., static], theirs[..., static])
    assert torch.isinf(ours[..., 150]).all()  # pruned: an id never read is never proposed
    # ids read later take rows of the head: the embedding's when tied (the same), else the
    # dequantized int8 rows of an untied head (its full-precision rows are not stored)
    read = sorted(set(IDS.flatten().tolist()) - set(static))
    if name == "draft":
        assert torch.equal(ours, theirs)
    else:
        assert torch.allclose(ours[..., read], theirs[..., read], rtol=0.05, atol=0.05)


def test_the_store_holds_int8_linears_and_16_bit_tables_only(cache, ggufs):
    resolved = _resolved(ggufs["target"])
    directory = int8_store.ensure(resolved, torch.float32, quiet=True)
    rest = {k: v for f in directory.glob("rest-*.safetensors") for k, v in load_file(f).items()}
    weights = {k: v for f in directory.glob("int8-*.safetensors") for k, v in load_file(f).items()}
    assert rest["model.embed_tokens.weight"].dtype == torch.bfloat16  # a table of an fp32 load: 16-bit
    assert rest["model.norm.weight"].dtype == torch.float32
    assert not any(name.endswith("proj.weight") for name in rest)
    assert weights["lm_head.qweight"].dtype == torch.int8  # the tied head, quantized from the embedding
    assert weights["model.layers.0.mlp.up_proj.qweight"].dtype == torch.int8
    assert json.loads((directory / ".complete").read_text())["source"] == "gguf"


def _store_tensors(directory) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch,tied", [("qwen2", True), ("llama", False)])
def test_vocabulary_tables_built_in_row_blocks_give_the_same_store(tmp_path, monkeypatch, arch, tied, dtype):
    """A tall vocabulary table is dequantized, quantized and cast a block of rows at a time
    (never whole at full precision): the store is bitwise the one built from whole tables."""
    gguf = write_tiny_gguf(tmp_path / "q.gguf", arch=arch, seed=6, tied=tied, quantized_tables=True)
    seen = []
    stored = int8_store._stored
    monkeypatch.setattr(
        int8_store, "_stored", lambda tensor, *a: seen.append(type(tensor)) or stored(tensor, *a)
    )
    stores = {}
    for rows in (10**9, 7):  # whole tables, then blocks of 7 rows (the 320-row tables end in a ragged block)
        monkeypatch.setattr(convert, "BLOCK_ROWS", rows)
        monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / f"cache-{rows}"))
        seen.clear()
        stores[rows] = _store_tensors(int8_store.ensure(_resolved(gguf), dtype, quiet=True))
        assert seen.count(convert.RowBlocks) == (0 if rows > 320 else 1 if tied else 2)
    whole, blocked = stores.values()
    assert whole.keys() == blocked.keys() and "lm_head.qweight" in whole
    assert all(torch.equal(whole[name], blocked[name]) for name in whole)
    # and the blocks are those rows of the whole: the int8 head matches quantizing a converted copy
    directory = convert.ensure_converted(gguf, dtype, quiet=True)
    head = load_file(directory / "model.safetensors")[
        "model.embed_tokens.weight" if tied else "lm_head.weight"
    ]
    assert torch.equal(blocked["lm_head.qweight"], int8.quantize_weight(head)[0])


@pytest.mark.parametrize("prefix", ["int8", "rest"])
def test_a_corrupted_store_is_rebuilt_with_a_notice(cache, ggufs, capsys, prefix):
    run = settings(ggufs["target"], ggufs["draft"], target_quant="int8", draft_quant="int8")
    before = logits(pair.load(run, Method.CHAIN).target.model)
    directory = next((cache / "int8").glob(f"{convert.file_key(ggufs['target'])}-*.store"))
    shard = next(directory.glob(f"{prefix}-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-64:] = bytes(64)  # the same size, other bytes
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    after = logits(pair.load(run, Method.CHAIN).target.model)
    assert "does not match its checksum; building it again" in capsys.readouterr().err
    assert torch.equal(before, after)


def test_models_rm_and_list_see_the_store(cache, ggufs):
    int8_store.ensure(_resolved(ggufs["target"]), torch.bfloat16, quiet=True)
    key = convert.file_key(ggufs["target"])
    [store] = cache_mod.int8_files(key)
    assert store.is_dir() and cache_mod.size_on_disk(store) > 0
    cache_mod.remove_converted(key)
    assert not store.exists()


def _resolved(gguf):
    from specgen.models.resolve import resolve

    return resolve(str(gguf), torch.bfloat16, quiet=True, convert=False)


def test_a_store_with_a_damaged_marker_and_a_damaged_file_is_one_line(cache, ggufs):
    run = settings(ggufs["target"], ggufs["draft"], target_quant="int8", draft_quant="int8")
    pair.load(run, Method.CHAIN, quiet=True)
    directory = next((cache / "int8").glob(f"{convert.file_key(ggufs['target'])}-*.store"))
    (directory / ".complete").write_text("{not json")
    shard = next(directory.glob("int8-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-64] + bytes(64))
    from specgen.errors import ModelError

    with pytest.raises(ModelError, match="is damaged and does not say what it was built from"):
        pair.load(run, Method.CHAIN, quiet=True)


def test_a_full_disk_while_building_the_store_is_one_line_and_leaves_nothing(cache, ggufs, monkeypatch):
    """safetensors reports a full disk as a SafetensorError whose text says so (not an OSError):
    the build stops with one line that says where and what to do, and no half store is left."""
    from specgen.errors import DiskFullError

    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as out:
            out.write(b"half a shard")
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(convert, "save_file", full)
    with pytest.raises(
        DiskFullError,
        match=r"disk full while writing .*\.store; free some space or set "
        r"SPECGEN_CACHE to another disk",
    ):
        int8_store.ensure(_resolved(ggufs["target"]), torch.bfloat16, quiet=True)
    assert not list((cache / "int8").glob("*"))


@pytest.mark.parametrize("prefix", ["int8", "rest"])
@pytest.mark.parametrize("length", [2**64 - 1, 2**40])
def test_a_store_shard_with_a_garbled_header_length_is_rebuilt(cache, ggufs, capsys, prefix, length):
    """The first 8 bytes of a shard (its header's length) garbled: read(length) asked for
    exabytes (OverflowError) or a terabyte (MemoryError) instead of the store being rebuilt."""
    run = settings(ggufs["target"], ggufs["draft"], target_quant="int8", draft_quant="int8")
    before = logits(pair.load(run, Method.CHAIN).target.model)
    directory = next((cache / "int8").glob(f"{convert.file_key(ggufs['target'])}-*.store"))
    shard = next(directory.glob(f"{prefix}-*.safetensors"))
    shard.write_bytes(length.to_bytes(8, "little") + shard.read_bytes()[8:])
    capsys.readouterr()
    after = logits(pair.load(run, Method.CHAIN).target.model)
    assert "cannot be read (a header of" in capsys.readouterr().err
    assert torch.equal(before, after)


@pytest.mark.parametrize("damage", ["bytes", "cut"])
def test_a_pruned_untied_draft_never_keeps_head_rows_of_a_damaged_store(cache, ggufs, capsys, damage):
    """The head rows a pruned untied draft keeps for ids it reads later were read from the int8
    shards unchecked: other bytes became its rows (the checked linears were rebuilt, these not),
    a cut file a raw SafetensorError. Now the shards are checked first and rebuilt with a notice."""

    def draft():
        loaded = from_store(ggufs["untied"])
        return quant.apply_draft_quant(
            loaded.model, "int8+prune", keep=100, special_ids=(318, 319), source=loaded.path
        )

    before = logits(draft())
    for shard in next((cache / "int8").glob(f"{convert.file_key(ggufs['untied'])}-*.store")).glob("int8-*"):
        data = shard.read_bytes()
        start = 8 + int.from_bytes(data[:8], "little")
        shard.write_bytes(
            data[:start] + bytes([7]) * (len(data) - start)
            if damage == "bytes"
            else data[: len(data) * 3 // 4]
        )
    capsys.readouterr()
    assert torch.equal(logits(draft()), before)
    assert "; building it again" in capsys.readouterr().err


def test_a_checked_shard_is_not_hashed_again_until_its_file_changes(cache, ggufs, capsys, monkeypatch):
    """A warm load hashes no shard its store checked before (the file's stat recorded in
    `.verified`); a shard rewritten in place, even with its size and mtime put back, is hashed
    again and rebuilt with a notice; a record that cannot be read or written only costs a hash."""
    import os

    run = settings(ggufs["target"], ggufs["draft"], target_quant="int8", draft_quant="int8")
    before = logits(pair.load(run, Method.CHAIN, quiet=True).target.model)
    directory = next((cache / "int8").glob(f"{convert.file_key(ggufs['target'])}-*.store"))
    recorded = json.loads((directory / store_shards.VERIFIED).read_text())
    assert sorted(recorded) == sorted(p.name for p in directory.glob("*.safetensors"))

    hashed = []
    real = store_shards.hash_check
    monkeypatch.setattr(
        store_shards, "hash_check", lambda shard, d: hashed.append(shard.name) or real(shard, d)
    )
    pair.load(run, Method.CHAIN, quiet=True)
    assert hashed == []

    shard = next(directory.glob("int8-*.safetensors"))
    stat = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-64:] = bytes(64)  # the same size, other bytes
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the mtime put back; the ctime moves on
    capsys.readouterr()
    after = logits(pair.load(run, Method.CHAIN, quiet=True).target.model)
    assert shard.name in hashed
    assert "does not match its checksum; building it again" in capsys.readouterr().err
    assert torch.equal(before, after)

    rebuilt = next((cache / "int8").glob(f"{convert.file_key(ggufs['target'])}-*.store"))
    (rebuilt / store_shards.VERIFIED).write_text("{not json")
    hashed.clear()
    pair.load(run, Method.CHAIN, quiet=True)
    assert hashed and "{not json" not in (rebuilt / store_shards.VERIFIED).read_text()
