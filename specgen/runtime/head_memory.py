"""What a pruned draft head came to propose, kept from one process to the next.

A pruned head (runtime/pruned.py) starts every process able to propose its first ids and the
special tokens only. The ids a text needs beyond them join as the draft reads them: one by one,
a block of the vocabulary at a time, or a script's whole range once three of its ids were read.
So the first answer of a process in German or Chinese drafts from a head that cannot propose
its words, and `specgen run` without a server is a new process every time. Measured on a 2-core
AVX2 CPU (benchmarks/floor.md, "A head that remembers"): a first Chinese answer (translate-04)
took 11 rounds in a fresh process and 9 in the next turn of the same process; a German one
(translate-02), whose words are ids read one by one, 24 and 17.

`HeadMemory` keeps what the head learned, per tokenizer and pruning, in the cache (`heads/`,
one JSON file): the scripts and blocks it packed, each with the day a text last needed it,
and up to IDS of the ids it read one by one, the latest. A load primes the head with them before
any request. The ids join its forward at once. The scripts and blocks are packed then, in the
static product's format (about 0.4 s for Chinese's 25,900 ids on that CPU, milliseconds for a
block), but each joins the forward only when the draft reads one of its ids
(`PrunedHead.hold`), where a head that has not seen it waits for TRIP. Primed all at once, a
Chinese script and six blocks made every draft step 4-9% dearer for English text that needed
none of them; held, they cost it nothing, and a Chinese answer has the script from its first
ideograph on, with no packing in the request. A script or block no text needed for
STALE_DAYS is not primed at all. Only what the draft can propose changes: outputs are the
same.

The head's drafter reports each finished row's ids (`keeper`); the file is written when what
it would hold changed, at most once every WRITE_EVERY seconds after the first write of a process
(a change held back is written at exit).
"""

from __future__ import annotations

import atexit
import json
import time
import weakref
from pathlib import Path
from typing import Callable

import torch

from specgen.errors import SpecgenError
from specgen.files import atomic_write
from specgen.runtime.pruned import JOIN, PrunedHead, head_of
from specgen.runtime.scripts import TRIP, tokenizer_cache

FORMAT = 1
IDS = 2048  # ids read one by one that a memory keeps (the latest): one int8 product of 2048 rows
STALE_DAYS = 30  # a script or block no text needed for this long is not primed
WRITE_EVERY = 10.0  # seconds between writes of one process, after its first
_MEMORIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # PrunedHead -> its HeadMemory


def today() -> int:
    return int(time.time() // 86400)


class HeadMemory:
    """One pruned head's learned ids and where they are kept (see the module)."""

    def __init__(self, head: PrunedHead, path: Path | None):
        self.head, self.path = head, path
        self.days: dict[str, int] = {}  # "s<script>" or "b<block>" -> the day a text last needed it
        self.ids: list[int] = []  # ids read one by one, primed from the file
        self.written: tuple | None = None  # what the file holds (as read or last written)
        self.wrote = 0.0  # when this process last wrote it (0: not yet)
        self.held = False  # a change was held back: an exit hook writes it
        self.primed = {"scripts": 0, "blocks": 0, "ids": 0}  # what the load primed (bench reports it)

    def prime(self) -> None:
        """Prime the head with what the file holds: its ids in the forward, its scripts and
        blocks not stale held until their first id is read."""
        data = self._read()
        if data is None:
            return
        head, now = self.head, today()
        self.days = {key: day for key, day in data["days"].items() if now - day <= STALE_DAYS}
        scripts = [int(key[1:]) for key in self.days if key[0] == "s"]
        blocks = [int(key[1:]) for key in self.days if key[0] == "b"]
        self.ids = [i for i in data["ids"] if 0 <= i < head.vocab][-IDS:]
        head.hold(scripts, blocks)  # packed now, in the forward from the first id read of each
        if self.ids:
            head.pack([torch.tensor(sorted(set(self.ids)), dtype=torch.long)])
        self.written = self._state()
        self.primed = {"scripts": len(scripts), "blocks": len(blocks), "ids": len(self.ids)}

    def note(self, ids: list[int]) -> None:
        """A row finished with `ids`: the scripts and blocks it needed are dated today, what the
        head packed since is added, and the file is written if that changed what it holds."""
        head, now = self.head, today()
        for key in [f"s{s}" for s in head.learned_scripts] + [f"b{b}" for b in head.learned_blocks]:
            self.days.setdefault(key, now)
        read = torch.tensor(ids, dtype=torch.long)
        read = read[(read >= 0) & (read < head.vocab)]
        if read.numel():
            if head.scripts is not None and head.learned_scripts:
                scripts, counts = torch.unique(head.scripts.all()[read].long(), return_counts=True)
                for script, count in zip(scripts.tolist(), counts.tolist()):
                    if count >= TRIP and script in head.learned_scripts:
                        self.days[f"s{script}"] = now
            blocks, counts = torch.unique(torch.unique(read) // head.block_rows, return_counts=True)
            for block, count in zip(blocks.tolist(), counts.tolist()):
                if count >= JOIN and block in head.learned_blocks:
                    self.days[f"b{block}"] = now
        self.save()

    def save(self, now: bool = False) -> None:
        """Write the file if what it would hold changed: at once the first time in a process
        (or `now`), else once WRITE_EVERY seconds passed since the last write; a change held back
        is written when the process exits."""
        state = self._state()
        if self.path is None or state == self.written:
            return
        if not now and self.wrote and time.monotonic() - self.wrote < WRITE_EVERY:
            if not self.held:  # the last changes of a run are not lost
                atexit.register(self.save, True)
                self.held = True
            return
        days, ids = state
        text = json.dumps({"format": FORMAT, "days": dict(days), "ids": list(ids)})
        try:  # a cache: a failed write (a read-only disk) costs the next process its priming
            atomic_write(self.path, lambda tmp: tmp.write_text(text))
        except (OSError, SpecgenError):
            return
        self.written, self.wrote = state, time.monotonic()

    def _state(self) -> tuple:
        primed = set(self.ids)
        read = self.ids + [i for i in self.head.extra_ids.tolist() if i not in primed]
        return tuple(sorted(self.days.items())), tuple(read[-IDS:])

    def _read(self) -> dict | None:
        """The file's contents when they are of this format and well formed, else None."""
        if self.path is None:
            return None
        try:
            data = json.loads(self.path.read_text())
            days = {f"{k[0]}{int(k[1:])}": int(v) for k, v in data["days"].items() if k[:1] in ("s", "b")}
            ids = [int(i) for i in data["ids"]]
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None
        return {"days": days, "ids": ids} if data.get("format") == FORMAT else None


def attach(model, tokenizer) -> HeadMemory | None:
    """Give `model`'s pruned head (if it has one) the memory of its tokenizer's earlier
    processes, primed into it now; None without a pruned head or a tokenizer file."""
    head = head_of(model)
    if head is None or tokenizer is None:
        return None
    key = f"{FORMAT}\t{head.vocab}\t{len(head.ids)}\t{head.block_rows}"
    memory = HeadMemory(head, tokenizer_cache(tokenizer, "heads", key, ".json"))
    memory.prime()
    _MEMORIES[head] = memory
    return memory


def _memory_of(model) -> HeadMemory | None:
    head = head_of(model)
    return _MEMORIES.get(head) if head is not None else None


def keeper(model) -> Callable[[list[int]], None]:
    """What a drafter of `model` calls with a finished row's ids (a no-op without a memory)."""
    memory = _memory_of(model)
    return memory.note if memory is not None else (lambda ids: None)


def primed(model) -> dict | None:
    """What `model`'s head was primed with at load (scripts, blocks, ids: counts), for bench's
    record of where its figures were measured; None without a memory."""
    memory = _memory_of(model)
    return None if memory is None else dict(memory.primed)
