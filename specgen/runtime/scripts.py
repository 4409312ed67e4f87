"""The script of each token id, for a pruned draft head (runtime/pruned.py), and the cache files
that keep what was read or learned of a tokenizer's ids (its scripts; runtime/head_memory.py's
memory)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch

from specgen.errors import SpecgenError
from specgen.files import atomic_write, cache_root
from specgen.text import BYTE_TOKEN, is_byte_level

TRIP = 3  # different ids of a script (or of a block) among a head's recent reads that pack it
_LEAD = re.compile("[\xc2-\xf4]")  # a UTF-8 lead byte, as byte-level BPE spells it
SCRIPTS_FORMAT = 1  # of the cached scripts (Scripts)


class Scripts:
    """The script of each token id's text, for a pruned head (PrunedHead.see): the UTF-8 lead
    byte of its first character outside ASCII, CJK ideographs (lead bytes E4-E9) as one script
    and Hangul syllables (EA-ED) as one; -1 for ids of ASCII text (words, code, punctuation).

    A Chinese answer's ids are spread over the whole vocabulary: Qwen's 25,900 or so ideograph
    ids fill blocks 24-30 (ids 98304-126975), and common words (使用, 一个, 来) sit 40 to a
    block in blocks 8-23. So packing the blocks a text's ids fell in left those words out, and
    the draft could not propose them (benchmarks/floor.md, "A script's ids at once").

    Reading every piece of the vocabulary takes 0.3-0.5 s for Qwen's 151,646, too long to pay
    when a text turns to another script (a 26-token answer takes 4 s). So it is read once per
    tokenizer file and kept in the cache (`scripts/`, 2 bytes an id), keyed by the file's path,
    size and time: a load reads it back in a millisecond."""

    def __init__(self, tokenizer, vocab: int):
        self.byte_level = is_byte_level(tokenizer)
        self.tokenizer, self.vocab = tokenizer, vocab
        self._all: torch.Tensor | None = None

    def tripped(self, ids: set[int]) -> list[int]:
        """The scripts that TRIP or more of `ids` are in."""
        scripts = self.all()[torch.tensor(sorted(ids), dtype=torch.long)]
        values, counts = torch.unique(scripts[scripts >= 0], return_counts=True)
        return values[counts >= TRIP].tolist()

    def ids(self, script: int) -> torch.Tensor:
        """Every id of `script`, ascending."""
        return torch.nonzero(self.all() == script).flatten()

    def all(self) -> torch.Tensor:
        """Each id's script, int16 [vocab]: from the cache, else read from the vocabulary (and kept)."""
        if self._all is None:
            path = tokenizer_cache(self.tokenizer, "scripts", f"{SCRIPTS_FORMAT}\t{self.vocab}")
            try:
                data = path.read_bytes() if path is not None else b""
            except OSError:
                data = b""
            if len(data) == 2 * self.vocab:
                self._all = torch.frombuffer(bytearray(data), dtype=torch.int16)
            else:
                self._all = self._read()
                if path is not None:
                    try:  # a cache: a failed write (a read-only disk) costs the next load a read
                        atomic_write(path, lambda tmp: tmp.write_bytes(self._all.numpy().tobytes()))
                    except (OSError, SpecgenError):
                        pass
        return self._all

    def _read(self) -> torch.Tensor:
        scripts = torch.full((self.vocab,), -1, dtype=torch.int16)
        found = {
            i: self._script(piece) for piece, i in self.tokenizer.get_vocab().items() if 0 <= i < self.vocab
        }
        found = {i: s for i, s in found.items() if s >= 0}
        if found:
            scripts[list(found)] = torch.tensor(list(found.values()), dtype=torch.int16)
        return scripts

    def _script(self, piece: str) -> int:
        if self.byte_level:
            found = _LEAD.search(piece)
            lead = ord(found.group()) if found else -1
        else:
            byte = BYTE_TOKEN.fullmatch(piece)
            text = next((c for c in piece if ord(c) >= 0x80 and c != "\u2581"), None)
            lead = (
                int(byte.group(1), 16) if byte else text.encode("utf-8", "surrogatepass")[0] if text else -1
            )
            lead = lead if lead >= 0xC2 else -1
        if 0xE4 <= lead <= 0xE9:
            return 0xE4
        if 0xEA <= lead <= 0xED:
            return 0xEA
        return lead


def tokenizer_cache(tokenizer, folder: str, key: str, suffix: str = ".bin") -> Path | None:
    """A cache file in `folder` for what was read or learned of `tokenizer`'s ids: named by its
    tokenizer.json's path, size and time and by `key` (None for a tokenizer with no such file,
    whose ids are then read afresh each time)."""
    name = str(getattr(tokenizer, "name_or_path", "") or "")
    if not name:
        return None
    try:
        source = Path(name, "tokenizer.json").resolve()
        info = source.stat()
    except OSError:
        return None
    key = f"{key}\t{source}\t{info.st_size}\t{info.st_mtime_ns}".encode()
    return cache_root() / folder / f"{hashlib.sha256(key).hexdigest()[:32]}{suffix}"
