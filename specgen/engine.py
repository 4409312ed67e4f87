"""The round loop: draft, verify, accept, commit. Knows nothing about rendering or text.

One engine, batch-first: a single prompt is a batch of one row. Every round, for every active
row: the drafters propose (a chain x1..xk, a tree, or nothing for plain decoding); the target
scores every row's [root, proposal] in ONE forward (root = the row's last committed token, not
yet in the cache; a row's tree mask says what each of its nodes sees; shorter rows are padded
with nodes that see only the cache and themselves); each row's acceptance rule keeps a path
plus one target token; the commit sets each row's cache length (a chain) or gathers the
accepted path into place (a tree), and tells the drafters what was kept. In deterministic mode
a row whose window is full is then replayed at a fixed shape (replay.py), which decides what
is final. Rows join and leave between rounds (dynamic batching).

Each round is reported per row as a RoundResult (and a ReplayResult after a replay); the
host syncs per round are the reads of the verdicts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch

from specgen import kvcache
from specgen.acceptance import (Rule, greedy_tree, recursive_rejection, select_rule,
                                speculative_sampling)
from specgen.adaptive import make_policy
from specgen.compiled import Steps
from specgen.config import GenerationConfig, Method
from specgen.errors import PromptError
from specgen.replay import ReplayResult, keyed_choice, replay_tokens, window_start
from specgen.row_drafters import PerRow, RowDrafters
from specgen.sampling import make_generator, sample, warp
from specgen.text import common_prefix


class StopReason:
    EOS = "eos"
    LENGTH = "length"
    CONTEXT = "context"


@dataclass(frozen=True)
class TreeInfo:
    """A tree round's shape in host ids, for --show-tree and statistics."""

    tokens: list[int]  # node tokens, index 0 the root
    parents: tuple[int, ...]
    accepted_nodes: list[int]  # the accepted path, root excluded
    tried: list[int]  # nodes tried and rejected


@dataclass(frozen=True)
class RoundResult:
    """What one round did for one row, in token ids. `emitted` is what was committed."""

    draft_tokens: list[int]  # everything the drafter proposed (empty for plain decoding)
    accepted: int  # draft tokens accepted by the target's rule
    target_token: int  # the target's own token (correction or bonus)
    emitted: list[int]  # committed this round: accepted drafts + target token, cut at EOS/length
    draft_seconds: float
    verify_seconds: float
    stop: str | None = None  # a StopReason once generation has ended
    rejected: tuple[int, ...] = ()  # draft tokens tried or discarded this round (shown red)
    tree: TreeInfo | None = None

    @property
    def accepted_emitted(self) -> int:
        """Draft tokens among the emitted ones (fewer than `accepted` when cut at EOS/length)."""
        return min(self.accepted, len(self.emitted))

    @property
    def target_emitted(self) -> bool:
        return len(self.emitted) > self.accepted


@dataclass
class DecodeState:
    """One row: its committed sequence; the cache row holds all of it but the last token."""

    ids: list[int]
    cache: object
    prompt_length: int
    prefill_seconds: float = 0.0
    generator: torch.Generator | None = field(default=None, repr=False)
    reused_tokens: int = 0  # cache positions kept from a previous state by `resume`
    verified: int = 0  # deterministic mode: length of the replay-verified prefix of ids
    length: object = None  # the draft-length policy (adaptive.py), kept across chat turns
    row: int = 0  # this sequence's row in the cache (and in the drafters)
    budget: int = 0  # new tokens allowed (max_new_tokens within the context)
    context_bound: bool = False  # the budget was cut by the context length
    index: int = 0  # the prompt's position in a batch's input
    started: float = field(default_factory=time.perf_counter)
    stop: str | None = None

    def limit(self, config: GenerationConfig) -> int:
        """The length this row's fast path may reach before it must stop (or replay)."""
        end = self.prompt_length + self.budget
        if config.deterministic:
            start = window_start(max(self.verified, self.prompt_length), self.prompt_length,
                                 config.verify_window)
            end = min(end, start + config.verify_window)
        return end


@dataclass(frozen=True)
class RowEvent:
    """A batch's report: a row's round or replay, or (event None) that the row finished."""

    index: int
    event: RoundResult | ReplayResult | None
    elapsed: float  # seconds since the row's prefill started
    state: DecodeState


@dataclass
class _Plan:
    """One row's part of a round, before the verify forward."""

    kind: str  # "plain", "chain" or "tree"
    proposal: object = None
    draft: list[int] = field(default_factory=list)  # host ids (chain)


class Engine:
    """Runs plain or speculative decoding of `target_model` over one or many rows."""

    def __init__(self, target_model, device: torch.device, stop_ids: frozenset[int],
                 context_length: int, drafter=None, vocab: int | None = None, compile: str = "off"):
        self.model = target_model
        self.vocab = vocab  # the shared vocabulary when the draft head is padded differently
        self.device = device
        self.stop_ids = stop_ids
        self.context_length = context_length
        self.drafter = drafter  # the single-row drafter of start/resume/rounds
        self.steps = Steps(target_model, compile)  # the target's forwards, fixed widths captured
        self.cache = None  # the single-row cache, kept across generations (chat reuses it)

    # -- one sequence (a batch of one) --------------------------------------------------------
    @torch.inference_mode()
    def start(self, prompt_ids: list[int], config: GenerationConfig) -> DecodeState:
        self._check_prompt(prompt_ids, "the prompt")
        self._needs_drafter(config)
        started = time.perf_counter()
        if self.cache is None:
            self.cache = kvcache.new_cache(self.model)
        kvcache.crop(self.cache, 0)
        self._reserve(self.cache, len(prompt_ids), config)
        self._prefill(self.cache, 0, prompt_ids)
        if config.method is not Method.PLAIN:
            self.drafter.rewind(0)  # a reused engine: nothing the draft cache holds is known to agree
            self.drafter.begin(prompt_ids)
        state = DecodeState(list(prompt_ids), self.cache, len(prompt_ids), time.perf_counter() - started,
                            self._generator(config, 0), started=started)
        state.length = self._policy(config)
        self._set_budget(state, config)
        return state

    @torch.inference_mode()
    def resume(self, state: DecodeState | None, prompt_ids: list[int], config: GenerationConfig) -> DecodeState:
        """Start from `prompt_ids`, reusing the caches of a previous state where they agree.

        The target cache keeps the longest common prefix of the old and new sequences (so a
        chat turn prefills only its new tokens, and a template that re-renders earlier turns
        differently falls back to re-prefilling from the first differing token).
        """
        if state is None:
            return self.start(prompt_ids, config)
        self._check_prompt(prompt_ids, "the conversation")
        self._needs_drafter(config)
        started = time.perf_counter()
        common = common_prefix(state.ids, prompt_ids)
        keep = min(common, len(prompt_ids) - 1, kvcache.cache_length(state.cache))
        kvcache.crop(state.cache, keep)
        self._reserve(state.cache, len(prompt_ids), config)
        state.ids = state.ids[: keep + 1]  # consistent with the cache even if Ctrl-C lands below
        if len(prompt_ids) - 1 > keep:
            self._forward(torch.tensor([prompt_ids[keep:-1]], device=self.device), state.cache, keep=1)
        if config.method is not Method.PLAIN:
            self.drafter.rewind(common)
            self.drafter.begin(prompt_ids)
        state.ids = list(prompt_ids)
        state.prompt_length = len(prompt_ids)
        state.reused_tokens = keep
        state.verified, state.stop, state.started = 0, None, started
        if state.length is None:
            state.length = self._policy(config)
        state.prefill_seconds = time.perf_counter() - started
        state.generator = self._generator(config, 0)
        self._set_budget(state, config)
        return state

    def rounds(self, state: DecodeState, config: GenerationConfig) -> Iterator[RoundResult | ReplayResult]:
        """Yield rounds until EOS, max_new_tokens or the context limit.

        In deterministic mode, ReplayResults are interleaved: each closes a window of fast
        rounds, may roll tokens back, and only tokens it verified count as final.
        """
        drafts = PerRow([self.drafter]) if config.method is not Method.PLAIN else None
        state.verified = max(state.verified, state.prompt_length)
        while state.stop is None:
            result = self._round([state], config, drafts)[0]
            yield result
            replay = self._close_window(state, config, drafts, result)
            if replay is not None:
                yield replay

    def generate(self, prompt_ids: list[int], config: GenerationConfig) -> Iterator[RoundResult]:
        state = self.start(prompt_ids, config)
        yield from self.rounds(state, config)

    # -- many sequences: dynamic batching ------------------------------------------------------
    def generate_batch(self, prompts: list[list[int]], config: GenerationConfig, batch_size: int,
                       drafts: RowDrafters | None = None) -> Iterator[RowEvent]:
        """Decode every prompt, `batch_size` rows at a time; rows join as others finish.

        Yields each row's rounds and replays as they happen, then a final event (event None)
        when the row finishes; `index` is the prompt's position in `prompts`.
        """
        for i, prompt in enumerate(prompts):
            self._check_prompt(prompt, f"prompt {i + 1}")
        if config.method is not Method.PLAIN and drafts is None:
            raise ValueError(f"method {config.method.value} needs drafters")
        waiting = list(enumerate(prompts))[::-1]
        rows: list[DecodeState] = []
        cache = kvcache.SlotCache(self.model.config, rows=0)
        with torch.inference_mode():
            while rows or waiting:
                while waiting and len(rows) < batch_size:
                    index, prompt = waiting.pop()
                    rows.append(self._join(cache, index, prompt, config, drafts))
                results = self._round(rows, config, drafts)
                for state, result in zip(rows, results):
                    yield RowEvent(state.index, result, time.perf_counter() - state.started, state)
                    replay = self._close_window(state, config, drafts, result)
                    if replay is not None:
                        yield RowEvent(state.index, replay, time.perf_counter() - state.started, state)
                done = [state for state in rows if state.stop is not None]
                for state in done:
                    yield RowEvent(state.index, None, time.perf_counter() - state.started, state)
                if done:
                    keep = [i for i, state in enumerate(rows) if state.stop is None]
                    rows = [rows[i] for i in keep]
                    cache.select(keep)
                    if drafts is not None:
                        drafts.leave(keep)
                    for row, state in enumerate(rows):
                        state.row = row

    def _join(self, cache, index: int, prompt: list[int], config: GenerationConfig, drafts) -> DecodeState:
        started = time.perf_counter()
        row = cache.add_row()
        self._reserve(cache, len(prompt), config, draft=False)
        self._prefill(cache, row, prompt)
        state = DecodeState(list(prompt), cache, len(prompt), 0.0, self._generator(config, index), row=row,
                            index=index, started=started)
        state.length = self._policy(config)
        state.verified = len(prompt)
        self._set_budget(state, config)
        if drafts is not None:
            drafts.join(prompt, state.generator, self._headroom_length(len(prompt), config))
        state.prefill_seconds = time.perf_counter() - started
        return state

    # -- one round for every row ----------------------------------------------------------------
    @torch.inference_mode()
    def _round(self, rows: list[DecodeState], config: GenerationConfig, drafts) -> list[RoundResult]:
        """Draft, verify (one forward for all rows), accept and commit; one result per row."""
        started = time.perf_counter()
        # the roots go to the device now, while it is idle: copied after the draft steps were
        # queued, a host list would wait for all of them
        roots = torch.tensor([[state.ids[-1]] for state in rows], device=self.device)
        plans = self._draft(rows, config, drafts)
        drafted = time.perf_counter()
        logits, inputs = self._verify(rows, plans, roots)
        results = self._accept(rows, plans, logits, inputs, config)
        verified = time.perf_counter()
        out = []
        for state, plan, result in zip(rows, plans, results):
            out.append(self._commit(state, plan, result, config, drafts, drafted - started, verified - drafted))
        return out

    def _draft(self, rows, config: GenerationConfig, drafts) -> list[_Plan]:
        """Each row's proposal: nothing (plain), a chain of up to k tokens, or a tree."""
        ks = []
        for state in rows:
            remaining = state.limit(config) - len(state.ids)
            k = min(state.length.next_k() if state.length else config.round_tokens, remaining - 1)
            if config.method is Method.PLAIN or drafts is None:
                k = 0
            elif config.method.is_tree and remaining <= config.tree_depth:
                k = 0  # too close to the end for a tree
            ks.append(max(k, 0))
        plans = [_Plan("plain") for _ in rows]
        if not any(ks):
            return plans
        proposals = drafts.propose([state.ids for state in rows], ks, config.sampling,
                                   [state.generator for state in rows], [state.row for state in rows])
        for plan, proposal in zip(plans, proposals):
            if proposal is None:
                continue
            if hasattr(proposal, "tree"):
                plan.kind, plan.proposal = "tree", proposal
            elif proposal.tokens.shape[0] > 0:  # a drafter may propose fewer (lookup without a match: none)
                plan.kind, plan.proposal = "chain", proposal
        return plans

    def _verify(self, rows, plans: list[_Plan], roots: torch.Tensor):
        """ONE target forward over every row's [root, proposal]: logits [rows, width, V].

        Rows are padded at the end to the widest. Without trees the default causal mask serves
        every row (a pad is a query nobody reads, and no real token sees it). With trees each
        row gets its ancestor mask, and pads see only the cache and themselves.
        """
        tokens = []
        for i, plan in enumerate(plans):
            if plan.kind == "tree":
                tokens.append(plan.proposal.tree.tokens.to(self.device))
            elif plan.kind == "chain":
                tokens.append(torch.cat([roots[i], plan.proposal.tokens.to(self.device)]))
            else:
                tokens.append(roots[i])
        trees = any(plan.kind == "tree" for plan in plans)
        if len(rows) == 1:
            if trees:
                return self.steps.tree(rows[0].cache, tokens[0], plans[0].proposal.tree), tokens
            return self.steps.forward(rows[0].cache, tokens[0].unsqueeze(0)), tokens
        width = max(t.shape[0] for t in tokens)
        ids = torch.stack([torch.nn.functional.pad(t, (0, width - t.shape[0])) for t in tokens])
        if not trees:
            return self.steps.forward(rows[0].cache, ids), tokens
        mask = torch.zeros(len(rows), width, width, dtype=torch.bool)
        depth = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (t, plan) in enumerate(zip(tokens, plans)):
            n = t.shape[0]
            if plan.kind == "tree":
                mask[i, :n, :n] = plan.proposal.tree.ancestor_mask
                depth[i, :n] = torch.tensor(plan.proposal.tree.depth)
            else:
                mask[i, :n, :n] = kvcache.chain_tree(n)
                depth[i, :n] = torch.arange(n)
            mask[i, range(n, width), range(n, width)] = True
        return self.steps.forward(rows[0].cache, ids, depth=depth, tree=mask), tokens

    def _accept(self, rows, plans, logits, inputs, config: GenerationConfig) -> list[tuple]:
        """Per row (accepted, target token, tree verdict or None), read with as few syncs as possible."""
        greedy = config.sampling.greedy or config.deterministic
        logits = logits[:, :, : self.vocab]
        verdicts: list = [None] * len(rows)
        flat = []  # chain and plain rows: (accepted, token) tensors, read in one sync below
        for i, (state, plan) in enumerate(zip(rows, plans)):
            n = inputs[i].shape[0]
            row_logits = logits[i, :n]
            if plan.kind == "tree":
                tree = plan.proposal.tree
                cached = len(state.ids) - 1
                if greedy:
                    positions = [cached + 1 + d for d in tree.depth]  # node i predicts position n + depth
                    verdicts[i] = greedy_tree(tree.children, inputs[i], self._choice(row_logits, positions, config))
                else:
                    verdicts[i] = recursive_rejection(tree.children, inputs[i], plan.proposal.probs.to(self.device),
                                                      warp(row_logits, config.sampling), state.generator,
                                                      replacement=plan.proposal.replacement)
                continue
            draft = inputs[i][1:]
            if plan.kind == "plain":
                if greedy:
                    token = self._choice(row_logits, [len(state.ids)], config)[0]
                else:
                    token = sample(warp(row_logits[0], config.sampling), state.generator)
                flat.append((i, torch.zeros((), dtype=torch.long, device=self.device), token.view(())))
                continue
            rule = select_rule(greedy, plan.proposal.kind)
            if rule is Rule.GREEDY_MATCH:
                positions = list(range(len(state.ids), len(state.ids) + n))
                choice = self._choice(row_logits, positions, config)
                accepted = (draft == choice[: n - 1]).long().cumprod(dim=0).sum()
                token = choice[accepted]
            else:
                sampled = plan.proposal.probs.to(self.device) if rule is Rule.SPECULATIVE_SAMPLING else None
                verdict = speculative_sampling(draft, sampled, warp(row_logits, config.sampling), state.generator)
                accepted, token = verdict.accepted, verdict.token
            flat.append((i, accepted.view(()), token.view(())))
        if flat:
            drafts = [inputs[i][1:] for i, _, _ in flat]
            values = torch.cat([torch.stack([a for _, a, _ in flat]), torch.stack([t for _, _, t in flat]),
                                *drafts]).tolist()  # the round's one sync for chain and plain rows
            m = len(flat)
            offset = 2 * m
            for j, (i, _, _) in enumerate(flat):
                k = drafts[j].shape[0]
                plans[i].draft = values[offset: offset + k]
                offset += k
                verdicts[i] = (values[j], values[m + j], None)
        return [v if isinstance(v, tuple) else (len(v.path), v.token, v) for v in verdicts]

    def _commit(self, state: DecodeState, plan: _Plan, verdict, config: GenerationConfig, drafts,
                draft_seconds: float, verify_seconds: float) -> RoundResult:
        """Append the committed tokens; both caches keep everything but the new last token."""
        accepted, token, tree_verdict = verdict
        remaining = state.limit(config) - len(state.ids)
        tree_info = None
        if tree_verdict is not None:
            cached = len(state.ids) - 1
            kvcache.keep_positions(state.cache, cached, torch.tensor([0] + tree_verdict.path, device=self.device),
                                   row=state.row)
            node_tokens = tree_verdict.node_tokens
            draft = node_tokens[1:]
            emitted = [node_tokens[i] for i in tree_verdict.path] + [token]
            rejected = tuple(node_tokens[i] for i in tree_verdict.tried)
            tree_info = TreeInfo(node_tokens, plan.proposal.tree.parents, tree_verdict.path, tree_verdict.tried)
        else:
            draft = plan.draft
            emitted = draft[:accepted] + [token]
            rejected = tuple(draft[accepted:])
            if plan.kind == "chain" and state.length is not None:
                state.length.update(len(draft), accepted)  # before any cut
        emitted, stop = self._cut(emitted, remaining)
        state.ids.extend(emitted)
        kvcache.set_length(state.cache, state.row, len(state.ids) - 1)
        if tree_verdict is not None:
            drafts.observe(state.row, len(emitted) - 1, tree_verdict.path[: len(emitted) - 1])
        elif plan.kind == "chain":
            drafts.observe(state.row, len(emitted) - 1, None)
        if stop is None and not config.deterministic and len(state.ids) - state.prompt_length >= state.budget:
            stop = StopReason.CONTEXT if state.context_bound else StopReason.LENGTH
        if not config.deterministic:
            state.stop = stop
        return RoundResult(draft, accepted, token, emitted, draft_seconds, verify_seconds, stop, rejected, tree_info)

    # -- deterministic mode -----------------------------------------------------------------
    def _close_window(self, state: DecodeState, config: GenerationConfig, drafts, result: RoundResult):
        """In deterministic mode, replay the row's window once it is full or the row stopped."""
        if not config.deterministic:
            return None
        start = window_start(state.verified, state.prompt_length, config.verify_window)
        if len(state.ids) < min(start + config.verify_window, state.prompt_length + state.budget) and \
                result.stop is None:
            return None
        replay = self._replay(state, config, start, drafts)
        stop = None
        if state.ids[state.verified - 1] in self.stop_ids and state.verified > state.prompt_length:
            stop = StopReason.EOS
        elif state.verified - state.prompt_length >= state.budget:
            stop = StopReason.CONTEXT if state.context_bound else StopReason.LENGTH
        state.stop = stop
        return replace(replay, stop=stop)

    @torch.inference_mode()
    def _replay(self, state: DecodeState, config: GenerationConfig, start: int, drafts) -> ReplayResult:
        """Replay the window at `start` at the fixed shape (1, N); keep the matching prefix."""
        started = time.perf_counter()
        window, verified = config.verify_window, state.verified
        kvcache.set_length(state.cache, state.row, start - 1)
        rows = slice(state.row, state.row + 1) if state.cache.rows > 1 else None

        def forward(cache, ids):  # the same eager path for a row alone and a row of a batch
            return self._forward(ids, cache, rows=rows)
        replayed = replay_tokens(forward, state.cache, state.ids, start, window, config.sampling,
                                 self.device, state.ids[start - 1], self.vocab)
        ids = state.ids
        # at most N host comparisons of token ids per replay (never a loop over the vocabulary)
        mismatch = next((p for p in range(verified, len(ids)) if ids[p] != replayed[p - start]), None)
        rolled_back, correction = (), None
        checked = (mismatch + 1 if mismatch is not None else len(ids)) - verified
        if mismatch is not None:
            rolled_back, correction = tuple(ids[mismatch:]), replayed[mismatch - start]
            del ids[mismatch:]
            ids.append(correction)
            if drafts is not None and config.method is not Method.PLAIN:
                drafts.rewind(state.row, mismatch)
        kvcache.set_length(state.cache, state.row, len(ids) - 1)  # keep the replay's KV of verified tokens
        state.verified = len(ids)
        return ReplayResult(start, checked, rolled_back, correction, len(ids), time.perf_counter() - started)

    def setup_seconds(self) -> float:
        """Seconds spent so far capturing (and compiling) fixed-shape steps, target and draft."""
        total = self.steps.setup_seconds
        for drafter in (self.drafter, getattr(self.drafter, "model", None)):
            steps = getattr(drafter, "steps", None)
            total += steps.setup_seconds if steps is not None else 0.0
        return total

    # -- helpers ------------------------------------------------------------------------------
    def _check_prompt(self, prompt_ids: list[int], what: str) -> None:
        if not prompt_ids:
            raise PromptError(f"{what} is empty")
        if len(prompt_ids) >= self.context_length:
            raise PromptError(f"{what} has {len(prompt_ids)} tokens but the context holds "
                              f"{self.context_length}; shorten it")

    def _needs_drafter(self, config: GenerationConfig) -> None:
        if config.method is not Method.PLAIN and self.drafter is None:
            raise ValueError(f"method {config.method.value} needs a drafter")

    def _prefill(self, cache, row: int, prompt_ids: list[int]) -> None:
        if len(prompt_ids) > 1:
            ids = torch.tensor([prompt_ids[:-1]], device=self.device)
            self._forward(ids, cache, keep=1, rows=slice(row, row + 1) if cache.rows > 1 else None)

    def _forward(self, input_ids: torch.Tensor, cache, keep: int = 0, rows: slice | None = None) -> torch.Tensor:
        """An eager forward of any length (prefills, replays) on the rows' own slots."""
        return kvcache.forward(self.steps.call, cache, input_ids, keep=keep, rows=rows,
                               full_view=self.steps.mode == "inductor")

    def _set_budget(self, state: DecodeState, config: GenerationConfig) -> None:
        state.budget = min(config.max_new_tokens, self.context_length - state.prompt_length)
        state.context_bound = state.budget < config.max_new_tokens

    def _generator(self, config: GenerationConfig, index: int) -> torch.Generator | None:
        if config.sampling.greedy:
            return None
        seed = config.sampling.seed
        return make_generator(None if seed is None else seed + index, self.device)

    @staticmethod
    def _policy(config: GenerationConfig):
        cost = 0.05 if config.method is Method.LOOKUP else 0.38  # draft token / target forward (measured)
        return make_policy(config.schedule, config.round_tokens, cost=cost)

    def _headroom_length(self, prompt_length: int, config: GenerationConfig) -> int:
        return min(prompt_length + config.max_new_tokens, self.context_length) + self.headroom(config)

    def _reserve(self, cache, prompt_length: int, config: GenerationConfig, draft: bool = True) -> None:
        """Preallocate the caches for the whole generation, so fixed-shape steps keep their shapes."""
        length = self._headroom_length(prompt_length, config)
        cache.reserve(length)
        if draft and self.drafter is not None and config.method is not Method.PLAIN and hasattr(self.drafter, "reserve"):
            self.drafter.reserve(length)

    @staticmethod
    def headroom(config: GenerationConfig) -> int:
        """Slots a round may write past the committed sequence (draft window or tree)."""
        return max(config.round_tokens, config.tree_budget + 1, config.verify_window if config.deterministic else 0) + 2

    def _choice(self, logits: torch.Tensor, positions: list[int], config: GenerationConfig) -> torch.Tensor:
        """The target's token per row: argmax, or in deterministic mode the keyed draw."""
        if config.deterministic:
            return keyed_choice(logits, torch.tensor(positions, device=logits.device), config.sampling)
        return logits.argmax(dim=-1)

    def _cut(self, emitted: list[int], remaining: int) -> tuple[list[int], str | None]:
        for i, token in enumerate(emitted[:remaining]):
            if token in self.stop_ids:
                return emitted[: i + 1], StopReason.EOS
        return emitted[:remaining], None
