"""The int8 store's shards, checked against their checksums (runtime/int8_store.py builds and
reads the store; this module only vouches for its files).

Each shard's safetensors metadata holds a checksum: SHA-256 over each tensor's SHA-256, in name
order. A shard is hashed in place through a memory map (nothing copied into the process), once
per version of the file: `.verified` records each checked shard's size, inode, mtime and ctime,
and a shard that still has them is not hashed again. A rewrite or a copy changes them (ctime
cannot be set back), so what that misses is only a change of bytes underneath the file system.
A shard that does not match, or cannot be read, raises CorruptStore: the store rebuilds it.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open

from specgen.errors import ModelError
from specgen.files import atomic_write

VERIFIED = ".verified"  # shard name -> the stat of the file as it was when its checksum matched


def checksum(tensors) -> str:
    """SHA-256 over each tensor's SHA-256 (hashed on a thread per core: hashlib releases the
    GIL; about 0.5 s for the default target's 1.5 GB on 2 cores, see benchmarks/first-run.md)."""

    def one(tensor: torch.Tensor) -> bytes:
        return hashlib.sha256(memoryview(tensor.contiguous().view(torch.uint8).numpy())).digest()

    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(one, tensors))
    return hashlib.sha256(b"".join(digests)).hexdigest()


def shard_checksum(tensors: dict[str, torch.Tensor]) -> str:
    return checksum(tensors[name] for name in sorted(tensors))


class CorruptStore(ModelError):
    """A store file whose bytes no longer match their checksum."""


def readable(directory: Path, prefix: str) -> tuple[Path, ...]:
    """The `prefix` shards, once their bytes match their checksums and each opens as safetensors."""
    shards = tuple(sorted({file for file, _ in verified(directory, prefix).values()}))
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt"):
                pass
        except Exception as error:  # noqa: BLE001 (SafetensorError, OSError): a damaged file, rebuilt
            raise CorruptStore(
                f"{shard.name} of the int8 store {directory.name} cannot be read "
                f"({str(error).splitlines()[0][:120]})"
            ) from None
    return shards


def _index(directory: Path, prefix: str) -> dict[str, tuple[Path, tuple]]:
    """tensor name -> (its shard, its shape), from the `prefix` shards' headers (nothing hashed)."""
    return {
        name: (shard, tuple(entry["shape"]))
        for shard in _shards(directory, prefix)
        for name, entry in _header(shard, directory)[1].items()
    }


def verified(directory: Path, prefix: str) -> dict[str, tuple[Path, tuple]]:
    """`_index`, once every `prefix` shard's bytes match its checksum (hashed through a memory
    map, tensor by tensor as `checksum` hashes them; nothing is copied into the process), or the
    shard is the very file whose checksum matched before (`VERIFIED`: its size, inode, mtime and
    ctime unchanged)."""
    known = _known(directory)
    checked = {}
    for shard in _shards(directory, prefix):
        signature = _signature(shard)
        if signature is None or known.get(shard.name) != signature:
            hash_check(shard, directory)
            if signature is not None:
                checked[shard.name] = signature
    if checked:
        _remember(directory, {**known, **checked})
    return _index(directory, prefix)


def _signature(shard: Path) -> list[int] | None:
    """What changes when a file is rewritten, replaced or copied over (None: it cannot be read)."""
    try:
        st = shard.stat()
    except OSError:
        return None
    return [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def _known(directory: Path) -> dict[str, list[int]]:
    """The shards checked before and their signatures then (nothing, if the record is unreadable)."""
    try:
        known = json.loads((directory / VERIFIED).read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _remember(directory: Path, known: dict[str, list[int]]) -> None:
    """Record the checked shards; a store the user cannot write to is simply hashed next time."""
    try:
        atomic_write(
            directory / VERIFIED, lambda tmp: tmp.write_text(json.dumps(known) + "\n"), parents=False
        )
    except OSError:
        pass


def hash_check(shard: Path, directory: Path) -> None:
    """Raise CorruptStore unless the shard's bytes match its recorded checksum."""
    start, header, expected = _header(shard, directory)
    spans = [header[name]["data_offsets"] for name in sorted(header)]
    try:
        with (
            open(shard, "rb") as handle,
            mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
        ):
            view = memoryview(mapped)
            with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
                digests = list(
                    pool.map(
                        lambda span: hashlib.sha256(view[start + span[0] : start + span[1]]).digest(),
                        spans,
                    )
                )
            view.release()
    except (OSError, ValueError) as error:  # a truncated file: rebuilt
        raise CorruptStore(
            f"{shard.name} of the int8 store {directory.name} cannot be read "
            f"({str(error).splitlines()[0][:120] if str(error) else type(error).__name__})"
        ) from None
    if expected != hashlib.sha256(b"".join(digests)).hexdigest():
        raise CorruptStore(f"{shard.name} of the int8 store {directory.name} does not match its checksum")


def _shards(directory: Path, prefix: str) -> list[Path]:
    return sorted(directory.glob(f"{prefix}-*.safetensors"))


def _header(shard: Path, directory: Path) -> tuple[int, dict, str | None]:
    """(where the data starts, the tensors' entries, the recorded checksum) of one shard."""
    try:
        with open(shard, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if size > os.fstat(handle.fileno()).st_size - 8:  # garbled: read(size) would ask for exabytes
                raise ValueError(f"a header of {size} bytes in a shorter file")
            header = json.loads(handle.read(size))
        expected = header.pop("__metadata__", {}).get("checksum")
        if not all(
            isinstance(entry, dict) and "data_offsets" in entry and "shape" in entry
            for entry in header.values()
        ):
            raise ValueError("an entry without offsets or shape")
    except (OSError, ValueError, AttributeError) as error:  # a truncated or garbled header: rebuilt
        raise CorruptStore(
            f"{shard.name} of the int8 store {directory.name} cannot be read "
            f"({str(error).splitlines()[0][:120] if str(error) else type(error).__name__})"
        ) from None
    return 8 + size, header, expected
