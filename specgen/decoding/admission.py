"""Admission: requests joining and leaving the engine's batch, and the loop that runs them.

`Engine.drive` (this module's `Admission`, which `Engine` inherits) is the one loop: between
rounds, dropped rows are cancelled, finished rows leave (`_leave`), and requests from the feed
join while there is room (`_admit`, `_join`): a joining row is prefilled (from what the prefix
store holds of its prompt), continues a row the previous generation parked (a chat turn), or
takes a long prompt prefilled a chunk per round (staging.py); then `Engine._round` serves every
row. Before a generation the cache keeps only the row it resumes, or one spare row whose
buffers the first joining row reuses (`_settle`).

`Admission` holds no state of its own: the engine's cache, drafter, prefix store, policy,
parked rows and spare flag are `Engine`'s, and so are the round (`_round`), a row's report
(`_report`, `_event`), the commit of a first token (`_commit`) and the eager forward
(`_forward`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Union

import torch

from specgen.config import GenerationConfig
from specgen.decoding import floor, verify
from specgen.decoding.drafters.base import EMPTY
from specgen.decoding.events import Event, Finished, Joined, RoundResult, StopReason
from specgen.decoding.feed import Feed, Request
from specgen.decoding.rows import DecodeState
from specgen.decoding.sampling import make_generator
from specgen.decoding.staging import Staged, advance, stage
from specgen.runtime import kvcache
from specgen.text import common_prefix


class Fresh:
    """A joining row prefilled here, from what the prefix store holds of its prompt."""


FRESH = Fresh()
# where a joining row's K/V comes from: a prefill here, the parked row of the previous generation
# that it continues (a chat turn: the state it resumes), or a prompt prefilled a chunk per round
Origin = Union[Fresh, DecodeState, Staged]


@dataclass(frozen=True)
class RowEvent:
    """One event of one row of a batch; `index` is the prompt's position in the input."""

    index: int
    event: Event
    elapsed: float  # seconds since the row's prefill started
    state: DecodeState


class Admission:
    """The engine's admission of requests and the loop that runs its rounds; a mixin of `Engine`,
    whose state and round it uses (the module's docstring says which)."""

    def drive(
        self, feed: Feed, batch_size: int = 1, resume: DecodeState | Fresh = FRESH
    ) -> Iterator[RowEvent]:
        """The loop: rows join from `feed` while there is room, every round serves every row,
        finished and dropped rows leave. `resume` continues the first request's row (see
        `generate`). A request's prompt must fit the context (`check` it before it is fed)."""
        self.threads.start()  # on the thread that runs the forwards (a server's engine thread)
        resumed = any(resume is state for state in self.parked)  # still in the cache: continued
        self._settle(resume if resumed else FRESH)
        if resumed:
            resume.row = 0  # the only row left
        rows: list[DecodeState] = []
        staged: list[Staged] = []  # long prompts prefilled a chunk per round (staging.py), oldest first
        try:
            while True:
                gone = feed.dropped()
                for state in rows:
                    if state.index in gone:
                        state.stop = StopReason.CANCELLED
                for waiting in [s for s in staged if s.request.index in gone]:
                    staged.remove(waiting)
                    yield from self._cancelled(waiting.request)
                rows = yield from self._leave(rows)
                decoding = bool(rows)  # rows that joined earlier and run rounds: long prompts are staged
                requests = feed.take(batch_size - len(rows) - len(staged))
                while requests:
                    for request in requests:
                        if (
                            decoding
                            and self.prefill_chunk
                            and not request.config.deterministic
                            and len(request.ids) > self.prefill_chunk
                            and not request.prompt_logprobs
                        ):
                            staged.append(stage(self.model, request, self.prefixes, self.drafter.taps()))
                            continue
                        yield from self._admit(rows, request, resume if resumed else FRESH)
                        resumed = False
                    # requests that came while those prefilled join before the round, not a round later
                    requests = feed.take(batch_size - len(rows) - len(staged))
                if staged:  # a chunk of the oldest staged prompt; all of it when no row decodes
                    advance(
                        self.steps.call,
                        staged[0],
                        self.prefill_chunk if rows else len(staged[0].request.ids),
                        self.device,
                        self.steps.mode == "inductor",
                    )
                    if staged[0].done:
                        yield from self._admit(rows, staged[0].request, staged.pop(0))
                joined = bool(rows)
                rows = yield from self._leave(rows)  # a first token may have ended a row
                if not rows:
                    if joined or staged:
                        continue  # every row ended at its first token: take the next requests
                    return
                for state, result in zip(rows, self._round(rows)):
                    yield from self._report(state, result)
                rows = yield from self._leave(rows)
        except BaseException:  # Ctrl-C, or the caller stopped early: the rows stay resumable (a
            self.parked = rows  # resume crops each to the prefix it shares with its next prompt)
            raise

    def _admit(self, rows: list[DecodeState], request: Request, origin: Origin) -> Iterator[RowEvent]:
        """A request joins the batch (`_join`): its Joined event, and its first token if any. The
        first row of a fresh batch (not a resumed one) settles the cache before it: the rows the
        last round parked leave, one spare row stays (a staged prompt whose company all ended
        while it was fed joined beside them, and the next round's mask had a row too many)."""
        if not rows and not isinstance(origin, DecodeState):
            self._settle(FRESH)
        state, first = self._join(request, origin)
        rows.append(state)
        self.plain.start(state.floor, state.config.method, len(rows))
        joined = Joined(
            len(request.ids),
            state.reused_tokens,
            state.prefill_seconds,
            state.prompt_logprobs,
            declined=self.drafter.declines(state.row),
        )
        yield self._event(state, joined)
        if first is not None:
            yield from self._report(state, first)

    def _cancelled(self, request: Request) -> Iterator[RowEvent]:
        """A staged request whose client left before it joined: its events, with nothing made."""
        state = DecodeState(
            list(request.ids), self.cache, len(request.ids), request.config, index=request.index
        )
        yield self._event(state, Joined(len(request.ids), 0, 0.0))
        yield self._event(state, Finished(StopReason.CANCELLED))

    def _leave(self, rows: list[DecodeState]) -> Iterator[RowEvent]:
        """Finished rows leave (an event each); the rows left are renumbered. When every row
        finished, they stay in the cache: the next generation resumes or reuses one."""
        done = [state for state in rows if state.stop is not None]
        for state in done:
            self.plain.keep(state.floor, state.config.method, len(rows))
            self.prefixes.save(self.cache, state.row, state.ids)
            self.drafter.finished(state.row, state.ids)
            yield self._event(state, Finished(state.stop))
        if not done:
            return rows
        keep = [i for i, state in enumerate(rows) if state.stop is None]
        if keep:
            self._select(keep)
            for row, i in enumerate(keep):
                rows[i].row = row
        else:
            self.parked = done  # still in the cache, in their rows: the next generation may resume one
        return [rows[i] for i in keep]

    # -- a row joining ------------------------------------------------------------------------
    def _settle(self, origin: DecodeState | Fresh) -> None:
        """Before a generation: keep only the row it resumes, or for a fresh one one spare row
        whose buffers (and captured graphs) the first joining row reuses."""
        resumed = isinstance(origin, DecodeState)
        self._select([origin.row] if resumed else list(range(min(self.cache.rows, 1))))
        self._spare = not resumed and self.cache.rows == 1
        self.parked = []

    def _select(self, keep: list[int]) -> None:
        self.cache.select(keep)
        self.drafter.leave(keep)

    @torch.inference_mode()
    def _join(self, request: Request, origin: Origin) -> tuple[DecodeState, RoundResult | None]:
        """Prefill a joining row (or take a staged prompt's prefill, or continue a parked row);
        its first token too when the prompt is longer than `policy.prompt_catch_up` tokens
        (PROMPT_CATCH_UP), whatever the caches held of it."""
        staged = isinstance(origin, Staged)  # fed whole (its last token too) in its own cache
        started = origin.started if staged else time.perf_counter()
        cache, prompt = self.cache, request.ids
        if isinstance(origin, DecodeState):  # a chat turn: the caches keep what both sequences share
            state, row = origin, origin.row
            common = common_prefix(state.ids, prompt)
            keep = (
                0 if request.prompt_logprobs else min(common, len(prompt) - 1, cache.lengths[row])
            )  # 0: all logits
            state.ids = state.ids[: keep + 1]  # consistent with the cache even if Ctrl-C lands below
            state.prompt_logprobs = ()  # the previous generation's
        else:
            row = 0 if self._spare else cache.add_row()
            common = keep = 0
            state = DecodeState(list(prompt), cache, len(prompt), request.config, row=row)
        self._spare = False
        kvcache.set_length(cache, row, keep)
        config = request.config
        capacity = self._capacity(len(prompt), request.max_new_tokens, config)
        cache.reserve(capacity)
        if staged:
            kvcache.copy_prefix(origin.cache, 0, cache, row, len(prompt))
            keep, logits = origin.keep, origin.logits
        elif not config.deterministic and not request.prompt_logprobs:
            keep = self.prefixes.load(cache, row, prompt, have=keep)
        first = (
            staged or len(prompt) > self.policy.prompt_catch_up
        )  # the prompt's, not the caches': seeds replay
        if not staged and (first or len(prompt) - 1 > keep):
            whole = request.prompt_logprobs and keep == 0  # every position's logits: the prompt's own
            logits = self._forward(
                torch.tensor([prompt[keep:] if first else prompt[keep:-1]], device=self.device),
                keep=0 if whole else 1,
                row=row,
            )
            if whole:
                state.prompt_logprobs = tuple(
                    verify.token_logprobs(
                        logits[0, : len(prompt) - 1, : self.vocab],
                        prompt[1:],
                        max(request.sampling.logprobs or 0, request.prompt_top),
                        rank=True,
                    )
                )
        if len(prompt) - 1 > keep:
            self.prefixes.save(cache, row, prompt)  # requests arriving meanwhile need not wait for its end
        # one random stream for the row's draft and its verdicts
        state.generator = None if request.sampling.greedy else make_generator(request.seed, self.device)
        self.drafter.rewind(row, common)
        self.drafter.join(row, prompt, state.generator, capacity, config)
        ceiling = floor.first_ceiling(config, self.verify_cost)
        state.begin(request, keep, started, self.context_length, self.draft_cost(config.method), ceiling)
        state.stop_ids = (frozenset() if request.ignore_eos else self.stop_ids) | request.stop_ids
        result = self._first_token(state, logits) if first else None
        state.prefill_seconds = time.perf_counter() - started
        return state, result

    def _first_token(self, state: DecodeState, logits: torch.Tensor) -> RoundResult:
        """The row's first token from its prefill's last logits, chosen as a round that proposed
        nothing would choose it (the same rule, the row's random stream), and committed."""
        root, logits = torch.tensor(state.ids[-1:], device=self.device), logits[:, -1:]
        result = verify.accept([state], [EMPTY], logits, [root], self.vocab)[0]
        reported = verify.logprobs([state], logits, [result], self.vocab)[0]
        return self._commit(state, EMPTY, result, 0.0, 0.0, reported)

    def _capacity(self, prompt_length: int, max_new_tokens: int, config: GenerationConfig) -> int:
        """Slots a row may reach: the whole generation plus one round's headroom (caches are
        preallocated for it, so fixed-shape steps keep their shapes)."""
        return min(prompt_length + max_new_tokens, self.context_length) + self.headroom(config)

    @staticmethod
    def headroom(config: GenerationConfig) -> int:
        """Slots a round may write past the committed sequence (draft window or tree)."""
        return (
            max(
                config.round_tokens,
                config.tree_budget + 1,
                config.verify_window if config.deterministic else 0,
            )
            + 2
        )
