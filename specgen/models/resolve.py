"""A model argument resolved to what it names, before anything is read or converted.

A model argument resolves in this order: an existing local path (a Hugging Face directory or
a .gguf file), a catalog name, a Hugging Face id (local HF cache, or the hub when reachable).
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specgen.errors import ModelError
from specgen.models import catalog
from specgen.models.convert import check_gguf, ensure_converted, file_key


@dataclass(frozen=True)
class Resolved:
    path: str | None  # a directory to load from, or a hub id; None for a GGUF source not yet converted
    source: str
    name: str
    gguf: str | None = None  # the GGUF file of a GGUF or catalog source (a catalog model may have dropped it)
    key: str | None = None  # what a GGUF source's derived files are named after

    def gguf_file(self, quiet: bool = False) -> Path:
        """The GGUF file, fetched again for a catalog model whose int8 store let it go."""
        return gguf_file(self.source, self.name, self.gguf, quiet)

    def converted(self, dtype: torch.dtype, quiet: bool = False) -> "Resolved":
        """This source with a full-precision directory to load (a GGUF converted once, cached)."""
        if self.path is not None:
            return self
        key = self.key if self.source == "catalog" else None
        return replace(self, path=str(ensure_converted(self.gguf_file(quiet), dtype, key=key, quiet=quiet)))


def gguf_file(source: str, name: str, gguf: str, quiet: bool) -> Path:
    """A GGUF or catalog source's file: a catalog model's is fetched (again, if its int8 store
    let it go; a no-op when it is in place), a user's file is what it is."""
    return catalog.fetch(catalog.CATALOG[name], quiet=quiet) if source == "catalog" else Path(gguf)


def resolve(arg: str, dtype: torch.dtype, quiet: bool = False, convert: bool = True) -> Resolved:
    """Turn a --target/--draft value into something from_pretrained can load (with `convert`
    False, a GGUF source is left unconverted and a catalog model unfetched: `Resolved.converted`)."""
    if not arg.strip():  # Path("") is the current directory
        raise ModelError("the name is empty; give a model directory, a .gguf file or a catalog name")
    path = Path(arg).expanduser()
    if path.exists():
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelError(f"{path} is a directory but has no config.json; not a model directory")
            return Resolved(str(path), "dir", path.name)
        if not os.access(path, os.R_OK):
            raise ModelError(f"cannot read {path}: permission denied")
        if not _has_gguf_magic(path):
            raise ModelError(f"{path} is not a GGUF file (no GGUF header) and not a model directory")
        check_gguf(path)
        found = Resolved(None, "gguf", path.name, str(path.resolve()), file_key(path))
    elif arg in catalog.CATALOG:
        model = catalog.CATALOG[arg]
        found = Resolved(None, "catalog", arg, str(catalog.gguf_path(model)), model.name)
    elif _looks_like_path(arg):
        raise ModelError(f"model path {arg} does not exist")
    elif arg.count("/") == 1 and not arg.startswith("/"):
        return Resolved(arg, "hub", arg)
    else:
        close = difflib.get_close_matches(arg, list(catalog.CATALOG), n=3, cutoff=0.4)
        hint = f"; did you mean: {', '.join(close)}?" if close else "; see `specgen models list`"
        raise ModelError(f"unknown model '{arg}': not a local path, a catalog name or a hub id{hint}")
    return found.converted(dtype, quiet) if convert else found


def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def _looks_like_path(arg: str) -> bool:
    return arg.startswith((".", "/", "~")) or arg.lower().endswith(".gguf") or os.sep + os.sep in arg
