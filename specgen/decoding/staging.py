"""A long prompt's prefill in chunks between the running rows' rounds (chunked prefill).

A prompt that joins a batch whose rows are decoding used to be prefilled whole before the next
round: every running stream stalled for as long as that took, seconds per thousand tokens on a
CPU. A prompt of more than `Engine.prefill_chunk` tokens joining rows that decode is instead
`Staged`: prefilled in a one-row cache of its own, one chunk per round of the others; when its
last chunk is fed, its K/V moves into a row of the batch (a memory copy, `kvcache.copy_prefix`)
and it joins with its first token from that chunk's logits, as a whole prefill gives it. The
running rows' streams then pause for a chunk at a time, and the staged prompt's first token
comes a few rounds later than a whole prefill would give it.

A K/V slot depends only on the tokens up to it, so chunks give the prefill's K/V (up to float
rounding of other shapes). Deterministic mode, whose output depends on the request alone, and a
batch with no row decoding prefill whole, as before. On a GPU the whole prefill of a long prompt
takes milliseconds, and the engine does not stage (`PREFILL_CHUNK`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specgen.decoding.feed import Request
from specgen.runtime import kvcache
from specgen.runtime.prefixes import PrefixStore

# tokens of a staged prompt fed per round of the running rows on a CPU: on the 2-core Zen 4 VM
# about 2.5 s of the default pair's target (benchmarks/server.md, "Chunked prefill")
PREFILL_CHUNK = 256


@dataclass
class Staged:
    """A prompt being prefilled in its own cache; `logits` once its last token is fed."""

    request: Request
    cache: kvcache.SlotCache
    keep: int  # tokens the prefix store gave it
    started: float = field(default_factory=time.perf_counter)
    logits: torch.Tensor | None = None  # [1, 1, V] after the last token

    @property
    def done(self) -> bool:
        return self.logits is not None


def stage(model, request: Request, prefixes: PrefixStore, taps: tuple[int, ...] = ()) -> Staged:
    """A one-row cache for the prompt (keeping the features of `taps`, as the batch's cache
    does), starting from what the prefix store holds of it."""
    cache = kvcache.new_cache(model, taps=taps)
    cache.reserve(len(request.ids))
    return Staged(request, cache, prefixes.load(cache, 0, request.ids))


@torch.inference_mode()
def advance(call, staged: Staged, budget: int, device, full_view: bool = False) -> None:
    """Feed the next `budget` tokens of the staged prompt (fewer at its end)."""
    ids, start = staged.request.ids, staged.cache.lengths[0]
    end = min(len(ids), start + budget)
    logits = kvcache.forward(
        call, staged.cache, torch.tensor([ids[start:end]], device=device), keep=1, full_view=full_view
    )
    if end == len(ids):
        staged.logits = logits
