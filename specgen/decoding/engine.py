"""The round loop: draft, verify, accept, commit. Knows nothing about rendering or text.

One engine, batch-first: a single prompt is a batch of one row. Every round, for every active
row: (1) the drafter proposes (a chain, a tree, or nothing); (2) the target scores every row's
[root, proposal] in ONE forward (verify.py); (3) each row's acceptance rule keeps a path plus
one target token; (4) the commit sets each row's cache length (a chain) or gathers the accepted
path into place (a tree) and tells the drafter what was kept. In deterministic mode a row
whose window is full is then replayed at a fixed shape (replay.py), which decides what is
final. Rows join and leave between rounds (dynamic batching: admission.py, whose `drive` is the
loop that calls `_round`); a joining row's prefill gives its first token when the prompt is
longer than a draft's catch-up (PROMPT_CATCH_UP), cached or not; a long prompt joining rows that
decode is prefilled a chunk per round of theirs (staging.py).

The target cache lives as long as the engine: when a generation ends its last rows stay, so
the next generation can resume a row (a chat turn keeps the longest common prefix of both
caches) or reuse its buffers (captured CUDA graphs stay valid). A row's K/V goes to the
target's prefix store (its prompt once prefilled, its sequence once finished), and a joining row
copies the longest prefix stored there instead of prefilling it (runtime/prefixes.py; not in
deterministic mode). Each row reports a Joined event, its rounds (RoundResult) and replays
(ReplayResult), then Finished; one host sync per round reads every row's verdict. How rounds are
scheduled (width caps, how many rows draft with the draft model together, prefill chunks) is the
`Policy` the engine is built with; how much each row drafts, its floor (floor.py).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Iterator

import torch

from specgen.config import GenerationConfig, Method
from specgen.decoding import verify
from specgen.decoding.admission import FRESH, Admission, Fresh, RowEvent
from specgen.decoding.costs import VerifyCost
from specgen.decoding.drafters.base import EMPTY, Drafter, NoDrafter, Proposal
from specgen.decoding.drafters.mixed import drafting_key
from specgen.decoding.events import ReplayResult, RoundResult, StopReason
from specgen.decoding.feed import ListFeed
from specgen.decoding.floor import NoFloor, PlainSteps
from specgen.decoding.policy import DRAFT_COST, Policy, capped
from specgen.decoding.replay import replay_tokens, window_start
from specgen.decoding.rows import DecodeState
from specgen.errors import PromptError
from specgen.runtime import kvcache
from specgen.runtime.compiled import Steps
from specgen.runtime.prefixes import PrefixStore
from specgen.runtime.threads import Threads


class Engine(Admission):
    """Runs plain or speculative decoding of `target_model` over one or many rows; rows join and
    leave through `Admission` (admission.py: `drive`, the loop), and each round is `_round`."""

    def __init__(
        self,
        target_model,
        device: torch.device,
        stop_ids: frozenset[int],
        context_length: int,
        drafter: Drafter | None = None,
        vocab: int | None = None,
        compile: str = "off",
        after: "Engine | None" = None,
        prefixes: PrefixStore | None = None,
        policy: Policy = Policy(),
        draft_cost: Callable[[Method], float] = lambda method: DRAFT_COST,
        verify_cost: VerifyCost | None = None,
        threads: int | None = None,
    ):
        self.model = target_model
        self.vocab = vocab  # the shared vocabulary when the draft head is padded differently
        self.device = device
        self.stop_ids = stop_ids
        self.context_length = context_length
        self.drafter: Drafter = drafter if drafter is not None else NoDrafter()
        self.steps = Steps(target_model, compile)  # the target's forwards, fixed widths captured
        # the target cache, kept across generations; `after`: an engine this one replaces (chat's new
        # drafter), whose cache and parked rows it takes over, so the target keeps what it holds
        self.cache = (
            after.cache
            if after is not None
            else kvcache.SlotCache(target_model.config, rows=0, taps=self.drafter.taps())
        )
        if after is not None and self.cache.tapped != tuple(
            self.drafter.taps()
        ):  # chat's new method reads others
            self.cache.retap(self.drafter.taps())
        self.parked: list[DecodeState] = (
            after.parked if after is not None else []
        )  # rows the last generation left
        self._spare = False  # row 0 holds a finished row that the next join may take
        self.prefixes = prefixes if prefixes is not None else PrefixStore(budget=0)
        self.policy = policy
        self.draft_cost = draft_cost  # one draft token of a method against a target step (build.TABLE)
        self.verify_cost = verify_cost  # a verify in plain steps by the tokens proposed, where measured
        # the forwards' thread count: fixed, or fitted to the cores other processes leave free
        self.threads = Threads(threads if device.type == "cpu" else torch.get_num_threads())
        # plain rounds' seconds per batch width, for the rows' floors (floor.py): kept across
        # generations (a chat's turns, a server's requests), and by an engine that replaces this one
        self.plain = after.plain if after is not None else PlainSteps()
        self.widened = self.drafter.widened()  # the drafter's count as the rows' floors last measured it

    @property
    def prefill_chunk(self) -> int:
        """The policy's prefill chunk on a CPU; 0 on a GPU, which prefills whole. Read-only: the
        policy is given when the engine is built."""
        return self.policy.prefill_chunk if self.device.type == "cpu" else 0

    # -- a generation (its loop, `drive`, is admission.py's) --------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        config: GenerationConfig,
        batch_size: int = 1,
        resume: DecodeState | Fresh = FRESH,
    ) -> Iterator[RowEvent]:
        """Decode every prompt, `batch_size` rows at a time; rows join as others finish.

        With `resume` a DecodeState (this engine's of a previous generation, one prompt) the caches
        keep the longest common prefix of the old and the new sequence, so a chat turn
        prefills only its new tokens. Yields each row's events as they happen; `index` is the
        prompt's position in `prompts`.
        """
        for i, prompt in enumerate(prompts):
            self.check_prompt(prompt, "the prompt" if len(prompts) == 1 else f"prompt {i + 1}")
        if isinstance(resume, DecodeState) and len(prompts) != 1:
            raise ValueError("resume continues one prompt")
        yield from self.drive(ListFeed.of(prompts, config), batch_size, resume)

    def _report(self, state: DecodeState, result: RoundResult) -> Iterator[RowEvent]:
        """A row's result, and the replay of its window when that result filled it."""
        yield self._event(state, result)
        replay = self._close_window(state, result)
        if replay is not None:
            yield self._event(state, replay)

    def setup_seconds(self) -> float:
        """Seconds spent so far capturing (and compiling) fixed-shape steps, target and draft."""
        return self.steps.setup_seconds + self.drafter.setup_seconds()

    # -- one round for every row ----------------------------------------------------------------
    @torch.inference_mode()
    def _round(self, rows: list[DecodeState]) -> list[RoundResult]:
        """Draft, verify (one forward for all rows), accept and commit; one result per row."""
        self.threads.tick()
        started = time.perf_counter()
        # the roots go to the device now, while it is idle: copied after the draft steps were
        # queued, a host list would wait for all of them
        roots = torch.tensor([[state.ids[-1]] for state in rows], device=self.device)
        width, cap = len(rows), self.policy.width_cap
        # a plain round to measure the width's, where a row asks for it and no row's draft length is
        # the user's (N is N: a seeded sampled row's draws depend on it)
        unsure = any(state.floor.unsure for state in rows) and not any(
            isinstance(s.floor, NoFloor) and s.config.method is not Method.PLAIN for s in rows
        )
        if self.plain.explore(width, unsure):
            ks = [0] * width
        else:
            ks = [state.capped(state.wanted(), cap(width, state.config)) for state in rows]
            self._company(rows, ks)
        if any(ks):
            features = self.cache.features if self.cache.taps else None  # an EAGLE head's input
            proposals = self.drafter.propose(
                [state.ids for state in rows], ks, [s.sampling for s in rows], features
            )
            widened = self.drafter.widened()
            if widened != self.widened:  # the draft proposes ids it could not: lowered floors start afresh
                self.widened = widened
                for state in rows:
                    state.floor.renew()
        else:
            proposals = [EMPTY] * len(rows)
        drafted = time.perf_counter()
        inputs = verify.inputs(proposals, roots)
        logits = verify.forward(self.steps, self.cache, proposals, inputs)
        judged = verify.accept(rows, proposals, logits, inputs, self.vocab)
        reported = verify.logprobs(rows, logits, judged, self.vocab)
        verified = time.perf_counter()
        results = [
            self._commit(state, proposal, result, drafted - started, verified - drafted, lp)
            for state, proposal, result, lp in zip(rows, proposals, judged, reported)
        ]
        seconds = time.perf_counter() - started
        self.plain.measure(rows, ks, proposals, results, seconds, verified - drafted, self.verify_cost)
        return results

    def _company(self, rows: list[DecodeState], ks: list[int]) -> None:
        """Rows that would draft with the draft model this round, but too few of them share its
        step to repay what it costs the batch's other rows, who wait through it
        (Policy.together): they run a plain round (their k set to 0). Rows share a step where
        they share a drafter (`drafting_key`: chain and lookup-chain rows, or trees of other
        shapes, each take steps of their own)."""
        groups: dict[tuple, list[int]] = {}
        for i, (k, state) in enumerate(zip(ks, rows)):
            if k and capped(state.config):
                groups.setdefault(drafting_key(state.config), []).append(i)
        for group in groups.values():
            if not self.policy.together(len(rows), len(group)):
                for i in group:
                    ks[i] = 0

    def _commit(
        self,
        state: DecodeState,
        proposal: Proposal,
        result: RoundResult,
        draft_seconds: float,
        verify_seconds: float,
        logprobs: list | None = None,
    ) -> RoundResult:
        """Append the committed tokens of the round's `result` (with their `logprobs` when the
        row asked for them); both caches keep everything but the new last token."""
        config = state.config
        remaining = state.limit() - len(state.ids)
        path = result.path
        if not proposal.is_chain:  # the accepted path's K/V into contiguous slots
            kvcache.keep_positions(
                state.cache, len(state.ids) - 1, torch.tensor([0, *path], device=self.device), row=state.row
            )
        elif proposal.size:
            state.length.update(proposal.size, result.accepted)  # before any cut
        emitted, stop = self._cut(
            [result.draft_tokens[node - 1] for node in path] + [result.target_token],
            remaining,
            state.stop_ids,
        )
        state.ids.extend(emitted)
        kvcache.set_length(state.cache, state.row, len(state.ids) - 1)
        if proposal.size:
            self.drafter.observe(state.row, list(path[: len(emitted) - 1]))
        if stop is None and not config.deterministic and len(state.ids) - state.prompt_length >= state.budget:
            stop = StopReason.CONTEXT if state.context_bound else StopReason.LENGTH
        if not config.deterministic:
            state.stop = stop
        return replace(
            result,
            emitted=emitted,
            draft_seconds=draft_seconds,
            verify_seconds=verify_seconds,
            stop=stop,
            logprobs=tuple(logprobs or ())[: len(emitted)],
        )

    # -- deterministic mode -----------------------------------------------------------------
    def _close_window(self, state: DecodeState, result: RoundResult) -> ReplayResult | None:
        """In deterministic mode, replay the row's window once it is full or the row stopped."""
        config = state.config
        if not config.deterministic:
            return None
        start = window_start(state.verified, state.prompt_length, config.verify_window)
        if (
            len(state.ids) < min(start + config.verify_window, state.prompt_length + state.budget)
            and result.stop is None
        ):
            return None
        replay = self._replay(state, start)
        stop = None
        if state.ids[state.verified - 1] in state.stop_ids and state.verified > state.prompt_length:
            stop = StopReason.EOS
        elif state.verified - state.prompt_length >= state.budget:
            stop = StopReason.CONTEXT if state.context_bound else StopReason.LENGTH
        state.stop = stop
        return replace(replay, stop=stop)

    @torch.inference_mode()
    def _replay(self, state: DecodeState, start: int) -> ReplayResult:
        """Replay the window at `start` at the fixed shape (1, N); keep the matching prefix."""
        started = time.perf_counter()
        window, verified = state.config.verify_window, state.verified
        kvcache.set_length(state.cache, state.row, start - 1)

        def forward(cache, ids):  # the same eager path for a row alone and a row of a batch
            return self._forward(ids, row=state.row)

        replayed = replay_tokens(
            forward,
            state.cache,
            state.ids,
            start,
            window,
            state.sampling,
            self.device,
            state.ids[start - 1],
            self.vocab,
        )
        ids = state.ids
        # at most N host comparisons of token ids per replay (never a loop over the vocabulary)
        mismatch = next((p for p in range(verified, len(ids)) if ids[p] != replayed[p - start]), None)
        rolled_back, correction = (), None
        checked = (mismatch + 1 if mismatch is not None else len(ids)) - verified
        if mismatch is not None:
            rolled_back, correction = tuple(ids[mismatch:]), replayed[mismatch - start]
            del ids[mismatch:]
            ids.append(correction)
            self.drafter.rewind(state.row, mismatch)
        kvcache.set_length(state.cache, state.row, len(ids) - 1)  # keep the replay's KV of verified tokens
        state.verified = len(ids)
        return ReplayResult(start, checked, rolled_back, correction, len(ids), time.perf_counter() - started)

    # -- helpers ------------------------------------------------------------------------------
    def _event(self, state: DecodeState, event) -> RowEvent:
        return RowEvent(state.index, event, time.perf_counter() - state.started, state)

    def check_prompt(self, prompt_ids: list[int], what: str) -> None:
        """A prompt this engine can decode (not empty, shorter than the context), or a PromptError naming
        `what`."""
        if not prompt_ids:
            raise PromptError(f"{what} is empty")
        if len(prompt_ids) >= self.context_length:
            raise PromptError(
                f"{what} has {len(prompt_ids)} tokens but the context holds {self.context_length}; shorten it"
            )

    def _forward(self, input_ids: torch.Tensor, keep: int = 0, row: int = 0) -> torch.Tensor:
        """An eager forward of any length (prefills, replays) on one row's own slots."""
        rows = slice(row, row + 1) if self.cache.rows > 1 else None
        return kvcache.forward(
            self.steps.call,
            self.cache,
            input_ids,
            keep=keep,
            rows=rows,
            full_view=self.steps.mode == "inductor",
        )

    @staticmethod
    def _cut(emitted: list[int], remaining: int, stop_ids: frozenset[int]) -> tuple[list[int], str | None]:
        for i, token in enumerate(emitted[:remaining]):
            if token in stop_ids:
                return emitted[: i + 1], StopReason.EOS
        return emitted[:remaining], None
