"""Batched generation with dynamic batching: sequences of different lengths share forwards.

One shared KV cache holds every active row right-aligned (left padding), so each step is a
single forward of shape [rows, 1] with a 2D padding mask and per-row positions. Finished rows
leave (their cache rows are dropped, common left padding trimmed); waiting prompts join after
a solo prefill, padded to the shared length. The fast path is plain decoding.

In deterministic mode each sequence also keeps its own one-row "verified" cache: when a row
fills its aligned window (or stops), the window is replayed there at the fixed shape (1, N)
exactly as for a single sequence (replay.py), so a prompt's tokens do not depend on its
neighbours or the batch size. A rollback shifts only that row of the shared cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from specgen import kvcache
from specgen.config import GenerationConfig
from specgen.engine import StopReason
from specgen.errors import PromptError
from specgen.replay import keyed_choice, replay_tokens, window_start
from specgen.sampling import make_generator, sample, warp


@dataclass
class Row:
    index: int  # position of the prompt in the input
    ids: list[int]
    prompt_length: int
    generator: torch.Generator | None = None
    verified: int = 0  # deterministic mode
    verified_cache: object = None
    stop: str | None = None
    rounds: int = 0
    replays: int = 0
    rollbacks: int = 0
    rolled_back_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None


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


class BatchDecoder:
    def __init__(self, model, device: torch.device, stop_ids: frozenset[int], context_length: int,
                 pad_id: int, vocab: int | None = None):
        self.model, self.device, self.stop_ids = model, device, stop_ids
        self.context_length, self.pad_id, self.vocab = context_length, pad_id, vocab

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
        cache = kvcache.new_cache(self.model)
        with torch.inference_mode():
            while rows or waiting:
                while waiting and len(rows) < batch_size:
                    index, prompt = waiting.pop()
                    rows.append(self._join(cache, rows, index, prompt, config))
                self._step(cache, rows, config)
                done = [i for i, row in enumerate(rows) if row.stop is not None]
                for i in done:
                    yield self._finished(rows[i])
                if done:
                    keep = [i for i in range(len(rows)) if rows[i].stop is None]
                    rows = [rows[i] for i in keep]
                    self._select(cache, keep)
                    if rows:  # drop the left padding every remaining row has
                        kvcache.crop_left(cache, max(len(r.ids) - 1 for r in rows))

    # -- joining and leaving ---------------------------------------------------------------
    def _join(self, cache, rows: list[Row], index: int, prompt: list[int], config: GenerationConfig) -> Row:
        row = Row(index, list(prompt), len(prompt), verified=len(prompt))
        if not config.sampling.greedy:
            row.generator = make_generator(None if config.sampling.seed is None else config.sampling.seed + index,
                                           self.device)
        solo = kvcache.new_cache(self.model)
        if len(prompt) > 1:
            self.model(input_ids=torch.tensor([prompt[:-1]], device=self.device), past_key_values=solo,
                       use_cache=True, logits_to_keep=1)
        if config.deterministic:
            row.verified_cache = solo  # the prefill depends on the prompt alone
        _merge(cache, solo, self._empty_row(), has_rows=bool(rows))  # copies: no aliasing
        return row

    def _empty_row(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-width K/V for a one-token prompt (nothing to prefill)."""
        config = self.model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype = next(self.model.parameters()).dtype
        empty = torch.zeros(1, heads, 0, head_dim, dtype=dtype, device=self.device)
        return empty, empty

    def _select(self, cache, keep: list[int]) -> None:
        if not keep:
            for layer in cache.layers:
                if getattr(layer, "is_initialized", False):
                    layer.keys, layer.values = layer.keys[:0], layer.values[:0]
            return
        index = torch.tensor(keep, device=self.device)
        for layer in cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)

    # -- one step for every row --------------------------------------------------------------
    def _step(self, cache, rows: list[Row], config: GenerationConfig) -> None:
        width = kvcache.cache_length(cache)
        lengths = [len(r.ids) - 1 for r in rows]  # cached tokens per row (all but the last)
        mask = torch.zeros(len(rows), width + 1, dtype=torch.long)
        for i, n in enumerate(lengths):
            mask[i, width - n:] = 1
        input_ids = torch.tensor([[r.ids[-1]] for r in rows], device=self.device)
        positions = torch.tensor([[n] for n in lengths], device=self.device)
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                         attention_mask=mask.to(self.device), position_ids=positions)
        logits = out.logits[:, -1, : self.vocab]
        if config.deterministic:
            choice = keyed_choice(logits, torch.tensor([len(r.ids) for r in rows], device=logits.device),
                                  config.sampling)
        elif config.sampling.greedy:
            choice = logits.argmax(dim=-1)
        else:
            choice = torch.stack([sample(warp(logits[i], config.sampling), r.generator) for i, r in enumerate(rows)])
        now = time.perf_counter()
        for i, (row, token) in enumerate(zip(rows, choice.tolist())):  # one sync per step
            row.ids.append(token)
            row.rounds += 1
            row.first_token_at = row.first_token_at or now
            generated = len(row.ids) - row.prompt_length
            budget = min(config.max_new_tokens, self.context_length - row.prompt_length)
            stop = StopReason.EOS if token in self.stop_ids else (StopReason.LENGTH if generated >= budget else None)
            if config.deterministic:
                stop = self._maybe_replay(cache, i, row, config, stop, budget)
            row.stop = stop

    def _maybe_replay(self, cache, i: int, row: Row, config: GenerationConfig, stop, budget: int):
        window = config.verify_window
        start = window_start(row.verified, row.prompt_length, window)
        if len(row.ids) < start + window and stop is None:
            return None
        kvcache.crop(row.verified_cache, start - 1)
        replayed = replay_tokens(self.model, row.verified_cache, row.ids, start, window, config.sampling,
                                 self.device, row.ids[start - 1], self.vocab)
        row.replays += 1
        mismatch = next((p for p in range(row.verified, len(row.ids)) if row.ids[p] != replayed[p - start]), None)
        if mismatch is not None:
            dropped = len(row.ids) - mismatch
            row.rollbacks += 1
            row.rolled_back_tokens += dropped
            del row.ids[mismatch:]
            row.ids.append(replayed[mismatch - start])
            _shift_row(cache, i, dropped - 1)  # the shared cache holds len(ids) - 1 for this row
        kvcache.crop(row.verified_cache, len(row.ids) - 1)
        row.verified = len(row.ids)
        generated = len(row.ids) - row.prompt_length
        if row.ids[-1] in self.stop_ids:
            return StopReason.EOS
        return StopReason.LENGTH if generated >= budget else None

    def _finished(self, row: Row) -> Finished:
        now = time.perf_counter()
        return Finished(row.index, row.ids[row.prompt_length:], row.prompt_length, row.stop, row.rounds,
                        now - row.started, (row.first_token_at or now) - row.started, row.replays,
                        row.rollbacks, row.rolled_back_tokens)


def _merge(cache, solo, empty: tuple[torch.Tensor, torch.Tensor], has_rows: bool) -> None:
    """Append solo's single row to the shared cache (copied), right-aligned (left padding)."""
    for shared, layer in zip(_layers(cache, solo), solo.layers):
        keys, values = _row_kv(layer, empty)
        if not has_rows or not getattr(shared, "is_initialized", False) or shared.keys.shape[0] == 0:
            shared.keys, shared.values = keys.clone(), values.clone()
            if not getattr(shared, "is_initialized", False):
                shared.dtype, shared.device = keys.dtype, keys.device
            shared.is_initialized = True
            continue
        width = max(shared.keys.shape[-2], keys.shape[-2])
        shared.keys = torch.cat([_pad_left(shared.keys, width), _pad_left(keys, width)], dim=0)
        shared.values = torch.cat([_pad_left(shared.values, width), _pad_left(values, width)], dim=0)


def _layers(cache, solo):
    if len(cache.layers) < len(solo.layers):  # a fresh cache learns its layers from the first row
        cache.layers = [type(layer)() for layer in solo.layers]
    return cache.layers


def _row_kv(layer, empty):
    if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
        return layer.keys, layer.values
    return empty


def _pad_left(tensor: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - tensor.shape[-2]
    if missing <= 0:
        return tensor
    pad = tensor.new_zeros(*tensor.shape[:-2], missing, tensor.shape[-1])
    return torch.cat([pad, tensor], dim=-2)


def _shift_row(cache, row: int, by: int) -> None:
    """Drop the last `by` cached positions of one row, keeping it right-aligned."""
    if by <= 0:
        return
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            for name in ("keys", "values"):
                tensor = getattr(layer, name)
                shifted = torch.zeros_like(tensor[row])
                shifted[..., by:, :] = tensor[row, ..., :-by, :]
                tensor[row] = shifted
