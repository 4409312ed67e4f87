"""The round loop: draft, verify, accept, commit. Knows nothing about rendering or text.

One round: the drafter proposes x1..xk, the target scores [root, x1..xk] in ONE forward
(root = last committed token, not yet in the target cache), an acceptance rule keeps a prefix
plus one target token, and both caches are cropped to the committed sequence. Plain decoding
is a round with an empty draft. Each round is yielded as a RoundResult; the only host sync
per round is the single `.tolist()` that reads the verdict and the proposal together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch

from specgen import kvcache
from specgen.adaptive import make_policy
from specgen.acceptance import (Rule, greedy_match, greedy_tree, recursive_rejection, select_rule,
                                speculative_sampling)
from specgen.compiled import Steps
from specgen.config import GenerationConfig, Method
from specgen.drafters import Drafter
from specgen.errors import PromptError
from specgen.replay import ReplayResult, keyed_choice, replay_tokens, window_start
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
    """What one round did, in token ids. `emitted` is what was committed this round."""

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
    """The committed sequence and the target cache, which holds all of it but the last token."""

    ids: list[int]
    cache: object
    prompt_length: int
    prefill_seconds: float = 0.0
    generator: torch.Generator | None = field(default=None, repr=False)
    reused_tokens: int = 0  # cache positions kept from a previous state by `resume`
    verified: int = 0  # deterministic mode: length of the replay-verified prefix of ids
    length: object = None  # the draft-length policy (adaptive.py), kept across chat turns


class Engine:
    """Runs plain or speculative decoding of `target_model`, with an optional drafter."""

    def __init__(self, target_model, device: torch.device, stop_ids: frozenset[int],
                 context_length: int, drafter: Drafter | None = None, vocab: int | None = None,
                 compile: str = "off"):
        self.model = target_model
        self.steps = Steps(target_model, compile)  # the target's forwards, compiled where shapes are fixed
        self.cache = None
        self.vocab = vocab  # the shared vocabulary when the draft head is padded differently
        self.device = device
        self.stop_ids = stop_ids
        self.context_length = context_length
        self.drafter = drafter

    # -- prefill -------------------------------------------------------------------------
    @torch.inference_mode()
    def start(self, prompt_ids: list[int], config: GenerationConfig) -> DecodeState:
        if not prompt_ids:
            raise PromptError("the prompt is empty")
        if len(prompt_ids) >= self.context_length:
            raise PromptError(f"the prompt has {len(prompt_ids)} tokens but the context holds "
                              f"{self.context_length}; shorten it")
        if config.method is not Method.PLAIN and self.drafter is None:
            raise ValueError(f"method {config.method.value} needs a drafter")
        started = time.perf_counter()
        cache = self.cache if self.cache is not None else kvcache.new_cache(self.model)
        self.cache = cache  # one preallocated cache per engine, reused by every generation
        kvcache.crop(cache, 0)
        self._reserve(cache, len(prompt_ids), config)
        if len(prompt_ids) > 1:
            self._forward(torch.tensor([prompt_ids[:-1]], device=self.device), cache, keep=1)
        if config.method is not Method.PLAIN:
            self.drafter.rewind(0)  # a reused engine: nothing the draft cache holds is known to agree
            self.drafter.begin(prompt_ids)
        generator = None
        if not config.sampling.greedy:
            generator = make_generator(config.sampling.seed, self.device)
        state = DecodeState(list(prompt_ids), cache, len(prompt_ids), time.perf_counter() - started, generator)
        state.length = self._policy(config)
        return state

    @staticmethod
    def _policy(config: GenerationConfig):
        cost = 0.05 if config.method is Method.LOOKUP else 0.38  # draft token / target forward (measured)
        return make_policy(config.schedule, config.draft_tokens, cost=cost)

    @torch.inference_mode()
    def resume(self, state: DecodeState | None, prompt_ids: list[int], config: GenerationConfig) -> DecodeState:
        """Start from `prompt_ids`, reusing the caches of a previous state where they agree.

        The target cache keeps the longest common prefix of the old and new sequences (so a
        chat turn prefills only its new tokens, and a template that re-renders earlier turns
        differently falls back to re-prefilling from the first differing token).
        """
        if state is None:
            return self.start(prompt_ids, config)
        if not prompt_ids:
            raise PromptError("the prompt is empty")
        if len(prompt_ids) >= self.context_length:
            raise PromptError(f"the conversation has {len(prompt_ids)} tokens but the context holds "
                              f"{self.context_length}")
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
        if state.length is None:
            state.length = self._policy(config)
        state.prefill_seconds = time.perf_counter() - started
        if not config.sampling.greedy:
            state.generator = make_generator(config.sampling.seed, self.device)
        return state

    # -- the loop ------------------------------------------------------------------------
    def rounds(self, state: DecodeState, config: GenerationConfig) -> Iterator[RoundResult | ReplayResult]:
        """Yield rounds until EOS, max_new_tokens or the context limit.

        In deterministic mode, ReplayResults are interleaved: each closes a window of fast
        rounds, may roll tokens back, and only tokens it verified count as final.
        """
        if config.deterministic:
            yield from self._deterministic_rounds(state, config)
            return
        budget = min(config.max_new_tokens, self.context_length - len(state.ids))
        context_bound = budget < config.max_new_tokens
        produced = 0
        while produced < budget:
            result, stop = self._fast_round(state, config, budget - produced)
            produced += len(result.emitted)
            if stop is None and produced >= budget:
                stop = StopReason.CONTEXT if context_bound else StopReason.LENGTH
            yield replace(result, stop=stop)
            if stop is not None:
                return

    def _fast_round(self, state: DecodeState, config: GenerationConfig, remaining: int
                    ) -> tuple[RoundResult, str | None]:
        """One round of the configured method, committed; at most `remaining` tokens."""
        k = min(state.length.next_k() if state.length else config.draft_tokens, remaining - 1)
        if config.method is Method.PLAIN or k < 1:
            result = self._plain_round(state, config)
        elif config.method.is_tree and remaining > config.tree_depth:
            result = self._tree_round(state, config)
        elif config.method.is_tree:
            result = self._plain_round(state, config)  # too close to the end for a tree
        else:
            result = self._speculative_round(state, config, k)
            if state.length is not None:
                state.length.update(len(result.draft_tokens), result.accepted)  # before any cut
        emitted, stop = self._cut(result.emitted, remaining)
        self._commit(state, emitted, result)
        return replace(result, emitted=emitted), stop

    def _deterministic_rounds(self, state: DecodeState, config: GenerationConfig
                              ) -> Iterator[RoundResult | ReplayResult]:
        """Fast rounds inside aligned windows, each window closed by a fixed-shape replay."""
        window, prompt = config.verify_window, state.prompt_length
        budget = min(config.max_new_tokens, self.context_length - prompt)
        context_bound = budget < config.max_new_tokens
        verified = max(state.verified, prompt)
        while True:
            start = window_start(verified, prompt, window)
            limit = min(start + window, prompt + budget)  # the fast path stays inside the window
            fast_stop = None
            while len(state.ids) < limit and fast_stop is None:
                result, fast_stop = self._fast_round(state, config, limit - len(state.ids))
                yield result
            replay = self._replay(state, config, start, verified)
            verified = replay.verified
            done = verified - prompt >= budget
            stop = None
            if state.ids[verified - 1] in self.stop_ids and verified > prompt:
                stop = StopReason.EOS
            elif done:
                stop = StopReason.CONTEXT if context_bound else StopReason.LENGTH
            yield replace(replay, stop=stop)
            if stop is not None:
                return

    @torch.inference_mode()
    def _replay(self, state: DecodeState, config: GenerationConfig, start: int, verified: int) -> ReplayResult:
        """Replay the window at `start` at the fixed shape; keep the matching prefix."""
        started = time.perf_counter()
        window = config.verify_window
        kvcache.crop(state.cache, start - 1)
        replayed = replay_tokens(self.steps.forward, state.cache, state.ids, start, window, config.sampling,
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
            if self.drafter is not None and config.method is not Method.PLAIN:
                self.drafter.rewind(mismatch)
        kvcache.crop(state.cache, len(ids) - 1)  # keep the replay's KV of verified tokens
        state.verified = len(ids)
        return ReplayResult(start, checked, rolled_back, correction, len(ids), time.perf_counter() - started)

    def generate(self, prompt_ids: list[int], config: GenerationConfig) -> Iterator[RoundResult]:
        state = self.start(prompt_ids, config)
        yield from self.rounds(state, config)

    # -- one round -----------------------------------------------------------------------
    @torch.inference_mode()
    def _plain_round(self, state: DecodeState, config: GenerationConfig) -> RoundResult:
        started = time.perf_counter()
        root = torch.tensor([[state.ids[-1]]], device=self.device)
        logits = self._forward(root, state.cache, keep=1)[0, -1:, : self.vocab]
        if config.deterministic:
            token = self._choice(logits, [len(state.ids)], config)[0]
        elif config.sampling.greedy:
            token = logits[0].argmax()
        else:
            token = sample(warp(logits[0], config.sampling), state.generator)
        token_id = int(token)  # the one sync of the round
        return RoundResult([], 0, token_id, [token_id], 0.0, time.perf_counter() - started)

    @torch.inference_mode()
    def _speculative_round(self, state: DecodeState, config: GenerationConfig, k: int) -> RoundResult:
        started = time.perf_counter()
        proposal = self.drafter.propose(state.ids, k, config.sampling, state.generator)
        draft_tokens = proposal.tokens.to(self.device)
        k = draft_tokens.shape[0]  # a drafter may propose fewer (lookup without a match: none)
        drafted = time.perf_counter()

        root = torch.tensor([state.ids[-1]], device=self.device)
        tree_input = torch.cat([root, draft_tokens]).unsqueeze(0)
        logits = self._forward(tree_input, state.cache, keep=k + 1)[0, :, : self.vocab]  # [k+1, V]
        rule = select_rule(config.sampling.greedy or config.deterministic, proposal.kind)
        if rule is Rule.GREEDY_MATCH:
            positions = list(range(len(state.ids), len(state.ids) + k + 1))
            verdict = greedy_match(draft_tokens, self._choice(logits, positions, config))
        else:
            draft_probs = proposal.probs.to(self.device) if proposal.probs is not None else None
            verdict = speculative_sampling(draft_tokens, draft_probs,
                                           warp(logits, config.sampling), state.generator)
        *drafts, accepted, token = torch.cat(
            [draft_tokens, verdict.accepted.view(1), verdict.token.view(1)]).tolist()
        emitted = drafts[:accepted] + [token]
        return RoundResult(drafts, accepted, token, emitted, drafted - started,
                           time.perf_counter() - drafted, rejected=tuple(drafts[accepted:]))

    @torch.inference_mode()
    def _tree_round(self, state: DecodeState, config: GenerationConfig) -> RoundResult:
        started = time.perf_counter()
        proposal = self.drafter.propose_tree(state.ids, config.sampling, state.generator)
        tree = proposal.tree
        drafted = time.perf_counter()

        cached = len(state.ids) - 1
        tokens = tree.tokens.to(self.device)
        logits = self.steps.tree(state.cache, tokens, tree)[0, :, : self.vocab]  # [N, V]: row i is q(.|path to i)
        if config.sampling.greedy or config.deterministic:
            positions = [cached + 1 + d for d in tree.depth]  # node i predicts position n + depth
            verdict = greedy_tree(tree.children, tokens, self._choice(logits, positions, config))
        else:
            verdict = recursive_rejection(tree.children, tokens, proposal.probs.to(self.device),
                                          warp(logits, config.sampling), state.generator,
                                          replacement=proposal.replacement)
        kvcache.keep_positions(state.cache, cached, torch.tensor([0] + verdict.path, device=self.device))
        node_tokens = verdict.node_tokens
        emitted = [node_tokens[i] for i in verdict.path] + [verdict.token]
        info = TreeInfo(node_tokens, tree.parents, verdict.path, verdict.tried)
        return RoundResult(node_tokens[1:], len(verdict.path), verdict.token, emitted, drafted - started,
                           time.perf_counter() - drafted,
                           rejected=tuple(node_tokens[i] for i in verdict.tried), tree=info)

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

    def _commit(self, state: DecodeState, emitted: list[int], result: RoundResult) -> None:
        """Append the committed tokens; both caches keep everything but the new last token."""
        state.ids.extend(emitted)
        kvcache.crop(state.cache, len(state.ids) - 1)
        if result.tree is not None:
            self.drafter.observe_path(result.tree.accepted_nodes[: len(emitted) - 1])
        elif result.draft_tokens:
            self.drafter.observe(len(emitted) - 1)

    def _forward(self, input_ids: torch.Tensor, cache, keep: int) -> torch.Tensor:
        return self.steps.forward(cache, input_ids, keep=keep)

    def _reserve(self, cache, prompt_length: int, config: GenerationConfig) -> None:
        """Preallocate both caches for the whole generation, so compiled steps keep their shapes."""
        length = min(prompt_length + config.max_new_tokens, self.context_length) + self.headroom(config)
        cache.reserve(length)
        if self.drafter is not None and config.method is not Method.PLAIN and hasattr(self.drafter, "reserve"):
            self.drafter.reserve(length)

    @staticmethod
    def headroom(config: GenerationConfig) -> int:
        """Slots a round may write past the committed sequence (draft window or tree)."""
        return max(config.draft_tokens, config.tree_budget + 1, config.verify_window if config.deterministic else 0) + 2
