"""A KV cache shared by rows of different lengths: the storage behind dynamic batching.

Rows are right-aligned in one transformers cache (left padding, masked out), so row i holds
its `lengths[i]` tokens in the last `lengths[i]` columns. A forward feeds each row its own
number of new tokens: rows with fewer than the widest get TRAILING pads, which are masked as
keys and dropped right after, so a pad is never a query that sees nothing (no NaN rows) and
the real tokens' logits sit at columns 0..m-1 of every row. `truncate` drops a row's last
positions by shifting it right (it stays right-aligned); `select` keeps some rows;
common left padding is trimmed as rows leave or shrink.
"""

from __future__ import annotations

import torch

from transformers import DynamicCache



class RaggedCache:
    def __init__(self, model, device: torch.device, pad_id: int = 0):
        self.model, self.device, self.pad_id = model, device, pad_id
        self.cache = DynamicCache(config=model.config)
        self.lengths: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def width(self) -> int:
        return max((_layer_width(layer) for layer in self.cache.layers), default=0)

    # -- rows joining and leaving --------------------------------------------------------------
    def join(self, prefix: list[int]) -> object:
        """Prefill `prefix` alone (its KV does not depend on the batch) and add it as the last row.

        Returns the solo one-row cache (callers may keep it: deterministic mode does).
        """
        solo = DynamicCache(config=self.model.config)
        if prefix:
            self.model(input_ids=torch.tensor([prefix], device=self.device), past_key_values=solo,
                       use_cache=True, logits_to_keep=1)
        _merge(self.cache, solo, self._empty_row(), has_rows=bool(self.lengths))
        self.lengths.append(len(prefix))
        return solo

    def select(self, keep: list[int]) -> None:
        """Keep only the rows `keep` (in that order)."""
        self.lengths = [self.lengths[i] for i in keep]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.keys = layer.keys.index_select(0, index.to(layer.keys.device))
                layer.values = layer.values.index_select(0, index.to(layer.values.device))
        self._trim_left()

    # -- forwards ----------------------------------------------------------------------------
    def forward(self, new: list[list[int]], keep: int | None = None) -> torch.Tensor:
        """Feed each row its new tokens in one forward; logits [rows, n, V] (n = widest row).

        Row i's logits for its m_i tokens are at columns 0..m_i-1 (trailing pads are dropped
        from the cache before returning). `keep` limits the logits to the last `keep` columns.
        """
        n = max(len(tokens) for tokens in new)
        if n == 0:
            raise ValueError("nothing to feed")
        inputs = torch.full((self.rows, n), self.pad_id, dtype=torch.long)
        for i, tokens in enumerate(new):
            inputs[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return self._feed(inputs.to(self.device), [len(tokens) for tokens in new], keep)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One new token per row, already on the device (a draft step: no host round trip)."""
        return self._feed(tokens.view(self.rows, 1), [1] * self.rows, None)

    def _feed(self, inputs: torch.Tensor, counts: list[int], keep: int | None) -> torch.Tensor:
        """inputs [rows, n] on the device; row i's first counts[i] tokens are real, the rest pads."""
        n, width = inputs.shape[1], self.width()
        mask = torch.zeros(self.rows, width + n, dtype=torch.long)
        positions = torch.zeros(self.rows, n, dtype=torch.long)
        for i, (m, length) in enumerate(zip(counts, self.lengths)):
            mask[i, width - length: width + m] = 1
            positions[i] = torch.arange(length, length + n)  # pads continue counting; masked anyway
        out = self.model(input_ids=inputs, past_key_values=self.cache, use_cache=True,
                         attention_mask=mask.to(self.device), position_ids=positions.to(self.device),
                         logits_to_keep=keep or 0)
        self.lengths = [length + n for length in self.lengths]
        if any(m < n for m in counts):
            self.truncate([length - n + m for length, m in zip(self.lengths, counts)])
        return out.logits

    def truncate(self, lengths: list[int]) -> None:
        """Make row i hold only its first lengths[i] tokens (never more than it holds)."""
        for i, (old, length) in enumerate(zip(self.lengths, lengths)):
            if length > old or length < 0:
                raise ValueError(f"row {i} holds {old} tokens, cannot truncate to {length}")
            if length < old:
                _shift_row(self.cache, i, old - length)
        self.lengths = list(lengths)
        self._trim_left()

    # -- internals ------------------------------------------------------------------------
    def _trim_left(self) -> None:
        if self.lengths:
            _crop_left(self.cache, max(self.lengths))

    def _empty_row(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-width K/V for a row with nothing cached."""
        config = self.model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype = next(self.model.parameters()).dtype
        empty = torch.zeros(1, heads, 0, head_dim, dtype=dtype, device=self.device)
        return empty, empty


def _layer_width(layer) -> int:
    if getattr(layer, "is_initialized", False) and layer.keys is not None:
        return layer.keys.shape[-2]
    return 0


def _merge(cache, solo, empty: tuple[torch.Tensor, torch.Tensor], has_rows: bool) -> None:
    """Append solo's single row to the shared cache (copied), right-aligned (left padding)."""
    if len(cache.layers) < len(solo.layers):  # a fresh cache learns its layers from the first row
        cache.layers = [type(layer)() for layer in solo.layers]
    for shared, layer in zip(cache.layers, solo.layers):
        if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel():
            keys, values = layer.keys, layer.values
        else:
            keys, values = empty[0].to(shared_device(shared, empty[0])), empty[1].to(shared_device(shared, empty[1]))
        if not has_rows or not getattr(shared, "is_initialized", False) or shared.keys.shape[0] == 0:
            shared.keys, shared.values = keys.clone(), values.clone()
            if not getattr(shared, "is_initialized", False):
                shared.dtype, shared.device = keys.dtype, keys.device
            shared.is_initialized = True
            continue
        width = max(shared.keys.shape[-2], keys.shape[-2])
        shared.keys = torch.cat([_pad_left(shared.keys, width), _pad_left(keys.to(shared.keys.device), width)])
        shared.values = torch.cat([_pad_left(shared.values, width),
                                   _pad_left(values.to(shared.values.device), width)])


def shared_device(shared, fallback: torch.Tensor) -> torch.device:
    if getattr(shared, "is_initialized", False) and shared.keys is not None:
        return shared.keys.device
    return fallback.device


def _pad_left(tensor: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - tensor.shape[-2]
    if missing <= 0:
        return tensor
    pad = tensor.new_zeros(*tensor.shape[:-2], missing, tensor.shape[-1])
    return torch.cat([pad, tensor], dim=-2)


def _shift_row(cache, row: int, by: int) -> None:
    """Drop the last `by` cached positions of one row, keeping it right-aligned."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            for tensor in (layer.keys, layer.values):
                width = tensor.shape[-2]
                if by >= width:
                    tensor[row].zero_()
                    continue
                tensor[row, ..., by:, :] = tensor[row, ..., : width - by, :].clone()
                tensor[row, ..., :by, :].zero_()


def _crop_left(cache, length: int) -> None:
    """Keep only the last `length` positions of every layer (drop common left padding)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., layer.keys.shape[-2] - length:, :]
            layer.values = layer.values[..., layer.values.shape[-2] - length:, :]
