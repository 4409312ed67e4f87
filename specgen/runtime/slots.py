"""Position-indexed buffers: the tensors a SlotCache keeps one entry per slot of each row.

Two kinds share the slot bookkeeping (`SlotRows`): a layer's keys and values (`SlotLayer`, the
transformers cache layer every attention call writes through), and the hidden states entering
the layers an EAGLE head reads (`FeatureBuffer`, written by the model's taps). Each tensor is
[rows, channels, capacity, width] (heads and head dim for K/V, taps and hidden size for the
features), allocated once on the first write with spare rows kept for joining rows, and moved
by the same operations: grow the capacity, add a row, keep some rows, gather a tree's path.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin


class SlotRows:
    """The slot bookkeeping of the tensors named in `names`: each name is a view of the first
    `rows` rows of a buffer `_<name>` that may hold spare rows (a joining row costs no copy)."""

    names: tuple[str, ...] = ()
    owner = None  # the SlotCache: rows, capacity, the slots of the forward in flight
    is_initialized = False
    device: torch.device | None = None

    def allocate(self, shapes: dict[str, tuple[int, int]], dtype, device) -> None:
        """Buffers of the owner's rows and capacity: `shapes[name]` = (channels, width)."""
        owner = self.owner
        self.dtype, self.device = dtype, device
        for name in self.names:
            channels, width = shapes[name]
            full = torch.zeros(owner.rows, channels, owner.capacity, width, dtype=dtype, device=device)
            setattr(self, "_" + name, full)
        self._view_rows(owner.rows)
        self.is_initialized = True  # fixed addresses from here on: captured CUDA graphs use them in place

    def tensors(self) -> list[torch.Tensor]:
        """The live views ([rows, channels, capacity, width] each)."""
        return [getattr(self, name) for name in self.names]

    def _view_rows(self, rows: int) -> None:
        for name in self.names:
            setattr(self, name, getattr(self, "_" + name)[:rows])

    def _active(self) -> list[torch.Tensor]:
        """The views of the rows the forward in flight feeds."""
        active = self.owner.active
        return [t if active is None else t[active] for t in self.tensors()]

    def _slots(self, like: torch.Tensor) -> torch.Tensor:
        slots = self.owner.slots
        return slots if slots.device == like.device else slots.to(like.device)

    def resize(self, capacity: int) -> None:
        """Grow (copying what is held) or shrink the slot dimension."""
        if not self.is_initialized:
            return
        rows = getattr(self, self.names[0]).shape[0]
        for name in self.names:
            tensor = getattr(self, "_" + name)
            new = tensor.new_zeros(*tensor.shape[:2], capacity, tensor.shape[-1])
            keep = min(tensor.shape[2], capacity)
            new[:rows, :, :keep] = tensor[:rows, :, :keep]
            setattr(self, "_" + name, new)
        self._view_rows(rows)

    def add_row(self) -> None:
        """One more row: a spare one of the buffers (what it holds is masked until written:
        the row's length is 0), or buffers of twice the rows."""
        if not self.is_initialized:
            return
        rows = getattr(self, self.names[0]).shape[0] + 1
        for name in self.names:
            tensor = getattr(self, "_" + name)
            if rows > tensor.shape[0]:
                new = tensor.new_zeros(max(rows, 2 * tensor.shape[0]), *tensor.shape[1:])
                new[: rows - 1] = tensor[: rows - 1]
                setattr(self, "_" + name, new)
        self._view_rows(rows)

    def select_rows(self, keep: list[int], lengths: list[int]) -> None:
        """Keep rows `keep` in that order. In place when they stay in order (a row leaving): each
        kept row moves down over the gap, its committed slots only (`lengths`)."""
        if not self.is_initialized:
            return
        for name in self.names:
            tensor = getattr(self, "_" + name)
            if keep != sorted(keep):
                index = torch.tensor(keep, dtype=torch.long, device=self.device)
                setattr(self, "_" + name, tensor.index_select(0, index))
                continue
            for row, source in enumerate(keep):
                if source != row and lengths[source]:
                    tensor[row, :, : lengths[source]].copy_(tensor[source, :, : lengths[source]])
        self._view_rows(len(keep))

    def gather(self, rows: slice, start: int, keep: torch.Tensor) -> None:
        """Slots `start + keep` of `rows` moved, in that order, to the slots from `start` on
        (a tree round's accepted path)."""
        if not self.is_initialized:
            return
        source = keep.to(self.device) + start
        target = torch.arange(start, start + keep.shape[0], device=self.device)
        for tensor in self.tensors():
            tensor[rows].index_copy_(2, target, tensor[rows].index_select(2, source))

    def write_row(self, row: int, given: list[torch.Tensor], n: int) -> None:
        """Row `row`'s first `n` slots from `given` (one [channels, >= n, width] per name)."""
        for tensor, values in zip(self.tensors(), given):
            tensor[row, :, :n].copy_(values[:, :n])


class SlotLayer(SlotRows, CacheLayerMixin):
    """One layer's K/V: written at the slots its cache names, read up to the cache's view."""

    names = ("keys", "values")
    is_compileable = True

    def __init__(self, owner):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        heads = key_states.shape[1]
        shapes = {"keys": (heads, key_states.shape[-1]), "values": (heads, value_states.shape[-1])}
        self.allocate(shapes, self.owner.held_dtype(key_states), key_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self._active()
        if key_states.dtype != keys.dtype:  # float32 K/V into a float64 cache (exact attention)
            key_states, value_states = key_states.to(keys.dtype), value_states.to(values.dtype)
        slots = self._slots(keys)
        if slots.shape[0] == 1:
            row = slots[0]  # indexed once for both writes
            keys.index_copy_(2, row, key_states)
            values.index_copy_(2, row, value_states)
        else:
            index = slots[:, None, :, None]
            keys.scatter_(2, index.expand_as(key_states), key_states)
            values.scatter_(2, index.expand_as(value_states), value_states)
        view = self.owner.view
        if view == keys.shape[2]:
            return keys, values
        return keys[:, :, :view], values[:, :, :view]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.view, 0

    def get_seq_length(self) -> int:
        return max(self.owner.lengths, default=0)

    def get_max_length(self) -> int:
        return self.owner.capacity


class FeatureBuffer(SlotRows):
    """The hidden states entering the tapped layers, `hidden` [rows, taps, capacity, hidden size],
    written at the forward's slots as K/V are, read by an EAGLE head as its input."""

    names = ("hidden",)

    def __init__(self, owner):
        self.owner = owner

    def write(self, index: int, hidden: torch.Tensor) -> None:
        """Tap `index` of the forward in flight: `hidden` [b, n, H] goes to the slots being written."""
        if not self.is_initialized:
            self.allocate({"hidden": (self.owner.tap_count, hidden.shape[2])}, hidden.dtype, hidden.device)
        (held,) = self._active()
        slots = self._slots(held)
        hidden = hidden.to(held.dtype)
        if slots.shape[0] == 1:
            held[:, index].index_copy_(1, slots[0], hidden)
        else:
            held[:, index].scatter_(1, slots[:, :, None].expand_as(hidden), hidden)

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """Row `row`'s features at slots [start, end), the taps side by side: [end - start, taps * H]
        (zeros where nothing was written)."""
        held = self.hidden[row, :, start:end]  # [taps, n, H]
        return held.permute(1, 0, 2).reshape(end - start, -1)

    @property
    def capacity(self) -> int:
        """Slots held per row (0 before the first write)."""
        return self.hidden.shape[2] if self.is_initialized else 0
