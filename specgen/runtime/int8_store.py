"""The int8 store: what a model on the int8 path loads, and nothing else.

A GGUF model on the CPU runs with int8 linears (`--target-quant`, `--draft-quant`: quant.py).
Loading them from a converted full-precision copy meant a 4.6 GB bf16 directory (9 GB in fp32)
for the default pair whose linears were read once, to quantize them, and never again. The
store is built straight from the GGUF, one tensor at a time, and holds:

* every linear's int8 weight and fp32 scales (`<linear>.qweight`, `<linear>.scales`; quantized
  from the weight in the load dtype, so they are bitwise what quantizing a converted copy
  gives), and a tied output layer's too (quantized from the input embedding);
* every other tensor (input embedding, norms, biases) in the load dtype, except embedding
  tables of an fp32 load, which are kept in bfloat16 (the int8 model runs its activations in
  fp32 and widens a 16-bit table's rows exactly; an fp32 table would double their disk and
  memory for precision the int8 linears do not keep);
* the config, generation config and tokenizer files.

The int8 tensors and the rest live in separate shards (`int8-*.safetensors`, `rest-*`), each
with a checksum of its tensors, checked before they are read (a corrupted file is rebuilt with a
notice). runtime/store_shards.py checks them, once per version of a file: hashing on every load
cost about 2 s of a 17 s warm start of the default pair (benchmarks/first-run.md).

A model is built around the store without ever materializing a full-precision linear:
`checked` gives the store and its `rest` shards, checked; models/load.py reads those shards
only, the linears kept apart (the module tree created on the meta device, buffers such as rotary
tables computed as usual, the non-linear tensors assigned); `int8_weights` then hands
`int8_model.quantize_model` each linear's int8 rows, read only when its packing task runs. A pruned
draft head's int8 rows are the kept rows of the output layer's (per output channel, so selecting
rows commutes with quantizing). An untied output layer is stored in int8 only: a pruned draft
reads its dequantized rows.

Layout: `$SPECGEN_CACHE/int8/<key>-<dtype>.store/` with a `.complete` marker recording its
source, written at a temporary name under a lock and renamed into place like every other cache
entry. Which models load from their store is runtime/forms.py's choice.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

from specgen.errors import ModelError
from specgen.files import atomic_write, cache_root, locked
from specgen.memory import release_freed
from specgen.models import catalog, convert
from specgen.models.cache import check_writable, converted_dirs
from specgen.models.resolve import Resolved
from specgen.runtime import int8, int8_model, store_shards
from specgen.status import note, status

FORMAT_VERSION = 1
SUFFIX = ".store"
MARKER = ".complete"


def store_dir(key: str, dtype: torch.dtype) -> Path:
    return cache_root() / "int8" / f"{key}-{str(dtype).removeprefix('torch.')}{SUFFIX}"


def is_store(path: str | os.PathLike | None) -> bool:
    """Whether `path` is a complete int8 store (what `LoadedModel.path` is for a model loaded from one)."""
    return path is not None and Path(path).name.endswith(SUFFIX) and (Path(path) / MARKER).is_file()


def ensure(resolved: Resolved, dtype: torch.dtype, quiet: bool = False, workers: int | None = None) -> Path:
    """The store of the GGUF or catalog source `resolved` in `dtype`, built first when there is
    none (fetching a catalog model's GGUF again if it was let go). Once a catalog model's store
    is built, its GGUF is let go unless a converted copy was made from it: nothing else reads
    it, and the cache stays under twice the download (`specgen bench`'s llama.cpp columns and a
    full-precision load fetch it again). `workers`: dequantizing threads (default: one per core)."""
    target = store_dir(resolved.key, dtype)
    if is_store(target):
        return target
    check_writable(target.parent)
    with locked(f"int8-store-{target.name}"):
        if is_store(target):  # another process built it while we waited
            return target
        shutil.rmtree(target, ignore_errors=True)  # a leftover without its marker
        gguf = resolved.gguf_file(quiet)
        with status(
            f"building the int8 weights of {resolved.name} (once; later loads read only these)", quiet
        ):
            atomic_write(
                target,
                lambda tmp: _build(gguf, dtype, tmp, resolved, workers),
                tmp=target.with_name(f"{target.name}.tmp"),
            )
    if resolved.source == "catalog" and not converted_dirs(resolved.key):
        catalog.let_go(catalog.CATALOG[resolved.name])
    return target


def _build(gguf: Path, dtype: torch.dtype, out: Path, resolved: Resolved, workers: int | None) -> None:
    with convert.opened(gguf, dtype, workers, in_blocks=True) as (skeleton, tokenizer, tensors):
        linears = {f"{name}.weight": name for name in int8_model.linear_names(skeleton)}
        embedding = _weight_name(skeleton, skeleton.get_input_embeddings())
        tied = _tied_head(skeleton)
        rest, weights = (
            convert.ShardWriter(
                out, metadata=lambda shard: {"checksum": store_shards.shard_checksum(shard)}, prefix=prefix
            )
            for prefix in ("rest", "int8")
        )
        quantized = set()
        for name, tensor in tensors:
            int8_name = linears.get(name, tied if name == embedding else None)
            if int8_name in quantized:
                int8_name = None
            kept = (
                None
                if name in linears
                else (torch.bfloat16 if name == embedding and dtype == torch.float32 else dtype)
            )
            q, scales, kept = _stored(tensor, int8_name is not None, kept)
            if q is not None:
                quantized.add(int8_name)
                weights.add(f"{int8_name}.qweight", q)
                weights.add(f"{int8_name}.scales", scales)
            if kept is not None:
                rest.add(name, kept)
            del tensor, q, scales, kept
            release_freed()  # the dequantizing thread's freed blocks: 0.7 GB of the bf16 build's peak held
        rest.close()
        weights.close()
        convert.save_beside(skeleton, tokenizer, out)
    release_freed()
    marker = {
        "source": resolved.source,
        "name": resolved.name,
        "gguf": resolved.gguf,
        "key": resolved.key,
        "dtype": str(dtype),
        "format": FORMAT_VERSION,
    }
    (out / MARKER).write_text(json.dumps(marker) + "\n")


def _stored(tensor: torch.Tensor | convert.RowBlocks, quantize: bool, keep: torch.dtype | None):
    """(int8 weight, scales, the tensor in `keep`), each None when not asked for, from a tensor
    in the load dtype or a vocabulary table in row blocks (never whole at full precision: per
    output row, quantizing and casting a block gives exactly those rows of the whole)."""
    if not isinstance(tensor, convert.RowBlocks):
        q, scales = int8.quantize_weight(tensor) if quantize else (None, None)
        return q, scales, None if keep is None else tensor.to(keep)
    rows = tensor.shape[0]
    q = torch.empty(tensor.shape, dtype=torch.int8) if quantize else None
    scales = torch.empty(rows, dtype=torch.float32) if quantize else None
    kept = torch.empty(tensor.shape, dtype=keep) if keep is not None else None
    start = 0
    for block in tensor.blocks():
        end = start + block.shape[0]
        if quantize:
            q[start:end], scales[start:end] = int8.quantize_weight(block)
        if keep is not None:
            kept[start:end] = block
        start = end
    return q, scales, kept


def _weight_name(model: nn.Module, module: nn.Module) -> str | None:
    return next((f"{name}.weight" for name, m in model.named_modules() if m is module), None)


def _tied_head(model: nn.Module) -> str | None:
    """The output linear's name when its weight is the input embedding's, else None."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or not model.config.get_text_config().tie_word_embeddings:
        return None
    return next(name for name, module in model.named_modules() if module is head)


def _marker(directory: Path) -> tuple[Resolved, torch.dtype]:
    """The source a store was built from and its dtype, as its marker records them."""
    try:
        marker = json.loads((directory / MARKER).read_text())
        dtype = getattr(torch, marker["dtype"].removeprefix("torch."))
        if not isinstance(dtype, torch.dtype):
            raise ValueError(marker["dtype"])
        return Resolved(None, marker["source"], marker["name"], marker["gguf"], marker["key"]), dtype
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ModelError(
            f"the int8 store {directory.name} is damaged and does not say what it was built from",
            hint=f"remove {directory}; the next run builds it again",
        ) from None


def _rebuilt(
    directory: Path, error: store_shards.CorruptStore, source: Resolved, dtype: torch.dtype, quiet: bool
) -> Path:
    """The store of `source` in `dtype` built again after `error`."""
    note(f"specgen: {error}; building it again")
    resolved = replace(source, path=None)
    with locked(f"int8-store-{directory.name}"):
        shutil.rmtree(directory, ignore_errors=True)
    return ensure(resolved, dtype, quiet)


def checked(resolved: Resolved, dtype: torch.dtype, quiet: bool = False) -> tuple[Path, tuple[Path, ...]]:
    """(the store, built first by `ensure` when missing; its `rest` shards), those shards checked
    against their checksums: they hold every tensor but the linears' weights, and they are all
    models/load.py reads of it (never the int8 shards: opened unchecked there, a damaged one failed
    the load instead of being rebuilt). A corrupted store is rebuilt once, with a notice. The int8
    shards are checked, header and checksum, when their weights are read (`int8_weights`,
    `materialize_head`), and rebuilt the same way."""
    directory = ensure(resolved, dtype, quiet)
    try:
        return directory, store_shards.readable(directory, "rest")
    except store_shards.CorruptStore as error:
        directory = _rebuilt(directory, error, resolved, dtype, quiet)
        return directory, store_shards.readable(directory, "rest")


def int8_weights(
    directory: str | os.PathLike, model: nn.Module, quiet: bool = False
) -> Callable[[dict[str, tuple]], int8_model.Weights]:
    """`int8_model.quantize_model`'s `cached` for `model`, loaded from the store at `directory` (its
    head possibly pruned: the pruned head's inner linear takes the kept rows of the full head's
    int8 weight). The files are checked against their checksums first, hashing their bytes in
    place; then each weight is read when its packing task runs, so only the rows being packed
    are in memory. A corrupted file is rebuilt once, with a notice."""
    directory = Path(directory)

    def cached(shapes: dict[str, tuple]) -> int8_model.Weights:
        nonlocal directory
        directory, index = _checked_int8(directory, quiet)
        out = {}
        for name, shape in shapes.items():
            head = name.removesuffix(".linear")
            if f"{name}.qweight" in index:
                source, stored_shape, ids = name, index[f"{name}.qweight"][1], None
            elif name.endswith(".linear") and f"{head}.qweight" in index:
                # a pruned head: kept rows of the full one
                ids = model.get_submodule(head).ids
                source, stored_shape = head, (len(ids), index[f"{head}.qweight"][1][1])
            else:
                raise ModelError(
                    f"the int8 store {directory.name} has no weights for {name}",
                    hint=f"remove {directory} to build it again",
                )
            if tuple(stored_shape) != tuple(shape):
                raise ModelError(
                    f"the int8 store {directory.name} has {name} of shape {tuple(stored_shape)}, "
                    f"the model {tuple(shape)}",
                    hint=f"remove {directory} to build it again",
                )
            files = (index[f"{source}.qweight"][0], index[f"{source}.scales"][0])
            out[name] = int8_model.Deferred(functools.partial(_rows, files, source, ids), shape[0] * shape[1])
        return out

    return cached


def _rows(files: tuple[Path, Path], name: str, ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One linear's int8 weight and scales (the kept rows `ids` of them), read from their shards."""
    q, scales = (_tensor(file, f"{name}.{part}") for file, part in zip(files, ("qweight", "scales")))
    return (q, scales) if ids is None else (q.index_select(0, ids), scales.index_select(0, ids))


def _tensor(file: Path, name: str) -> torch.Tensor:
    with safe_open(str(file), framework="pt") as handle:
        return handle.get_tensor(name)


def _checked_int8(directory: Path, quiet: bool) -> tuple[Path, dict[str, tuple[Path, tuple]]]:
    """(the store's directory, its int8 shards' index) once their bytes match their checksums;
    a corrupted store is rebuilt once, with a notice (then the new directory's)."""
    try:
        return directory, store_shards.verified(directory, "int8")
    except store_shards.CorruptStore as error:
        directory = _rebuilt(directory, error, *_marker(directory), quiet)
        return directory, store_shards.verified(directory, "int8")


def materialize_head(directory: str | os.PathLike, model: nn.Module, quiet: bool = False) -> None:
    """An untied output layer's weight (on the meta device in a model from the store) as the
    dequantized int8 rows in the model's dtype: a pruned draft head reads rows of it (for the
    ids it reads later), so the shards are checked first and a corrupted one rebuilt once, with
    a notice (the rows were read unchecked: junk kept by the pruned head, or a raw error)."""
    directory = Path(directory)
    name = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    directory, index = _checked_int8(directory, quiet)
    if f"{name}.qweight" not in index or f"{name}.scales" not in index:
        raise ModelError(
            f"the int8 store {directory.name} has no weights for {name}",
            hint=f"remove {directory} to build it again",
        )
    q, scales = _rows((index[f"{name}.qweight"][0], index[f"{name}.scales"][0]), name, None)
    weight = torch.empty(q.shape, dtype=model.get_input_embeddings().weight.dtype)
    for start in range(0, len(q), int8.QUANTIZE_ROWS):  # fp32 temporaries of a block only
        rows = slice(start, start + int8.QUANTIZE_ROWS)
        weight[rows] = q[rows].float() * scales[rows, None]
    model.get_output_embeddings().weight = nn.Parameter(weight, requires_grad=False)
