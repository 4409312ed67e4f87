"""GGUF to a cached, ready-to-load Hugging Face directory.

Loading a GGUF with transformers dequantizes every tensor and rebuilds the tokenizer from
metadata, which takes tens of seconds for a 1.5B model. This module does that once per (file,
dtype) and saves the result (safetensors, tokenizer.json, config) under
`cache_root()/converted/`, so later loads are a memory map away. The directory is written under
a lock at a temporary name and renamed into place with a `.complete` marker inside (the one
atomic-write helper), so a half-written one from a killed process is never loaded.

It owns the `converted/` part of the cache; it knows nothing about where GGUF files come from.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import io
import itertools
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from specgen.errors import ModelError
from specgen.files import atomic_write, locked
from specgen.memory import release_freed
from specgen.models.cache import check_writable, converted_root
from specgen.status import status

MARKER = ".complete"


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def file_key(gguf: Path) -> str:
    """Identifies one version of a file: its stem for people, a hash of (path, size, mtime) for us."""
    resolved = gguf.resolve()
    stat = resolved.stat()
    digest = hashlib.sha256(f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    return f"{gguf.stem}-{digest[:12]}"


def converted_dir_for(gguf: Path, dtype, key: str | None = None) -> Path:
    """Where the conversion of `gguf` to `dtype` lives; `key` replaces the file-derived name
    (the catalog passes the model name, so its directory survives a re-download)."""
    return converted_root() / f"{key or file_key(Path(gguf))}-{_dtype_name(dtype)}"


def is_converted(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def ensure_converted(gguf: Path, dtype, *, key: str | None = None, quiet: bool = False) -> Path:
    """Return the converted directory for (`gguf`, `dtype`), converting first if needed."""
    gguf = Path(gguf)
    check_gguf(gguf)
    target = converted_dir_for(gguf, dtype, key)
    if is_converted(target):
        return target
    check_writable(target.parent)  # the same one-line error and hint as a catalog fetch
    with locked(f"converted-{target.name}"):
        if is_converted(target):  # another process finished it while we waited
            return target
        _remove_leftovers(target)
        with status(f"converting {gguf.name} to {_dtype_name(dtype)} (once; later loads are fast)", quiet):
            atomic_write(
                target, lambda tmp: _convert(gguf, dtype, tmp), tmp=target.with_name(f"{target.name}.tmp")
            )
    return target


def check_gguf(path: Path) -> None:
    """Raise a one-line ModelError unless `path` is a readable file starting with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise ModelError(f"{path} does not exist") from None
    except OSError as error:
        raise ModelError(f"cannot read {path}: {error.strerror or error}") from None
    if magic != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file")


SHARD_BYTES = 256 << 20  # safetensors shards of the converted copy: save_file holds one twice in memory


def _convert(gguf: Path, dtype, out: Path) -> None:
    """Tensor by tensor: each GGUF tensor is dequantized (on a thread per core: gguf's numpy
    kernels release the GIL), named and reshaped by transformers' own GGUF tensor processors,
    cast to `dtype` and written in shards as they fill. transformers' `from_pretrained(gguf_file=)`
    does the same per tensor but holds the whole model in memory twice over (5.6 GB at the peak
    for the 1.5B default target) on one core; the files it would save are bitwise these (tested).
    The marker describes the file as it was opened: a catalog GGUF may be let go by another
    process (its int8 store built) while this one still reads it through its memory map."""
    marker = {"gguf": str(gguf.resolve()), "size": gguf.stat().st_size, "dtype": _dtype_name(dtype)}
    with opened(gguf, dtype) as (skeleton, tokenizer, tensors):
        writer = ShardWriter(out)
        for name, tensor in tensors:
            writer.add(name, tensor)
        writer.close()
        save_beside(skeleton, tokenizer, out)
    (out / MARKER).write_text(json.dumps(marker) + "\n")


VOCABULARY_TABLES = ("token_embd.weight", "output.weight")  # GGUF names: the tallest tensors by far
BLOCK_ROWS = 16384  # a vocabulary table handed over in blocks of this many rows (see RowBlocks)


@dataclasses.dataclass(frozen=True)
class RowBlocks:
    """A vocabulary table dequantized a block of rows at a time, each block in the load dtype,
    for a consumer that never needs it whole at full precision (the int8 store quantizes it or
    keeps it in 16 bits). Whole, the 1.5B target's two tables are 0.93 GB each in fp32, and both
    were in flight at once: most of a store build's peak. A GGUF row is a whole number of
    quantization blocks, so a block of rows dequantizes to exactly those rows of the whole."""

    shape: tuple[int, ...]
    blocks: Callable[[], Iterator[torch.Tensor]]  # [rows, ...] in order, BLOCK_ROWS at most each


@contextlib.contextmanager
def opened(gguf: Path, dtype, workers: int | None = None, in_blocks: bool = False):
    """(skeleton, tokenizer, tensors) of a GGUF file: the model built on the meta device from
    its config, its tokenizer, and an iterator of (Hugging Face name, tensor in `dtype`) over
    the tensors the model has, dequantized one at a time. Errors of unsupported files are one
    line (ModelError). `workers`: dequantizing threads (default: one per core, up to 4).
    `in_blocks`: vocabulary tables taller than BLOCK_ROWS come as `RowBlocks` instead (where
    the model's tensor processor leaves them as they are, as it does for every supported
    architecture)."""
    try:
        with _muted_transformers(), _one_parse(gguf) as reader:
            # trust_remote_code=False: a model's own Python code never runs (see models/load.py)
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
            tokenizer = AutoTokenizer.from_pretrained(
                gguf.parent, gguf_file=gguf.name, trust_remote_code=False
            )
            yield (
                skeleton,
                tokenizer,
                _dequantized(
                    gguf, reader, skeleton, dtype, workers or max(1, min(4, os.cpu_count() or 1)), in_blocks
                ),
            )
            release_freed()  # the dequantizing threads' arenas: over a GB the load would never reuse
    except (ValueError, KeyError, NotImplementedError) as error:
        raise _friendly(error, gguf) from error


def save_beside(skeleton, tokenizer, out: Path) -> None:
    """The config, generation config and tokenizer files that make `out` loadable."""
    skeleton.config.architectures = [type(skeleton).__name__]  # as save_pretrained records it
    skeleton.config.save_pretrained(out)
    if skeleton.can_generate():
        skeleton.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


@contextlib.contextmanager
def _one_parse(gguf: Path):
    """One parsed GGUFReader for the whole conversion. A reader parses every metadata field with
    numpy, one small view per item: 16 s for the 151k-token vocabulary of Qwen's files. transformers
    builds a reader for the config, another for the tokenizer, and we need one for the tensors;
    while this is open, `gguf.GGUFReader(path)` of this file returns ours (read-only, so sharing
    it is safe), which made the conversion of the 0.5B draft 3x faster."""
    import gguf as gguf_package  # a dependency; transformers imports its GGUFReader at each call

    original = gguf_package.GGUFReader
    try:
        reader = original(str(gguf))
    except Exception as error:  # noqa: BLE001 (a short file fails the parser in many ways: IndexError, ValueError)
        detail = (str(error).strip().splitlines() or [""])[0][:120]
        raise ModelError(
            f"cannot read {gguf}: the GGUF file is truncated or damaged ({type(error).__name__}: {detail})",
            hint="download it again",
        ) from None
    resolved = gguf.resolve()

    def shared(path, *args, **kwargs):
        if not args and not kwargs and Path(path).resolve() == resolved:
            return reader
        return original(path, *args, **kwargs)

    gguf_package.GGUFReader = shared
    try:
        yield reader
    finally:
        gguf_package.GGUFReader = original


def _dequantized(gguf: Path, reader, skeleton, dtype, workers: int, in_blocks: bool = False):
    from gguf import dequantize  # the gguf package: a dependency, imported with the conversion
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    parsed = load_gguf_checkpoint(str(gguf), return_tensors=False)
    architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), encoding="utf-8")
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed.get("config", {}))
    names = get_gguf_hf_weights_map(skeleton, processor)
    wanted = {name for name, _ in skeleton.named_parameters()} | {
        name for name, _ in skeleton.named_buffers()
    }
    parsed["tensors"] = {}

    def processed(weights, name):
        return processor.process(
            weights=weights, name=name, tensor_key_mapping=names, parsed_parameters=parsed
        )

    def as_torch(weights) -> torch.Tensor:
        return torch.from_numpy(weights if weights.flags.writeable else weights.copy()).to(dtype)

    def one(tensor):
        if in_blocks and tensor.name in VOCABULARY_TABLES and tensor.data.shape[0] > BLOCK_ROWS:
            first = dequantize(tensor.data[:1], tensor.tensor_type)  # one row, to ask the processor
            result = processed(first, tensor.name)
            if result.weights is first and result.name in names:  # the processor leaves it as it is

                def blocks():
                    for start in range(0, tensor.data.shape[0], BLOCK_ROWS):
                        yield as_torch(
                            dequantize(tensor.data[start : start + BLOCK_ROWS], tensor.tensor_type)
                        )

                return names[result.name], RowBlocks((tensor.data.shape[0], *first.shape[1:]), blocks)
        result = processed(dequantize(tensor.data, tensor.tensor_type), tensor.name)
        if result.name not in names:
            return None
        return names[result.name], as_torch(result.weights)

    for named in _in_order(one, reader.tensors, workers):
        if named is not None and named[0] in wanted:
            yield named


class ShardWriter:
    """Tensors written to `out` as safetensors shards of about SHARD_BYTES as they come, named
    as transformers names a checkpoint (one file, or shards and an index) unless `prefix` names
    them `<prefix>-00001.safetensors`, ... (files that only specgen reads). `metadata(tensors)`
    adds metadata to each shard (a checksum of its tensors, for derived weights)."""

    def __init__(self, out: Path, metadata=lambda tensors: {}, prefix: str | None = None):
        self.out, self.metadata, self.prefix = out, metadata, prefix
        self.shard: dict = {}
        self.size = self.total = 0
        self.files: list[str] = []
        out.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.shard[name] = tensor
        self.size += tensor.numel() * tensor.element_size()
        self.total += tensor.numel() * tensor.element_size()
        if self.size >= SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        self.files.append(f"{self.prefix or 'model'}-{len(self.files) + 1:05d}.safetensors")
        save_file(
            self.shard, str(self.out / self.files[-1]), metadata={"format": "pt", **self.metadata(self.shard)}
        )
        self.shard, self.size = {}, 0

    def close(self) -> None:
        if self.shard or not self.files:
            self._flush()
        if self.prefix is not None:
            return
        if len(self.files) == 1:  # one shard: the name transformers gives an unsharded checkpoint
            (self.out / self.files[0]).rename(self.out / "model.safetensors")
            return
        weight_map = {}
        for file in self.files:
            with safe_open(str(self.out / file), framework="pt") as handle:
                weight_map.update({name: file for name in handle.keys()})
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _in_order(function, items, workers: int):
    """`function` over `items` on `workers` threads, results in order, at most workers + 1 in
    flight (a pool's map would dequantize the whole file ahead of a slow shard write)."""
    items = iter(items)
    with ThreadPoolExecutor(workers) as pool:
        pending = collections.deque(
            pool.submit(function, item) for item in itertools.islice(items, workers + 1)
        )
        while pending:
            result = pending.popleft().result()
            for item in itertools.islice(items, 1):
                pending.append(pool.submit(function, item))
            yield result


def _friendly(error: Exception, gguf: Path) -> Exception:
    """A GGUF file transformers cannot read (an unsupported architecture, metadata missing or
    malformed) as one line naming the file, or the architecture."""
    text = str(error).strip() or type(error).__name__
    found = re.search(r"architecture\s+'?([\w.\-]+)'?\s+is not supported", text)
    if found:
        return ModelError(f"GGUF architecture '{found.group(1)}' is not supported by transformers")
    return ModelError(f"cannot read the GGUF file {gguf.name}: {text.splitlines()[0][:300]}")


def _remove_leftovers(target: Path) -> None:
    """Under the lock nobody else is writing: a target without its marker (an older version's
    crash) and any temporary tree beside it are leftovers of a killed process."""
    if target.exists() and not is_converted(target):
        shutil.rmtree(target, ignore_errors=True)
    for leftover in target.parent.glob(f"{target.name}.tmp*"):
        shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def _muted_transformers():
    """Hide transformers' own tqdm bars and info logs, which would fight with the spinner.

    The legacy GGUF loader writes its tqdm bar straight to `sys.stderr`, so stderr is captured; the
    Rich spinner already holds the real stream. Warnings still reach the logger at error level.
    """
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
