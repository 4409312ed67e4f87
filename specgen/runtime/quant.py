"""The weight formats a loaded pair runs in: `--target-quant` and `--draft-quant`, and the
on-disk cache of int8 weights.

* `--target-quant auto|none|int8`: the target's linears as `int8.RowInt8Linear` on the CPU.
  auto picks int8 for a GGUF target (its weights were already 4-6-bit) on the CPU when
  `--dtype` is auto; full-precision checkpoints keep their weights unless int8 is asked for.
* `--draft-quant auto|none|int8|int8-wo|prune|...+prune`: a cheaper draft (pruned.py, int8.py).
  auto is `int8+prune` for a draft on the CPU in a 16-bit dtype or in the format `--dtype auto`
  chose; an explicit `--dtype float32` keeps the draft as loaded. The target is never touched,
  and every variant is lossless (the draft reports the law it samples from).

A GGUF model on this path loads from its int8 store (int8_store.py), which holds only what it
runs. A local directory's quantized weights are cached in `$SPECGEN_CACHE/int8/` (safetensors of
int8 weights and fp32 scales, keyed by the source files), written atomically with a checksum of their bytes in
the
metadata; a file that does not read back as the model's linears, or whose bytes no longer
match their checksum (a disk or a copy that corrupted it), is quantized again with a notice.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from specgen.errors import ConfigError
from specgen.files import atomic_write, cache_root
from specgen.runtime import head_memory, int8, int8_model, int8_store
from specgen.runtime.pruned import DEFAULT_KEEP, PrunedHead, prune_head, quantize_int8_weight_only
from specgen.runtime.store_shards import checksum
from specgen.status import note

FORMAT_VERSION = 2  # 2: a checksum of the tensors in the metadata
TARGET_CHOICES = ("auto", "none", "int8")
DRAFT_CHOICES = ("none", "int8", "int8-wo", "prune", "int8+prune", "int8-wo+prune")
AUTO = "auto"


# -- --target-quant --------------------------------------------------------------------------
def parse_target_quant(spec: str | None) -> str:
    value = (spec or "none").strip().lower()
    if value not in TARGET_CHOICES:
        raise ConfigError(f"--target-quant '{spec}': choose {', '.join(TARGET_CHOICES)}")
    return value


def resolve_target_quant(spec: str | None, target, dtype_auto: bool = True) -> str:
    """`none` or `int8` for the loaded target; int8 runs on the CPU kernels only."""
    value = parse_target_quant(spec)
    on_cpu = int8_store.is_store(getattr(target, "path", None)) or all(
        p.device.type == "cpu" for p in target.model.parameters()
    )  # a store's linears are on meta until int8
    if value == "int8":
        if not on_cpu:
            raise ConfigError("--target-quant int8 runs on the CPU kernels only; use it with --device cpu")
        if not int8.available():
            raise ConfigError(
                "--target-quant int8 needs torch's x86 (fbgemm) int8 kernels, which this build lacks"
            )
        return "int8"
    if (
        value == "auto"
        and on_cpu
        and dtype_auto
        and target.source in ("gguf", "catalog")
        and int8.available()
    ):
        return "int8"
    return "none"


def target_wants_int8(spec: str | None, dtype_auto: bool) -> bool:
    """Whether a GGUF target on the CPU will run with int8 linears (then it loads from its int8
    store: runtime/int8_store.py). Mirrors `resolve_target_quant`."""
    value = parse_target_quant(spec)
    return value == "int8" or (value == "auto" and dtype_auto)


def draft_wants_int8(spec: str | None, device: torch.device, dtype: torch.dtype, dtype_auto: bool) -> bool:
    """Whether a GGUF draft's `--draft-quant` is int8 on every linear (int8, int8+prune): then it
    loads from its int8 store."""
    parts = set(parse_draft_quant(resolve_draft_quant(spec, device, dtype, dtype_auto)))
    return "int8" in parts and parts <= {"int8", "prune"}


def quantize_target(model: nn.Module, source: str | None, quiet: bool = True) -> nn.Module:
    """The target's linears in int8: from its int8 store when it was loaded from one, else from
    (or into) the int8 cache when it has a source dir."""
    return quantize_from(model, source, "target", quiet)


# -- --draft-quant ---------------------------------------------------------------------------
def resolve_draft_quant(
    spec: str | None, device: torch.device, dtype: torch.dtype, dtype_auto: bool = False
) -> str:
    """`auto` -> int8+prune for a draft on the CPU in a 16-bit dtype, or in whatever format
    `--dtype auto` chose there; else none. Any other spec is returned as given."""
    if (spec or "").strip().lower() != AUTO:
        return spec or "none"
    if device.type == "cpu" and (dtype in (torch.bfloat16, torch.float16) or dtype_auto):
        return "int8+prune"
    return "none"


def parse_draft_quant(text: str | None) -> tuple[str, ...]:
    """'int8+prune' -> ('int8', 'prune'); 'none' or None -> (). Resolve `auto` first."""
    if text is None or text.strip().lower() in ("", "none"):
        return ()
    parts = tuple(p.strip().lower() for p in text.split("+"))
    known = {"int8", "int8-wo", "prune"}
    bad = [p for p in parts if p not in known]  # an empty part too: '+prune', 'int8+'
    if bad or len(set(parts)) < len(parts) or ("int8" in parts and "int8-wo" in parts):
        raise ConfigError(
            f"--draft-quant '{text}': choose auto, none, int8, int8-wo, prune, or a "
            "quantization + prune (e.g. int8+prune)"
        )
    return parts


def check_draft_quant(spec: str | None) -> None:
    """A bad --draft-quant fails before minutes of loading."""
    if (spec or AUTO).strip().lower() != AUTO:
        parse_draft_quant(spec)


def describe_draft_quant(spec: str | None, model: nn.Module) -> str:
    """What `apply_draft_quant(model, spec)` did, for stats: `prune` is dropped when the head was
    small enough to stay whole."""
    parts = [
        p
        for p in parse_draft_quant(spec)
        if p != "prune" or isinstance(model.get_output_embeddings(), PrunedHead)
    ]
    return "+".join(parts) or "none"


def apply_draft_quant(
    model: nn.Module,
    spec: str | None,
    keep: int = DEFAULT_KEEP,
    special_ids: tuple[int, ...] = (),
    source: str | None = None,
    tokenizer=None,
) -> nn.Module:
    """Apply a `--draft-quant` spec to a loaded draft model (in place where possible); returns it.
    `tokenizer`: the one of the ids a pruned head keeps (it packs a script's ids at once)."""
    parts = parse_draft_quant(spec)
    if not parts:
        return model
    if any(p.device.type not in ("cpu", "meta") for p in model.parameters()):  # meta: from an int8 store
        raise ConfigError(
            "--draft-quant runs on the CPU kernels only; put the draft on the CPU (--draft-device cpu)"
        )
    if "prune" in parts:
        # an untied head: its rows are read
        if int8_store.is_store(source) and model.get_output_embeddings().weight.is_meta:
            int8_store.materialize_head(source, model)
        prune_head(model, keep, special_ids, tokenizer=tokenizer)
    if "int8" in parts:
        model = quantize_from(model, source, f"draft {'+'.join(parts)} keep={keep}", quiet=True)
    elif "int8-wo" in parts:
        quantize_int8_weight_only(model)
    if "prune" in parts:  # after int8: what the head primes is packed in its final format
        head_memory.attach(model, tokenizer)
    return model


# -- the int8 weight cache ---------------------------------------------------------------------
def quantize_head(head: nn.Module) -> nn.Module:
    """An EAGLE-3 head's linears as int8 row products (a draft: lossless whatever its format)."""
    for name, module in list(head.named_modules()):
        for child, linear in list(module.named_children()):
            if type(linear) is nn.Linear:
                setattr(module, child, int8.linear_of(linear.weight.detach().float(), linear.bias))
    return head


def cache_file_for(source: str | os.PathLike, role_key: str = "") -> Path | None:
    """Where the int8 weights of the model loaded from `source` (a local directory) are
    cached; None for sources without local weight files (then nothing is cached)."""
    path = Path(source)
    if not path.is_dir():
        return None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    digest = hashlib.sha256()
    digest.update(f"v{FORMAT_VERSION} {role_key} {path.resolve()}".encode())
    for f in files:
        stat = f.stat()
        digest.update(f"{f.name} {stat.st_size} {stat.st_mtime_ns}".encode())
    role = "".join(c if c.isalnum() or c in "+=" else "-" for c in role_key.lower()) or "model"
    # the directory's own mark beside its name: two folders of one name (a/final, b/final) keep
    # their files apart, where a newer file of the same folder replaces its older one (`_write`)
    where = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]
    return cache_root() / "int8" / f"{path.name}-{where}.{role}.{digest.hexdigest()[:16]}.safetensors"


def quantize_from(model: nn.Module, source: str | None, role_key: str, quiet: bool = True) -> nn.Module:
    """`model`'s linears in int8, their weights from where `source` keeps them: its int8 store
    when the model was loaded from one (int8_store.py), else the int8 file cache of a local
    directory, read or written (`role_key` names the variant); no source: quantized, not cached."""
    if int8_store.is_store(source):
        return int8_model.quantize_model(model, cached=int8_store.int8_weights(source, model, quiet))
    return quantize_cached(model, cache_file_for(source, role_key) if source else None, quiet)


def quantize_cached(model: nn.Module, cache_file: Path | None, quiet: bool = True) -> nn.Module:
    """`int8_model.quantize_model` with its weights read from `cache_file` when it holds them, else
    quantized and written there (None: no cache)."""
    if cache_file is None:
        return int8_model.quantize_model(model)
    return int8_model.quantize_model(
        model,
        cached=lambda shapes: _read(cache_file, shapes, quiet),
        store=lambda weights: _write(cache_file, weights, quiet),
    )


def _read(path: Path, shapes: dict[str, tuple], quiet: bool = True) -> int8.Weights | None:
    """The cached weights, or None: absent (silently), or damaged in any way, which is said on
    stderr whatever the output format (`quiet` only hides progress): the file is rebuilt."""
    if not path.is_file():
        return None
    why = None
    try:
        out = {}
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            if json.loads(meta.get("names", "[]")) != list(shapes):
                why = "hold other layers than the model's"
            for name, shape in ({} if why else shapes).items():
                out[name] = (fh.get_tensor(f"{name}.qweight"), fh.get_tensor(f"{name}.scales"))
                if tuple(out[name][0].shape) != shape or out[name][0].dtype != torch.int8:
                    why = f"hold {name} in another shape"
                    break
    # noqa: BLE001 (SafetensorError, OSError, ValueError): quantize again, overwrite it
    except Exception as exc:
        why = f"cannot be read ({type(exc).__name__})"
    if why is None and meta.get("checksum") != checksum(t for pair in out.values() for t in pair):
        why = "do not match their checksum"
    if why is not None:
        note(f"specgen: the cached int8 weights {path.name} {why}; quantizing again")
        return None
    return out


def _write(path: Path, weights: int8.Weights, quiet: bool) -> None:
    tensors = {}
    for name, (q, s) in weights.items():
        tensors[f"{name}.qweight"], tensors[f"{name}.scales"] = q.contiguous(), s.contiguous()
    metadata = {
        "names": json.dumps(list(weights)),
        "format": str(FORMAT_VERSION),
        "checksum": checksum(t for pair in weights.values() for t in pair),
    }
    try:
        atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
        stem = path.name.rsplit(".", 2)[0]  # the folder's name and mark, the role: an older digest is stale
        name, _, role = stem.rpartition(".")
        legacy = f"{name.rsplit('-', 1)[0]}.{role}"  # the name without the mark, as files were once named
        for pattern in (stem, legacy):
            for stale in path.parent.glob(f"{glob.escape(pattern)}.*.safetensors"):
                if stale != path and stale.name.count(".") == path.name.count("."):
                    with contextlib.suppress(OSError):
                        stale.unlink()
    # noqa: BLE001 (OSError, SafetensorError): only costs the next load the quantization
    except Exception as exc:
        if not quiet:
            note(
                f"specgen: could not cache int8 weights in {path.parent}: "
                f"{getattr(exc, 'strerror', None) or exc}"
            )
