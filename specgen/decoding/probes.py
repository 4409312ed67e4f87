"""Timed forwards: what `costs.choose` and the server's width caps (`widths.py`) measure.

Each probe runs one kind of forward the decode loop runs, over a cached context of about a
request's length, and times it on demand. `ratios` times a pair's forwards in turn against the
target's step: a machine whose speed drifts between forwards (shared CPUs do) then moves them
all together, and the medians of the per-turn ratios are what the costs are made of.
"""

from __future__ import annotations

import statistics
import time

import torch

from specgen.models.eagle_head import Eagle3Head, HeadStep
from specgen.models.vocabulary import Vocabulary
from specgen.runtime import kvcache
from specgen.runtime.lean import call_for

REPEATS = 7  # turns of the timed forwards
READ = 64  # prompt tokens of the draft's read that `ratios` times (against a target step, in turn)
# the widest verify `ratios` times: a default RSD-S tree's (12 nodes and the root). On a 2-core
# CPU a verify costs about what a plain step does up to 6-7 tokens, then about 0.08 of a step more
# a token (Zen 4: 7 tokens 1.1 steps, 9 1.3, 13 1.5), where the cost at 2 and 5 tokens alone
# priced a 13-token tree's verify at 1.2 steps, and the floor read a tree's rounds 23% too fast
WIDE = 13
# the cached tokens the forwards are timed over: about a prompt and answer of the prompt sets
# (50-350 prompt tokens, 64-128 new). A verify's cost grows with the context faster than a
# step's: on a 2-core AVX2 EPYC a 5-token verify cost 1.01-1.12 steps over 32 tokens, 1.13-1.31 over 160-200
# (benchmarks/verify_context.py). Priced at 32 tokens, the plain step the floor implies from a
# verify's seconds read 6-10% dear on a German translation, and so did its rounds' speed-up.
CONTEXT = 200


class Probe:
    """One model's forward of `width` tokens per row over `rows` short cached contexts, timed on
    demand; `keep` logits per row, as the loop asks (a verify reads every position's)."""

    def __init__(
        self, model, width: int, context: int = 32, exact: bool = True, rows: int = 1, keep: int = 1
    ):
        self.call = call_for(model, exact)  # what the decode loop calls
        self.device = next(model.parameters()).device
        vocab = model.get_input_embeddings().num_embeddings
        self.cache, self.context, self.keep = kvcache.new_cache(model, rows=rows), context, keep
        prompt = (torch.arange(100, 100 + context, device=self.device) % vocab)[None].expand(rows, context)
        kvcache.forward(self.call, self.cache, prompt, keep=1)
        self.tokens = (torch.arange(300, 300 + width, device=self.device) % vocab)[None].expand(rows, width)
        self.seconds()  # the first forward warms up

    def seconds(self) -> float:
        started = time.perf_counter()
        self._forward()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - started
        kvcache.crop(self.cache, self.context)
        return elapsed

    def _forward(self) -> None:
        kvcache.forward(self.call, self.cache, self.tokens, keep=self.keep)


class HeadProbe(Probe):
    """An EAGLE-3 head's draft step, timed on demand: one token reading the head's own output at
    the position before, over `context` positions fed from (zero) target features, as every
    draft step after a round's first is (drafters/eagle.py)."""

    def __init__(self, head: Eagle3Head, context: int = 32):
        self.step = HeadStep(head, widest=0)  # eager: features as given
        self.call = call_for(self.step)
        self.device = head.d2t.device
        self.cache, self.context, self.keep = kvcache.SlotCache(head.cache_config, rows=1), context, 1
        self.cache.reserve(context + 1)
        vocab, size = head.config.draft_vocab_size, head.config.hidden_size
        prompt = (torch.arange(100, 100 + context, device=self.device) % vocab)[None]
        self.step.feed(torch.zeros(1, context, len(head.config.layers) * size, device=self.device))
        kvcache.forward(self.call, self.cache, prompt, keep=1)
        self.tokens = torch.tensor([[300 % vocab]], device=self.device)
        self.outputs = torch.zeros(1, 1, size, device=self.device)
        self.seconds()  # the first forward warms up

    def _forward(self) -> None:
        self.step.feed(self.outputs)
        kvcache.forward(self.call, self.cache, self.tokens, keep=1)


def ratios(pair, repeats: int = REPEATS) -> tuple[float, float, float, float, float, float]:
    """(draft step, verifies of 2, 3, 5 and WIDE tokens, a prompt token of the draft's read) in
    target steps: the forwards are timed in turn, `repeats` times, and the medians of the
    per-turn ratios are kept (see the module). A head's draft step is its own (HeadProbe); the
    read (the draft's forward over READ prompt tokens, per token) is timed for a draft model on
    the CPU only (0 elsewhere: a GPU reads a prompt cheaply, and a head reads the target's
    features of a prompt, which the target wrote anyway)."""
    head = pair.draft.vocabulary is Vocabulary.HEAD
    context = min(CONTEXT, pair.target.context_length // 2)
    if not head:
        context = min(context, pair.draft.context_length // 2)
    step = Probe(pair.target.model, 1, context=context)
    # a verify reads every position's logits (verify.forward), so its probe does too: with the
    # last position's only, a 5-token verify read 5% cheaper than the loop's (AVX2 EPYC)
    pair_of, three_of, five_of, wide_of = (
        Probe(pair.target.model, width, context=context, keep=0) for width in (2, 3, 5, WIDE)
    )
    if head:
        draft = HeadProbe(pair.draft.model, context=context)
    else:
        draft = Probe(pair.draft.model, 1, context=context, exact=False)
    read = None
    if not head and pair.draft.device.type == "cpu":
        read = Probe(pair.draft.model, READ, exact=False)
    series: tuple[list[float], ...] = ([], [], [], [], [], [])
    verifies = (pair_of, three_of, five_of, wide_of)
    for _ in range(repeats):
        one = step.seconds()
        two, three, five, wide = (probe.seconds() for probe in verifies)
        small = draft.seconds()
        prompt = read.seconds() / READ if read is not None else 0.0
        one = (one + step.seconds()) / 2  # the target step around the others
        for values, seconds in zip(series, (small, two, three, five, wide, prompt)):
            values.append(seconds / one)
    return tuple(statistics.median(values) for values in series)
