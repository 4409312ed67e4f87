"""Operations on transformers cache objects: their length, cropping, and path compaction."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def crop(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of every layer.

    Layer by layer, so a cache left uneven by an interrupted forward (Ctrl-C between layers)
    is made consistent again.
    """
    if cache.get_seq_length() < length:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} up to {length}")
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def keep_positions(cache: DynamicCache, start: int, keep: torch.Tensor) -> None:
    """Keep positions [0, start) plus the rows `start + keep` (in that order), drop the rest.

    Used after a tree round: the accepted nodes are gathered into contiguous slots. Their
    rotary positions were already start + depth, so no re-rotation is needed.
    """
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        index = (keep.to(layer.keys.device) + start)
        layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys.index_select(-2, index)], dim=-2)
        layer.values = torch.cat([layer.values[..., :start, :], layer.values.index_select(-2, index)], dim=-2)


def crop_left(cache: DynamicCache, length: int) -> None:
    """Keep only the last `length` positions of every layer (drop common left padding)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., layer.keys.shape[-2] - length:, :]
            layer.values = layer.values[..., layer.values.shape[-2] - length:, :]
