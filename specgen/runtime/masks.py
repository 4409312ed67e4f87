"""The attention masks of a forward over a SlotCache (kvcache.py): which slots each query sees,
per sliding window, as the model's layers read them."""

from __future__ import annotations

import torch


def _mask(
    bases: torch.Tensor,
    offset: int,
    tree: torch.Tensor,
    depth: torch.Tensor,
    view: int,
    window: int | None = None,
) -> torch.Tensor:
    """[rows, 1, n, view] bool: slot s is visible to query j of row b iff s < bases[b], or
    s = bases[b] + c with tree[b, j, c] (c < offset + n: the in-flight slots of this round).

    `window`: a sliding-window layer's W. Query j sits at position bases[b] + depth[b, offset + j],
    a committed slot s at position s, an in-flight slot c at bases[b] + depth[b, c]; a slot is
    visible only if the query's position minus its own is below W (transformers' sliding mask:
    each query sees itself and the W - 1 positions before it)."""
    rows, n, width = tree.shape
    rel = torch.arange(view, device=bases.device)[None, :] - bases[:, None]  # [rows, view]
    inside = (rel >= 0) & (rel < width)
    column = torch.where(inside, rel, width)  # a column of False for slots outside the tree
    padded = torch.cat([tree, tree.new_zeros(rows, n, 1)], dim=2)  # [rows, n, width + 1]
    visible = padded.gather(2, column[:, None, :].expand(rows, n, view))  # [rows, n, view]
    visible = (rel < 0)[:, None, :] | visible
    if window is not None and window < view:
        # each slot's position relative to the row's base: its own offset when committed, its
        # node's depth when in flight (slots past the tree are invisible anyway)
        held = torch.cat([depth, depth.new_zeros(rows, 1)], dim=1).gather(1, column)
        position = torch.where(rel < 0, rel, held)  # [rows, view]
        query = depth[:, offset:]  # [rows, n]
        visible = visible & (query[:, :, None] - position[:, None, :] < window)
    return visible[:, None]


def masks(cache, bases: torch.Tensor, offset: int, tree: torch.Tensor, depth: torch.Tensor, view: int):
    """The attention mask(s) of one forward, as the model's layers read them: one tensor when
    every layer attends alike, else a dict by layer type (transformers' own `causal_mask_mapping`,
    which the models with mixed layers take); additive (0 / the dtype's minimum) for eager
    attention, which adds its mask, boolean for SDPA and specgen's exact attention. `cache`: the
    kvcache.SlotCache the forward runs over (kvcache imports this module, so it is not named here)."""
    built = {
        window: _mask(bases, offset, tree, depth, view, window)
        for window in dict.fromkeys(cache.windows.values())
    }
    if cache.config._attn_implementation == "eager":
        built = {
            w: torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill_(
                ~m, torch.finfo(torch.float32).min
            )
            for w, m in built.items()
        }
    if len(built) == 1:
        return next(iter(built.values()))
    return {kind: built[window] for kind, window in cache.windows.items()}
