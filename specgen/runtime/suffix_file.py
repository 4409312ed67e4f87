"""The suffix memory's file (runtime/suffix.py): kept across runs, never trusted.

A header (magic bytes, format version, max_depth, min_match, the segment count and the
fingerprint of the tokenizer the ids belong to), each segment's length, the segments' token
slots, and a blake2b digest of all of it. The index is not stored: `load` rebuilds it and checks
every link, so no file can make a walk leave its array; a file of another tokenizer, another
version, a wrong digest or a length that does not add up is a SuffixFileError naming the file.
Loading into a smaller budget keeps the newest text that fits. `save` writes atomically.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
from array import array

from specgen.runtime.suffix import (
    LINK_FLOOR,
    MAX_CAP,
    SEG_OVERHEAD,
    SLOT_BYTES,
    Segment,
    SuffixFileError,
    SuffixMemory,
    swapped,
    tail_of,
)

MAGIC = b"SGSUFMEM"
VERSION = 1
_HEAD = struct.Struct("<8sIIIII")  # magic, version, max_depth, min_match, segments, fingerprint bytes
_DIGEST = 32


def save(memory: SuffixMemory, path, fingerprint: str) -> None:
    """Write the memory atomically (path + ".tmp", fsync, rename); the fingerprint names the
    tokenizer the ids belong to. An OSError becomes a SuffixFileError."""
    name, fp = os.fspath(path), fingerprint.encode("utf-8")
    tmp = name + ".tmp"
    try:
        with memory._lock, open(tmp, "wb") as f:
            h = hashlib.blake2b(digest_size=_DIGEST)
            segs = [s for s in memory._segs if s.n]
            parts = [_HEAD.pack(MAGIC, VERSION, memory.max_depth, memory.min_match, len(segs), len(fp)), fp]
            parts.append(struct.pack(f"<{len(segs)}Q", *(s.n for s in segs)))
            parts += [
                memoryview(s.tok)[: s.n] if sys.byteorder == "little" else swapped(s.tok[: s.n]) for s in segs
            ]
            for part in parts:
                f.write(part)
                h.update(part)
            f.write(h.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise SuffixFileError(f"{name}: cannot write the suffix memory ({e.strerror or e})") from None


def load(path, fingerprint: str, budget: int, **kw) -> SuffixMemory:
    """Read a file written by save into a memory of `budget` bytes (the newest text that fits).
    Raises SuffixFileError for an unreadable, truncated, corrupt or foreign file."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            data = memoryview(f.read())
    except OSError as e:
        raise SuffixFileError(f"{name}: cannot read the suffix memory ({e.strerror or e})") from None
    try:
        depth, mm, lengths = _parse(data, fingerprint)
    except (ValueError, struct.error, UnicodeDecodeError, OverflowError) as e:
        raise SuffixFileError(f"{name}: {' '.join(str(e).split())}") from None
    SuffixMemory(budget, **kw)  # a bad budget or setting is the caller's ValueError, not the file's
    try:
        mem = SuffixMemory(budget, **{"max_depth": depth, "min_match": mm, **kw})
    except ValueError as e:
        raise SuffixFileError(f"{name}: its max_depth {depth} does not fit ({e})") from None
    end, room, kept = len(data) - _DIGEST, mem._area, []
    for i in reversed(range(len(lengths))):  # newest first
        n, end = lengths[i], end - 4 * lengths[i]
        cut = max(0, n - (room - SEG_OVERHEAD) // SLOT_BYTES)
        if cut and n - cut < mem.max_depth + 8:
            break
        try:
            kept.append(_sealed(mem, data[end : end + 4 * n], n, cut))
        except ValueError as e:
            raise SuffixFileError(f"{name}: corrupt segment {i} ({e})") from None
        room -= kept[-1].nbytes
        if cut:
            break
    mem._segs = kept[::-1]
    mem._seg_bytes = sum(s.nbytes for s in kept)
    mem._tokens = sum(s.tokens for s in kept)
    return mem


def _sealed(memory: SuffixMemory, raw: memoryview, n: int, cut: int) -> Segment:
    """A full segment from a file's slots raw[4*cut:], links checked, the index rebuilt."""
    if cut:  # keep whole runs where a run starts close after the cut
        probe = array("i", bytes(raw[4 * cut : 4 * min(n, cut + 4096)]))
        probe = probe if sys.byteorder == "little" else swapped(probe)
        starts = [j for j, v in enumerate(probe) if v == -1 or v < LINK_FLOOR]
        cut += starts[0] if starts and n - cut - starts[0] >= memory.max_depth + 8 else 0
    seg = Segment(n - cut)
    memoryview(seg.tok).cast("B")[:] = raw[4 * cut :]
    seg.tok = seg.tok if sys.byteorder == "little" else swapped(seg.tok)
    tok, head, prev, size, mm = seg.tok, seg.head, seg.prev, seg.cap, memory.min_match
    window, skip = [], 0
    for p in range(seg.cap):
        v = tok[p]
        if v >= 0:
            if skip:  # a copy of an older segment's text: context only
                skip -= 1
            else:
                seg.tokens += 1
                if len(window) == mm:
                    h = hash(tuple(window)) % size
                    prev[p], head[h] = head[h], p
            window.append(v)
            if len(window) > mm:
                del window[0]
            continue
        window, skip = [], 0
        if LINK_FLOOR <= v < -1:
            t = -2 - v - cut
            if t < 0 and cut:
                tok[p] = -1
                continue
            if not 0 <= t < seg.cap or tok[t] < 0:
                raise ValueError(f"a link at slot {p} leads to slot {t}")
            tok[p] = -2 - t
            if t < p:
                window = tail_of(tok, t + 1, mm)
        elif v < LINK_FLOOR:
            skip = LINK_FLOOR - v
    seg.n = seg.cap
    return seg


def _parse(data: memoryview, fingerprint: str) -> tuple[int, int, list[int]]:
    """Check a file's bytes; returns max_depth, min_match and the segments' lengths (slots)."""
    if len(data) < _HEAD.size + _DIGEST or bytes(data[:8]) != MAGIC:
        raise ValueError("not a specgen suffix memory file (bad magic or too short)")
    if hashlib.blake2b(data[:-_DIGEST], digest_size=_DIGEST).digest() != bytes(data[-_DIGEST:]):
        raise ValueError("checksum mismatch: the file is truncated or corrupt")
    _, version, depth, mm, nseg, fplen = _HEAD.unpack_from(data)
    if version != VERSION:
        raise ValueError(f"format version {version}, this specgen reads version {VERSION}")
    if not 1 <= mm <= depth <= 4096:
        raise ValueError(f"bad header: max_depth {depth}, min_match {mm}")
    body = len(data) - _DIGEST
    off = _HEAD.size + fplen
    if off + 8 * nseg > body:
        raise ValueError(f"bad header: declares {fplen} fingerprint bytes and {nseg} segments")
    got = bytes(data[_HEAD.size : off]).decode("utf-8")
    if got != fingerprint:
        raise ValueError(
            f"written for another tokenizer (fingerprint {got!r:.60}, expected {fingerprint!r:.60})"
        )
    lengths = list(struct.unpack_from(f"<{nseg}Q", data, off))
    off += 8 * nseg
    if any(n >= MAX_CAP for n in lengths) or off + 4 * sum(lengths) != body:
        raise ValueError(f"bad header: declares {sum(lengths)} slots for {body - off} bytes")
    return depth, mm, lengths
