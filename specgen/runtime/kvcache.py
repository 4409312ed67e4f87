"""KV caches preallocated and indexed by position (the gpt-fast design, on transformers' Cache API).

`SlotCache` is a transformers `Cache` whose layers hold [rows, heads, capacity, dim] tensors
allocated once. Every forward goes through `forward()` here, which says where each new token's
K/V is written (slot = the row's length + offset + j) and passes an explicit 4D boolean mask:
query j of row b sees the row's committed slots [0, base_b) and the in-flight slots that the
caller's `tree` mask names (causal for a chain, ancestors for a tree). So:

* rejecting drafts is a length decrement (`crop`): stale slots are never visible, and the next
  write overwrites them;
* a tree commit is a gather of the accepted path into place (`keep_positions`), with no
  re-rotation (node positions were already base + depth);
* every step has a fixed shape when `view` is the whole capacity, so it can be captured as a
  CUDA graph (`compiled.Steps`); eagerly, attention reads only the used prefix (`view` = what is needed).

Rows: a batch keeps one row per sequence, each with its own length (no left padding: every row
writes at its own slots); rows join (`add_row`) and leave (`select`) between rounds.

Features: a cache made with `taps` (layer indices) also keeps, at the same slots, the hidden
states entering those layers (`slots.FeatureBuffer`), which an EAGLE head reads as its input; they
follow the K/V through every crop, row move, tree gather and prefix copy.

Nothing here edits a library's private fields: the layers are our own `CacheLayerMixin`
subclass, and the model is called through its public forward.
"""

from __future__ import annotations

import functools
import itertools

import torch
from transformers.cache_utils import Cache

from specgen.models.compat import CACHE_ARG
from specgen.models.families import text_config, windows
from specgen.runtime import exact_attention
from specgen.runtime.masks import masks
from specgen.runtime.slots import FeatureBuffer, SlotLayer, SlotRows

MIN_CAPACITY = 256
_SERIALS = itertools.count()


class SlotCache(Cache):
    """A position-indexed KV cache for `rows` sequences; `lengths[b]` slots of row b are committed."""

    def __init__(self, config, rows: int = 1, capacity: int | None = None, taps: tuple[int, ...] = ()):
        config = text_config(config)
        # the text config (its `_attn_implementation` picks the masks' format per forward) and each
        # layer type's window, for the masks
        self.config, self.windows = config, windows(config)
        self.rows, self.capacity = rows, capacity or MIN_CAPACITY
        self.lengths = [0] * rows  # host copy: the engine always knows the committed lengths
        self.slots: torch.Tensor | None = None  # [rows, n] write slots of the forward in flight
        self.view = self.capacity  # key slots the forward in flight reads
        self.active = None  # a row slice when a forward feeds some rows only
        # the forward in flight's real tokens, as flat indices into its [rows * width] inputs
        # (rows of different widths padded to the widest; None: every position is real)
        self.packed: torch.Tensor | None = None
        self.generation = 0  # bumped whenever the layers' buffers are reallocated (captured graphs go stale)
        self.serial = next(_SERIALS)  # unique for the process (an id() can be reused after collection)
        self._device_lengths: torch.Tensor | None = None  # `lengths` on the model's device
        self._mirrored: list[int] = []  # the lengths that tensor holds
        super().__init__(layers=[SlotLayer(self) for _ in range(config.num_hidden_layers)])
        # the tapped layers in feature order, each tapped layer's places among them, how many
        self.tapped, self.taps, self.tap_count = tuple(taps), _taps(taps), len(taps)
        self.features = FeatureBuffer(self)  # written only when there are taps

    @property
    def widened(self) -> bool:
        """K/V computed in float32 are held in float64 (see `held_dtype`)."""
        return getattr(self.config, "_attn_implementation", None) == exact_attention.NAME

    def held_dtype(self, key_states: torch.Tensor) -> torch.dtype:
        """The dtype the layers keep K/V in: float64 where the attention is exact_attention's (a
        float32 model on the CPU: the int8 target), which reads them in float64 (every prefix's
        K/V converted again in every layer of every step otherwise: 3-11% of a target step from
        600 tokens of context on, benchmarks/cpu-speed.md); the model's own dtype elsewhere.
        The values are the float32 ones, so a copy kept elsewhere (the prefix store) narrows
        back to float32 exactly."""
        if self.widened and key_states.device.type == "cpu" and key_states.dtype == torch.float32:
            return torch.float64
        return key_states.dtype

    def retap(self, taps: tuple[int, ...]) -> None:
        """Keep the features of other layers from now on (the rows' earlier slots read zeros)."""
        self.tapped, self.taps, self.tap_count = tuple(taps), _taps(taps), len(taps)
        self.features = FeatureBuffer(self)
        self.generation += 1

    @property
    def buffers(self) -> list[SlotRows]:
        """Every position-indexed buffer: the layers' K/V, and the features when tapped."""
        return [*self.layers, self.features] if self.taps else list(self.layers)

    def capture(self, layer: int, hidden: torch.Tensor) -> None:
        """The hidden states `hidden` [b, n, H] entering `layer`, kept if that layer is tapped."""
        for index in self.taps.get(layer, ()):
            self.features.write(index, hidden)

    def device_lengths(self, device) -> torch.Tensor:
        """`lengths` as a tensor on `device`, kept in step by one small fill per changed row.

        A host list copied to a GPU each forward (pageable memory) would wait for every kernel
        queued before it: a host sync per draft step. A fill takes its value as a kernel argument.
        """
        held = self._device_lengths
        if held is None or held.device != torch.device(device) or len(self._mirrored) != self.rows:
            held = self._device_lengths = torch.tensor(self.lengths, dtype=torch.long, device=device)
        else:
            for row, (new, old) in enumerate(zip(self.lengths, self._mirrored)):
                if new != old:
                    held[row].fill_(new)
        self._mirrored = list(self.lengths)
        return held

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths, default=0)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Kept out of compiled regions (see `keep_update_out_of_compiled_regions`): one
        compiled decoder layer serves every layer index."""
        return self.layers[layer_idx].update(key_states, value_states)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.view, 0

    @torch.inference_mode()
    def reserve(self, length: int) -> None:
        """Make room for `length` slots per row (capacity grows by doubling, never shrinks)."""
        if length <= self.capacity:
            return
        capacity = max(self.capacity, MIN_CAPACITY)
        while capacity < length:
            capacity *= 2
        for layer in self.buffers:
            layer.resize(capacity)
        self.capacity = capacity
        self.generation += 1

    @torch.inference_mode()
    def add_row(self) -> int:
        """Append an empty row (a prompt joining a batch); returns its index."""
        for layer in self.buffers:
            layer.add_row()
        self.rows += 1
        self.generation += 1
        self.lengths.append(0)
        return self.rows - 1

    @torch.inference_mode()
    def select(self, keep: list[int]) -> None:
        """Keep only rows `keep` (in that order). Keeping every row in place reallocates nothing
        (captured CUDA graphs stay valid)."""
        if keep == list(range(self.rows)):
            return
        for layer in self.buffers:
            layer.select_rows(keep, self.lengths)
        self.generation += 1
        self.lengths = [self.lengths[i] for i in keep]
        self.rows = len(keep)


def _taps(layers: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
    """Each tapped layer's places among the features (a layer may be named twice)."""
    places: dict[int, tuple[int, ...]] = {}
    for i, layer in enumerate(layers):
        places[layer] = places.get(layer, ()) + (i,)
    return places


def new_cache(model, rows: int = 1, capacity: int | None = None, taps: tuple[int, ...] = ()) -> SlotCache:
    return SlotCache(model.config, rows, capacity, taps)


def cache_length(cache: SlotCache) -> int:
    return cache.lengths[0]


def crop(cache: SlotCache, length: int) -> None:
    """Keep the first `length` positions of every row (the slots past them are free again)."""
    if any(length > held for held in cache.lengths):
        raise ValueError(f"cannot crop a cache of {max(cache.lengths)} up to {length}")
    cache.lengths = [length] * cache.rows


def set_length(cache: SlotCache, row: int, length: int) -> None:
    """Row `row` keeps its first `length` slots (never more than it holds)."""
    if not 0 <= length <= cache.lengths[row]:
        raise ValueError(f"row {row} holds {cache.lengths[row]} slots, cannot keep {length}")
    cache.lengths[row] = length


def set_lengths(cache: SlotCache, lengths: list[int]) -> None:
    """Per-row crop: row b keeps its first lengths[b] slots."""
    if any(new > held or new < 0 for new, held in zip(lengths, cache.lengths)):
        raise ValueError(f"cannot set lengths {lengths} on a cache holding {cache.lengths}")
    cache.lengths = list(lengths)


@torch.inference_mode()
def keep_positions(cache: SlotCache, start: int, keep: torch.Tensor, row: int | None = None) -> None:
    """Keep slots [0, start) plus the slots `start + keep` (in that order) moved into place after it.

    Used after a tree round: the accepted path is gathered into contiguous slots. Their rotary
    positions were already start + depth, so no re-rotation is needed. `row`: one row only.
    """
    count = keep.shape[0]
    rows = slice(None) if row is None else slice(row, row + 1)
    for layer in cache.buffers:
        layer.gather(rows, start, keep)
    if row is None:
        cache.lengths = [start + count] * cache.rows
    else:
        cache.lengths[row] = start + count


@torch.inference_mode()
def write_prefix(
    target: SlotCache,
    row: int,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    n: int,
    features: torch.Tensor | None = None,
) -> None:
    """Row `row` of `target` takes `n` slots of K/V given per layer as [heads, >= n, dim] (a
    staged prefill joining the batch, a stored prefix); the buffers are made if it has none yet.
    A tapped `target` takes `features` [taps, >= n, H] too (zeros when the source kept none:
    an EAGLE head then reads zeros there, which costs acceptance, never exactness)."""
    for layer, k, v in zip(target.layers, keys, values):
        if not layer.is_initialized:  # as its first forward would make them
            layer.lazy_initialization(k[None], v[None])
        layer.write_row(row, [k, v], n)
    held = target.features
    if target.taps and (held.is_initialized or features is not None):
        if not held.is_initialized:
            shapes = {"hidden": (target.tap_count, features.shape[-1])}
            held.allocate(shapes, features.dtype, features.device)
        if features is not None and features.shape[0] == target.tap_count:
            held.write_row(row, [features], n)
        else:
            held.hidden[row, :, :n].zero_()
    target.lengths[row] = n


def copy_prefix(source: SlotCache, source_row: int, target: SlotCache, target_row: int, n: int) -> None:
    """Row `target_row` of `target` takes the first `n` slots of `source`'s row `source_row`."""
    features = source.features.hidden[source_row] if source.taps and source.features.is_initialized else None
    write_prefix(
        target,
        target_row,
        [layer.keys[source_row] for layer in source.layers],
        [layer.values[source_row] for layer in source.layers],
        n,
        features,
    )


def run(
    call,
    cache: SlotCache,
    input_ids: torch.Tensor,
    bases: torch.Tensor,
    offset: int,
    depth: torch.Tensor,
    tree: torch.Tensor,
    view: int,
    keep: int = 0,
    rows: slice | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The device-only part of a forward (capturable in a CUDA graph): slots, positions, mask, model.
    `depth` [rows, offset + n]: every in-flight slot's position relative to the row's base.
    `packed`: the real tokens of rows padded to the widest (see SlotCache.packed)."""
    n = input_ids.shape[1]
    cache.slots = bases[:, None] + torch.arange(offset, offset + n, device=bases.device)
    cache.view, cache.active, cache.packed = view, rows, packed
    mask = masks(cache, bases, offset, tree, depth, view)
    out = call(
        input_ids=input_ids,
        position_ids=bases[:, None] + depth[:, offset:],
        attention_mask=mask,
        use_cache=True,
        logits_to_keep=keep,
        **{CACHE_ARG: cache},
    )
    cache.active = cache.packed = None
    return out.logits


@torch.inference_mode()
def forward(
    model,
    cache: SlotCache,
    input_ids: torch.Tensor,
    *,
    keep: int = 0,
    offset: int = 0,
    depth: torch.Tensor | None = None,
    tree: torch.Tensor | None = None,
    rows: slice | None = None,
    runner=None,
    full_view: bool = False,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Feed input_ids [b, n] at slots length + offset + j of each row; return logits [b, n|keep, V].

    `tree` [n, offset + n] or per row [b, n, offset + n] (bool) says which of this round's slots
    each query sees (default: causal over the new tokens); `depth` [offset + n] or [b, offset + n]
    the positions of this round's slots relative to the row's length (default c for slot c: a
    chain), the last n those of the tokens fed. The row lengths afterwards are length + offset + n, as a
    growing cache would be.
    `rows` feeds a slice of the rows (a prefill of one row of a batch). `runner(cache, input_ids,
    bases, offset, depth, tree, keep)` is a fixed-shape (compiled or captured) forward to use
    instead of the eager one; its view covers the whole capacity. `packed`: the flat indices
    of the real tokens where rows are padded to the widest; an eager lean forward then runs its
    products over those tokens only (runtime/lean.py; a fixed-shape runner ignores it).
    """
    n = input_ids.shape[1]
    device = input_ids.device
    lengths = cache.lengths[rows] if rows is not None else cache.lengths
    end = max(lengths) + offset + n
    cache.reserve(end)
    bases = cache.device_lengths(device)
    if rows is not None:
        bases = bases[rows]
    rows_fed = input_ids.shape[0]
    tree = chain_tree(n, offset, device) if tree is None else tree.to(device)
    depth = _offsets(n, offset, device) if depth is None else depth.to(device)
    if tree.dim() == 2:
        tree = tree.expand(rows_fed, *tree.shape)
    if depth.dim() == 1:
        depth = depth.expand(rows_fed, offset + n)
    if runner is not None and rows is None:
        logits = runner(cache, input_ids, bases, offset, depth, tree, keep)
    else:
        logits = run(
            model,
            cache,
            input_ids,
            bases,
            offset,
            depth,
            tree,
            cache.capacity if full_view else end,
            keep,
            rows,
            packed,
        )
    updated = [length + offset + n for length in lengths]
    if rows is not None:
        cache.lengths[rows] = updated
    else:
        cache.lengths = updated
    return logits


CACHED_WIDTH = 64  # masks and offsets of rounds up to this many tokens are kept; prefills are not


def chain_tree(n: int, offset: int = 0, device=None) -> torch.Tensor:
    """[n, offset + n]: query j sees the round's slots up to its own (offset + j). Callers only
    read it. A decode round's mask is cached (every step needs one); a prefill's is built each
    time: prompts of every length would otherwise keep an n x n mask each (a chat of a few
    hundred turns held 75 MB of them)."""
    return (_cached_tree if n + offset <= CACHED_WIDTH else _tree)(n, offset, device)


def _offsets(n: int, offset: int, device) -> torch.Tensor:
    return (_cached_offsets if n + offset <= CACHED_WIDTH else _positions)(n, offset, device)


def _tree(n: int, offset: int, device) -> torch.Tensor:
    with torch.inference_mode():
        return torch.ones(n, offset + n, dtype=torch.bool, device=device).tril(diagonal=offset)


def _positions(n: int, offset: int, device) -> torch.Tensor:
    with torch.inference_mode():
        return torch.arange(offset + n, device=device)


_cached_tree = functools.lru_cache(maxsize=256)(_tree)
_cached_offsets = functools.lru_cache(maxsize=256)(_positions)


def keep_update_out_of_compiled_regions() -> None:
    """Wrap SlotCache.update in torch.compiler.disable, once, when a model is first compiled.
    Done lazily because the decorator imports torch._dynamo (a second or more of every start),
    which eager runs never need."""
    if not getattr(SlotCache.update, "_specgen_disabled", False):
        for name in ("update", "capture"):  # capture: an EAGLE head's features, written like K/V
            disabled = torch.compiler.disable(getattr(SlotCache, name))
            disabled._specgen_disabled = True
            setattr(SlotCache, name, disabled)
