"""Rows' K/V kept by their tokens (a prompt once prefilled, a sequence once finished): a later
prompt that starts the same way copies that prefix into its row instead of computing it again.

What vLLM calls automatic prefix caching and llama-server `cache_prompt`. A server's requests
share a chat template's system prompt, and a chat client sends its whole conversation with
every turn: without this, a turn that arrives while other requests run, or after another
user's, prefills the whole conversation again (seconds per thousand tokens on a CPU).

A K/V slot depends only on the tokens up to it and its position, so any row whose sequence
starts with the same tokens holds valid K/V for that prefix; the copy is a memory move (the
1.5B target in bf16: 28 KB per token). Numerically the copied slots are those of another
forward's shapes, as a chat turn's kept prefix already is; deterministic mode, whose promise is
an output that depends on the request alone, does not load from a store.

A store belongs to one model (every cache of that model may share it: the engines of several
methods on one pair). It keeps whole entries, least recently used first out, within `budget`
bytes; an entry that a newer one extends is replaced by it (a finished row's sequence replaces
its prompt's entry; entries do not share memory, so a system prompt is held once per entry that
starts with it). A pair's stores keep nothing unless a front end that serves many prompts gives
them a budget (`Pair.keep_prefixes`: the server, prompt sets): a single run has nothing to
share, a local chat resumes its own row, and a benchmark that ran each prompt under every method
would measure the store.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from specgen.runtime import kvcache
from specgen.runtime.kvcache import SlotCache
from specgen.text import common_prefix

DEFAULT_MIB = 256  # K/V a store keeps by default when on (the default pair's target in bf16: ~9,000 tokens)
LEAST = 16  # tokens a prefix must share to be copied (fewer cost about as much to prefill)


@dataclass
class _Entry:
    ids: list[int]
    keys: list[torch.Tensor]  # per layer [heads, n, dim]
    values: list[torch.Tensor]
    features: torch.Tensor | None = None  # [taps, n, H]: a tapped cache's features (slots.FeatureBuffer)

    @property
    def nbytes(self) -> int:
        held = (*self.keys, *self.values) + ((self.features,) if self.features is not None else ())
        return sum(t.numel() * t.element_size() for t in held)


class PrefixStore:
    """K/V of finished sequences by their tokens (see the module); `budget` 0 keeps nothing."""

    def __init__(self, budget: int = 0, least: int = LEAST):
        self.budget, self.least = budget, least
        self.entries: OrderedDict[int, _Entry] = OrderedDict()  # oldest use first
        self.held = 0  # bytes
        self._serial = 0
        self.loaded_tokens = 0  # tokens copied into rows so far (statistics)

    @torch.inference_mode()
    def save(self, cache: SlotCache, row: int, ids: Sequence[int]) -> None:
        """Keep the K/V of row `row`, whose committed slots hold `ids`' first tokens."""
        n = min(cache.lengths[row], len(ids))
        layers = cache.layers
        if self.budget <= 0 or n < self.least or not layers[0].is_initialized:
            return
        ids = list(ids[:n])
        for key, entry in list(self.entries.items()):
            shared = common_prefix(entry.ids, ids)
            if shared == n:  # held already (in a longer entry, or this one)
                self.entries.move_to_end(key)
                return
            if shared == len(entry.ids):  # this sequence extends that entry
                self._drop(key)
        features = (
            cache.features.hidden[row, :, :n].clone()
            if cache.taps and cache.features.is_initialized
            else None
        )
        # a cache that holds float32 K/V in float64 (kvcache.SlotCache.held_dtype) is stored as
        # float32, exactly: the same tokens per MiB of the budget
        dtype = torch.float32 if cache.widened else None
        entry = _Entry(
            ids,
            [layer.keys[row, :, :n].to(dtype, copy=True) for layer in layers],
            [layer.values[row, :, :n].to(dtype, copy=True) for layer in layers],
            features,
        )
        if entry.nbytes > self.budget:
            return
        self._serial += 1
        self.entries[self._serial] = entry
        self.held += entry.nbytes
        while self.held > self.budget:
            self._drop(next(iter(self.entries)))

    @torch.inference_mode()
    def load(self, cache: SlotCache, row: int, ids: Sequence[int], have: int = 0) -> int:
        """Copy the longest stored prefix of `ids` (all but its last token at most) into row
        `row`, whose capacity must hold it, if it is longer than the `have` slots the row holds
        already; returns the row's length (`have` when nothing longer is stored)."""
        if not self.entries:
            return have
        ids = list(ids)
        best, shared = None, max(have, self.least - 1)
        for key, entry in self.entries.items():
            if entry.ids[: self.least] != ids[: self.least]:
                continue
            common = min(common_prefix(entry.ids, ids), len(ids) - 1)
            if common > shared:
                best, shared = key, common
        if best is None:
            return have
        entry = self.entries[best]
        self.entries.move_to_end(best)
        kvcache.write_prefix(cache, row, entry.keys, entry.values, shared, entry.features)
        self.loaded_tokens += shared - have
        return shared

    def clear(self) -> None:
        self.entries.clear()
        self.held = 0

    def _drop(self, key: int) -> None:
        self.held -= self.entries.pop(key).nbytes
