"""GGUF to a cached, ready-to-load Hugging Face directory.

Loading a GGUF with transformers dequantizes every tensor and rebuilds the tokenizer from metadata:
about 45 s for the 1.5B target on 2 cores. This module does that once per (file, dtype) and saves
the result (safetensors, tokenizer.json, config) under `cache_root()/converted/`, so later loads are
a memory map away. A directory is only given its final name, with a `.complete` marker inside, after
everything was written; a half-written one from a killed process is never loaded.

It owns the `converted/` part of the cache; it knows nothing about where GGUF files come from.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path

from specgen.catalog import cache_root, check_writable
from specgen.errors import ModelError

MARKER = ".complete"
_TMP = ".tmp-"  # infix of a directory being written: <final name>.tmp-<pid>


def converted_root() -> Path:
    return cache_root() / "converted"


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
    _remove_stale(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}{_TMP}{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with status(f"converting {gguf.name} to {_dtype_name(dtype)} (once; later loads are fast)", quiet):
            _convert(gguf, dtype, tmp)
        _publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # also on Ctrl-C: never leave a half-written tree behind
        raise
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
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    try:
        with _muted_transformers():
            # dequantize=True: a packed (GgufLinear) model cannot be saved, and dense is what we want
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=dtype, quantization_config=GgufConfig(dequantize=True),
                trust_remote_code=False,
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
    except (ValueError, KeyError, NotImplementedError) as error:
        raise _friendly(error, gguf) from error
    _fsync_files(out)  # the marker must never be on disk before the files it vouches for
    marker = {"gguf": str(gguf.resolve()), "size": gguf.stat().st_size, "dtype": _dtype_name(dtype)}
    (out / MARKER).write_text(json.dumps(marker) + "\n")


def _fsync_files(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def _friendly(error: Exception, gguf: Path) -> Exception:
    """transformers' unsupported-architecture errors, as one line naming the architecture."""
    text = str(error)
    found = re.search(r"architecture\s+'?([\w.\-]+)'?\s+is not supported", text)
    if found:
        return ModelError(f"GGUF architecture '{found.group(1)}' is not supported by transformers")
    if "not supported" in text or "Unknown gguf" in text:
        return ModelError(f"cannot convert {gguf.name}: {text.splitlines()[0]}")
    return error


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished directory into place. If another process won the race, keep theirs."""
    try:
        os.replace(tmp, target)
    except OSError:
        if not is_converted(target):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale(target: Path) -> None:
    """Remove a target without its marker, and temporary trees whose writer process is gone."""
    if target.exists() and not is_converted(target):
        shutil.rmtree(target, ignore_errors=True)
    for leftover in target.parent.glob(f"{target.name}{_TMP}*"):
        pid = leftover.name.rsplit(_TMP, 1)[1]
        if not (pid.isdigit() and _alive(int(pid))):
            shutil.rmtree(leftover, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftover, from an earlier call that was interrupted
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def converted_dirs(key_prefix: str) -> list[Path]:
    """The converted directories (complete or not) whose key is `key_prefix`, in any dtype."""
    root = converted_root()
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(f"{key_prefix}-"))


def remove_converted(key_prefix: str) -> None:
    """Delete every converted directory of `key_prefix`, e.g. a catalog model's name."""
    for directory in converted_dirs(key_prefix):
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def status(message: str, quiet: bool):
    """While a slow step runs: a spinner on a terminal, else `message` as one line on stderr."""
    if quiet:
        yield
        return
    from rich.console import Console
    from rich.markup import escape

    # bound to the real stream now: `_muted_transformers` swaps `sys.stderr` while this spins
    console = Console(file=sys.stderr)
    if not console.is_terminal:  # piped or logged: a spinner would print nothing at all
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        yield
        return
    with console.status(escape(message)):
        yield


@contextlib.contextmanager
def _muted_transformers():
    """Hide transformers' own tqdm bars and info logs, which would fight with the spinner.

    The legacy GGUF loader writes its tqdm bar straight to `sys.stderr`, so stderr is captured; the
    Rich spinner already holds the real stream. Warnings still reach the logger at error level.
    """
    from transformers.utils import logging as hf_logging

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
