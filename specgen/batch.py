"""Batched generation with dynamic batching: sequences of different lengths share forwards.

Every round is one draft-verify-accept-commit for all active rows at once:

* draft: a BatchDrafter proposes up to k tokens per row (none for plain decoding), one draft
  forward per step for the whole batch;
* verify: ONE target forward over [root, x1..xk_i] for every row (ragged.py: rows of
  different lengths right-aligned in one cache, shorter proposals padded at the end);
* accept: greedy match (or the keyed choices of deterministic mode) vectorised over rows, or
  the speculative-sampling rule per row with the row's own generator;
* commit: each row keeps its accepted prefix plus the target's token, both caches are cut
  back per row, finished rows leave and waiting prompts join after a solo prefill.

In deterministic mode each sequence also keeps its own one-row "verified" cache: when a row
fills its aligned window (or stops), the window is replayed there at the fixed shape (1, N)
exactly as for a single sequence (replay.py), so a prompt's tokens depend neither on its
neighbours nor on the batch size nor on the method. The fast path of a row never crosses
its window's end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from specgen import kvcache
from specgen.acceptance import speculative_sampling
from specgen.adaptive import make_policy
from specgen.config import GenerationConfig
from specgen.engine import StopReason
from specgen.errors import PromptError
from specgen.ragged import RaggedCache
from specgen.replay import keyed_choice, replay_tokens, window_start
from specgen.sampling import make_generator, warp


@dataclass
class Row:
    index: int  # position of the prompt in the input
    ids: list[int]
    prompt_length: int
    budget: int  # new tokens allowed (max_new_tokens within the context)
    generator: torch.Generator | None = None
    verified: int = 0  # deterministic mode
    verified_cache: object = None
    stop: str | None = None
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    replays: int = 0
    rollbacks: int = 0
    rolled_back_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    def limit(self, config: GenerationConfig) -> int:
        """The sequence length this row's fast path may reach before it must stop (or replay)."""
        end = self.prompt_length + self.budget
        if config.deterministic:
            start = window_start(self.verified, self.prompt_length, config.verify_window)
            end = min(end, start + config.verify_window)
        return end


@dataclass(frozen=True)
class Finished:
    """One prompt's generation, reported when its row leaves the batch."""

    index: int
    token_ids: list[int]  # generated tokens only
    prompt_tokens: int
    stop: str
    rounds: int
    seconds: float
    time_to_first_token: float
    replays: int = 0
    rollbacks: int = 0
    rolled_back_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0


class BatchDecoder:
    """Dynamic batching of plain decoding, or of chain / lookup drafting with `drafter`."""

    def __init__(self, model, device: torch.device, stop_ids: frozenset[int], context_length: int,
                 pad_id: int, vocab: int | None = None, drafter=None, draft_cost: float = 0.38):
        self.model, self.device, self.stop_ids = model, device, stop_ids
        self.context_length, self.pad_id, self.vocab = context_length, pad_id, vocab
        self.drafter, self.draft_cost = drafter, draft_cost

    def generate(self, prompts: list[list[int]], config: GenerationConfig, batch_size: int) -> Iterator[Finished]:
        """Yield each prompt's result as it finishes (use .index to restore input order)."""
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise PromptError(f"prompt {i + 1} is empty")
            if len(prompt) >= self.context_length:
                raise PromptError(f"prompt {i + 1} has {len(prompt)} tokens but the context holds "
                                  f"{self.context_length}")
        waiting = list(enumerate(prompts))[::-1]
        rows: list[Row] = []
        self.cache = RaggedCache(self.model, self.device, self.pad_id)
        policy = make_policy(config.schedule, config.draft_tokens, cost=self.draft_cost) if self.drafter else None
        with torch.inference_mode():
            while rows or waiting:
                while waiting and len(rows) < batch_size:
                    index, prompt = waiting.pop()
                    rows.append(self._join(index, prompt, config))
                self._round(rows, config, policy)
                done = [i for i, row in enumerate(rows) if row.stop is not None]
                for i in done:
                    yield self._finished(rows[i])
                if done:
                    keep = [i for i in range(len(rows)) if rows[i].stop is None]
                    rows = [rows[i] for i in keep]
                    self.cache.select(keep)
                    if self.drafter is not None:
                        self.drafter.leave(keep)

    # -- joining -------------------------------------------------------------------------------
    def _join(self, index: int, prompt: list[int], config: GenerationConfig) -> Row:
        budget = min(config.max_new_tokens, self.context_length - len(prompt))
        row = Row(index, list(prompt), len(prompt), budget, verified=len(prompt))
        if not config.sampling.greedy:
            row.generator = make_generator(None if config.sampling.seed is None else config.sampling.seed + index,
                                           self.device)
        solo = self.cache.join(prompt[:-1])
        if config.deterministic:
            row.verified_cache = solo  # the prefill depends on the prompt alone; the batch holds a copy
        if self.drafter is not None:
            self.drafter.join(prompt, row.generator)
        return row

    # -- one round for every row ----------------------------------------------------------------
    def _round(self, rows: list[Row], config: GenerationConfig, policy) -> None:
        started = time.perf_counter()
        k = policy.next_k() if policy is not None else 0
        ks = [max(0, min(k, row.limit(config) - len(row.ids) - 1)) for row in rows]
        drafts, probs, sampled, proposed = [[] for _ in rows], None, False, False
        if self.drafter is not None and max(ks) > 0:
            proposed = True
            proposal = self.drafter.propose([row.ids for row in rows], ks, config.sampling)
            drafts, probs = proposal.tokens, proposal.probs
            sampled = probs is not None
        drafted_at = time.perf_counter()

        width = max(len(d) for d in drafts)
        logits = self.cache.forward([[row.ids[-1]] + d for row, d in zip(rows, drafts)])[:, :, : self.vocab]
        accepted, tokens = self._verdicts(rows, drafts, width, logits, probs if sampled else None, config)
        verdicts = torch.stack([accepted, tokens]).tolist()  # the round's one sync
        now = time.perf_counter()

        lengths, kept = [], []
        for i, (row, draft) in enumerate(zip(rows, drafts)):
            a, token = verdicts[0][i], verdicts[1][i]
            emitted, stop = self._cut(draft[:a] + [token], row.limit(config) - len(row.ids), row, config)
            row.ids.extend(emitted)
            row.rounds += 1
            cut_inside = stop is not None and len(emitted) <= a
            row.drafted += len(emitted) if cut_inside else len(draft)
            row.accepted += min(a, len(emitted))
            row.draft_seconds += drafted_at - started
            row.verify_seconds += now - drafted_at
            row.first_token_at = row.first_token_at or now
            row.stop = stop
            lengths.append(len(row.ids) - 1)
            kept.append(len(emitted) - 1)  # the drafter's cache holds all but the last committed token
            if policy is not None and draft:
                policy.update(len(draft), a)
        self.cache.truncate(lengths)
        if proposed:
            self.drafter.observe(kept)
        if config.deterministic:
            for i, row in enumerate(rows):
                row.stop = self._maybe_replay(i, row, config, row.stop)

    def _verdicts(self, rows, drafts, width, logits, probs, config):
        """accepted [rows] and the target's token [rows], on the device."""
        device = logits.device
        if config.sampling.greedy or config.deterministic:
            if config.deterministic:
                positions = torch.tensor([[len(row.ids) + j for j in range(width + 1)] for row in rows],
                                         device=device)
                choice = keyed_choice(logits.reshape(-1, logits.shape[-1]), positions.view(-1),
                                      config.sampling).view(len(rows), width + 1)
            else:
                choice = logits.argmax(dim=-1)
            if width == 0:
                return torch.zeros(len(rows), dtype=torch.long, device=device), choice[:, 0]
            padded = torch.tensor([d + [-1] * (width - len(d)) for d in drafts], device=device)
            accepted = (padded == choice[:, :width]).long().cumprod(dim=1).sum(dim=1)
            return accepted, choice.gather(1, accepted.view(-1, 1)).view(-1)
        accepted, tokens = [], []
        for i, (row, draft) in enumerate(zip(rows, drafts)):
            k = len(draft)
            draft_probs = probs[i, :k].to(device) if probs is not None and k else None
            verdict = speculative_sampling(torch.tensor(draft, dtype=torch.long, device=device), draft_probs,
                                           warp(logits[i, : k + 1], config.sampling), row.generator)
            accepted.append(verdict.accepted)
            tokens.append(verdict.token)
        return torch.stack(accepted), torch.stack(tokens)

    def _cut(self, emitted: list[int], room: int, row: Row, config: GenerationConfig):
        """Cut at EOS or at the row's limit; the stop reason (None inside a deterministic window)."""
        for i, token in enumerate(emitted[:room]):
            if token in self.stop_ids:
                return emitted[: i + 1], StopReason.EOS
        emitted = emitted[:room]
        if len(row.ids) + len(emitted) - row.prompt_length >= row.budget:
            return emitted, StopReason.LENGTH
        return emitted, None

    def _maybe_replay(self, i: int, row: Row, config: GenerationConfig, stop):
        window = config.verify_window
        start = window_start(row.verified, row.prompt_length, window)
        if len(row.ids) < start + window and stop is None:
            return None
        kvcache.crop(row.verified_cache, start - 1)
        replayed = replay_tokens(lambda cache, ids: kvcache.forward(self.model, cache, ids), row.verified_cache, row.ids, start, window, config.sampling,
                                 self.device, row.ids[start - 1], self.vocab)
        row.replays += 1
        mismatch = next((p for p in range(row.verified, len(row.ids)) if row.ids[p] != replayed[p - start]), None)
        if mismatch is not None:
            row.rollbacks += 1
            row.rolled_back_tokens += len(row.ids) - mismatch
            del row.ids[mismatch:]
            row.ids.append(replayed[mismatch - start])
            lengths = list(self.cache.lengths)
            lengths[i] = len(row.ids) - 1
            self.cache.truncate(lengths)
            if self.drafter is not None:
                self.drafter.rollback(i, mismatch)
        kvcache.crop(row.verified_cache, len(row.ids) - 1)
        row.verified = len(row.ids)
        if row.ids[-1] in self.stop_ids:
            return StopReason.EOS
        return StopReason.LENGTH if len(row.ids) - row.prompt_length >= row.budget else None

    def _finished(self, row: Row) -> Finished:
        now = time.perf_counter()
        return Finished(row.index, row.ids[row.prompt_length:], row.prompt_length, row.stop, row.rounds,
                        now - row.started, (row.first_token_at or now) - row.started, row.replays,
                        row.rollbacks, row.rolled_back_tokens, row.drafted, row.accepted,
                        row.draft_seconds, row.verify_seconds)
