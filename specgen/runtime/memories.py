"""The suffix memories of one target model (runtime/suffix.py), by tenant: what earlier requests
wrote, drafted from at no model cost (`--method suffix`; lookup and lookup-chain consult it too).

A memory shared between clients leaks: a draft from another client's text is accepted, and a
round that accepts more runs faster, so acceptance and timing tell a client whether someone else
wrote the same text before. The scope says who shares one memory:

* `key` (the server's default): one memory per API key; requests with no key, or the local
  token, share the server's own one;
* `shared`: one memory for every client (what leaks is said above: use it where the clients
  trust each other, such as one agent's own requests);
* `request`: a memory per request, gone with it (only the request's own text: prompt lookup with
  frequencies).

In-process commands (run, chat, bench, a prompt set) are one tenant, "". The memories together
hold at most `budget` bytes: each is bounded by it, and when they hold more together the least
recently used tenant's memory goes whole. `--suffix-cache-file` keeps the "" tenant's memory
(the process's own, or a server's shared one) across starts: loaded when configured, written at
`save` (atomically); a file that cannot be used is set aside with a one-line notice and the
memory starts empty.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from pathlib import Path

from specgen.config import MemorySettings, Scope
from specgen.runtime import suffix_file
from specgen.runtime.suffix import SuffixFileError, SuffixMemory
from specgen.status import note

DEFAULT_MIB = 256
OWN = ""  # the tenant of the process's own requests (and of keyless or local-token clients)


def tenant_of(key: str | None) -> str:
    """A client's tenant from its API key: a digest (the key itself is never kept)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32] if key else OWN


class Memories:
    """The memories of one target, by tenant, within one budget (see the module)."""

    def __init__(self, budget: int = DEFAULT_MIB << 20, scope: Scope = Scope.KEY):
        self.budget, self.scope = budget, scope
        self.path: Path | None = None
        self.fingerprint = ""
        self._held: OrderedDict[str, SuffixMemory] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def configure(self, settings: MemorySettings, fingerprint: str = "") -> None:
        """Budget, scope and file; a file is read now (a notice, and an empty memory, when it
        cannot be used). `fingerprint`: the tokenizer's (a file of another tokenizer is foreign)."""
        self.budget, self.scope = settings.budget, settings.suffix_scope
        path = settings.suffix_cache_file
        self.path, self.fingerprint = (Path(path) if path else None), fingerprint
        with self._lock:
            self._held.clear()
            if self.path is not None and self.path.exists():
                try:
                    self._held[OWN] = suffix_file.load(self.path, fingerprint, self.budget)
                except SuffixFileError as error:
                    note(f"specgen: {error}; the suffix memory starts empty (the file is rewritten at exit)")

    def get(self, tenant: str = OWN) -> SuffixMemory:
        """The memory a request of `tenant` drafts from and writes to."""
        if self.scope is Scope.REQUEST:
            return SuffixMemory(self.budget)
        name = OWN if self.scope is Scope.SHARED else tenant
        with self._lock:
            memory = self._held.pop(name, None) or SuffixMemory(self.budget)
            self._held[name] = memory
            self._trim()
            return memory

    def trim(self) -> None:
        """After a write: the memories together within the budget again."""
        if len(self._held) > 1:
            with self._lock:
                self._trim()

    def _trim(self) -> None:
        """The least recently used tenants' memories go whole while the memories hold more than
        the budget together (the most recently used stays: it bounds itself)."""
        while len(self._held) > 1 and sum(m.nbytes for m in self._held.values()) > self.budget:
            del self._held[next(iter(self._held))]

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(m.nbytes for m in self._held.values())

    def clear(self) -> None:
        """Forget every tenant's text (bench: each measured generation starts from nothing)."""
        with self._lock:
            self._held.clear()

    def save(self) -> None:
        """Write the own tenant's memory to the file, if there is one (a failure is a notice:
        the run's work is done and kept)."""
        memory = self._held.get(OWN)
        if self.path is None or memory is None:
            return
        try:
            suffix_file.save(memory, self.path, self.fingerprint)
        except SuffixFileError as error:  # the run's work is done and kept: say it
            note(f"specgen: {error}")


def fingerprint(tokenizer) -> str:
    """What a memory's token ids mean: a digest of the tokenizer's vocabulary."""
    vocab = tokenizer.get_vocab()
    text = "\n".join(f"{token}\t{i}" for token, i in sorted(vocab.items(), key=lambda item: item[1]))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
