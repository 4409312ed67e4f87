"""OUT.jsonl of a prompt set (`specgen run --prompts-file F --output OUT.jsonl`): one JSON line per
finished prompt, keyed by the prompt's id, written as it finishes; a rerun skips what is there.

Writes are atomic per line: each line is ONE `os.write` of the complete line (newline included)
on an `O_APPEND` descriptor, so a crash of this process (Ctrl-C, kill -9, out of memory) never
leaves half a line; the kernel holds every line that a write returned for. fsync policy: the
file is fsynced after its first new line, then at most once every `SYNC_SECONDS` and when it
closes (also on Ctrl-C), so a power loss or a kernel crash loses at most the last second of
lines and may leave a torn last line. Opening the file again (the rerun) drops a last line that
is incomplete or not a result line, if result lines come before it, so the file is whole again
before anything is appended; a file whose lines are not results (a prompts file, notes) is
refused, never cut. A run holds an exclusive lock on the file itself (`flock` on its descriptor,
so two runs with different caches, users or containers see it too): a second run on the same
file is refused.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from pathlib import Path

from specgen.decoding.views import Outcome
from specgen.errors import ConfigError, SpecgenError
from specgen.files import flock_now
from specgen.text import json_value

SYNC_SECONDS = 1.0


def prompt_digest(prompt: str) -> str:
    """What a result line keeps of its prompt: a rerun on an edited prompts file can tell."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


def result_record(ident, prompt: str, outcome: Outcome) -> dict:
    """A finished prompt as its OUT.jsonl line holds it: id, the prompt's digest, text, token ids,
    method, stats (and the tokens' logprobs when the run asked for them)."""
    return {
        "id": ident,
        "prompt_sha256": prompt_digest(prompt),
        "text": outcome.text,
        "token_ids": outcome.token_ids,
        "method": outcome.stats.method,
        **outcome.extra,
        "stats": outcome.stats.as_dict(),
    }


class ResultsFile:
    """An OUT.jsonl opened for a run: `done` maps the ids already there to their prompts' digests
    (None in a line written before results kept one); `write` appends one."""

    def __init__(self, path, fd: int, done: dict, dropped: int, created: bool = False):
        self.path = Path(path)
        self.done = done
        self.dropped = dropped  # bytes of a torn last line removed when the file was opened
        self.created = created  # this run made the file: a run that fails before its first line removes it
        self._fd: int | None = fd
        self._synced_at: float | None = None

    @classmethod
    def open(cls, path) -> "ResultsFile":
        """Open (or create) `path`, lock it, repair a torn last line and read the ids it holds."""
        path = Path(path)
        try:
            created = not path.exists()
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ConfigError(f"cannot write --output {path}: {exc.strerror or exc}") from None
        try:
            _lock(fd, path)
            done, keep, size = _scan(fd, path)
            if keep < size:  # a torn (or garbled) last line: cut it before appending
                os.ftruncate(fd, keep)
                _sync(fd, path)
        except BaseException:
            os.close(fd)  # and the lock with it
            raise
        return cls(path, fd, done, size - keep, created)

    def write(self, record: dict) -> None:
        """Append one result line atomically; its id joins `done`."""
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        before = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, line)
        except OSError as exc:
            raise SpecgenError(f"cannot write {self.path}: {exc.strerror or exc}") from None
        if written != len(line):  # a full disk: take the partial line back so the file stays whole
            os.ftruncate(self._fd, before)
            raise SpecgenError(
                f"cannot write {self.path}: only {written} of {len(line)} bytes fit (disk full?)"
            )
        self.done[record["id"]] = record.get("prompt_sha256")
        now = time.monotonic()
        if self._synced_at is None or now - self._synced_at >= SYNC_SECONDS:
            _sync(self._fd, self.path)
            self._synced_at = now

    def close(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            _sync(fd, self.path)
        finally:
            os.close(fd)  # the lock goes with it

    def __enter__(self) -> "ResultsFile":
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            self.close()
            return
        try:  # an error already on its way (a full disk, Ctrl-C) is the one to report
            if self.created and self._fd is not None and os.fstat(self._fd).st_size == 0:
                self.path.unlink(
                    missing_ok=True
                )  # nothing written: the run leaves no file behind (lock held)
        except OSError:
            pass
        finally:
            try:
                self.close()
            except SpecgenError:
                pass


def _lock(fd: int, path: Path) -> None:
    try:
        flock_now(fd)
    except BlockingIOError:
        raise ConfigError(
            f"{path} is being written by another specgen run", hint="wait for it, or give another --output"
        ) from None
    except OSError as exc:  # a file system without locks
        raise ConfigError(f"cannot lock --output {path}: {exc.strerror or exc}") from None


def _sync(fd: int, path: Path) -> None:
    """fsync, where the file can be synced: a device (-o /dev/null) cannot, and needs none."""
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOTSUP, errno.EROFS):
            return
        raise SpecgenError(f"cannot write {path}: {exc.strerror or exc}") from None


def _scan(fd: int, path: Path) -> tuple[dict, int, int]:
    """(the complete result lines' ids and digests, bytes to keep, file size). A bad line in the middle of
    the file is an error (it is not ours to delete); a bad or incomplete last line is dropped."""
    size = os.fstat(fd).st_size
    chunks, offset = [], 0
    while offset < size:
        chunk = os.pread(fd, min(1 << 24, size - offset), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    data = b"".join(chunks)
    done: dict = {}
    keep, start, number = 0, 0, 0
    while start < len(data):
        end = data.find(b"\n", start)
        number += 1
        if end < 0:  # no newline: the write of this line never completed
            break
        if not data[start:end].strip():  # a blank line (edited by hand): harmless
            start = keep = end + 1
            continue
        ident, digest = _result_id(data[start:end])
        if ident is None:
            # not ours to delete: a results file's middle, or no results file
            if data[end + 1 :].strip() or not done:
                raise ConfigError(
                    f"{path}:{number}: not a specgen result line (a JSON object with an 'id' and a 'text')",
                    hint="give another --output, or remove that line",
                )
            break  # the last line, garbled by a crash of the machine: dropped like a torn one
        done[ident] = digest
        start = keep = end + 1
    if keep < len(data) and not done:  # one unfinished line and nothing else: not known to be ours
        raise ConfigError(
            f"{path}: not a specgen results file (its only line is not a whole result)",
            hint="give another --output, or remove that file",
        )
    return done, keep, len(data)


def _result_id(line: bytes) -> tuple:
    """(id, prompt digest or None) of a result line; (None, None) for any other line."""
    try:
        record = json_value(line)
    except ValueError:
        return None, None
    if not isinstance(record, dict) or "text" not in record:
        return None, None
    ident, digest = record.get("id"), record.get("prompt_sha256")
    if not isinstance(ident, (str, int)) or isinstance(ident, bool):
        return None, None
    return ident, digest if isinstance(digest, str) else None
