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

import contextlib
import hashlib
import io
import json
import re
import shutil
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
from transformers.utils import logging as hf_logging

from specgen.errors import ModelError
from specgen.models.cache import atomic_write, check_writable, converted_root, locked
from specgen.status import status

MARKER = ".complete"


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _file_key(gguf: Path) -> str:
    """Identifies one version of a file: its stem for people, a hash of (path, size, mtime) for us."""
    resolved = gguf.resolve()
    stat = resolved.stat()
    digest = hashlib.sha256(f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    return f"{gguf.stem}-{digest[:12]}"


def converted_dir_for(gguf: Path, dtype, key: str | None = None) -> Path:
    """Where the conversion of `gguf` to `dtype` lives; `key` replaces the file-derived name
    (the catalog passes the model name, so its directory survives a re-download)."""
    return converted_root() / f"{key or _file_key(Path(gguf))}-{_dtype_name(dtype)}"


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
            atomic_write(target, lambda tmp: _convert(gguf, dtype, tmp), tmp=target.with_name(f"{target.name}.tmp"))
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


def _convert(gguf: Path, dtype, out: Path) -> None:
    try:
        with _muted_transformers():
            # dequantize=True: a packed (GgufLinear) model cannot be saved, and dense is what we want;
            # trust_remote_code=False: a model's own Python code never runs (see models/load.py)
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=dtype, quantization_config=GgufConfig(dequantize=True),
                trust_remote_code=False,
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
    except (ValueError, KeyError, NotImplementedError) as error:
        raise _friendly(error, gguf) from error
    marker = {"gguf": str(gguf.resolve()), "size": gguf.stat().st_size, "dtype": _dtype_name(dtype)}
    (out / MARKER).write_text(json.dumps(marker) + "\n")


def _friendly(error: Exception, gguf: Path) -> Exception:
    """transformers' unsupported-architecture errors, as one line naming the architecture."""
    text = str(error)
    found = re.search(r"architecture\s+'?([\w.\-]+)'?\s+is not supported", text)
    if found:
        return ModelError(f"GGUF architecture '{found.group(1)}' is not supported by transformers")
    if "not supported" in text or "Unknown gguf" in text:
        return ModelError(f"cannot convert {gguf.name}: {text.splitlines()[0]}")
    return error


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
