"""Tree shapes within a budget of draft nodes: what a tree row drafts where its floor, its start
on a CPU or the end of its answer allows less than its whole tree (decoding/floor.py,
decoding/rows.py, the tree drafters)."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1024)
def fit_tree(levels: tuple[int, ...], budget: int) -> tuple[int, ...]:
    """The levels of the largest tree of a method's shape (`levels`: its whole tree's nodes at
    each depth) with at most `budget` nodes, and of the largest the deepest; () for a budget of 0.

    The candidates are the whole tree's levels narrowed to at most c nodes each (`_narrowed`), for
    every c, cut to the whole levels from the root that fit. A tree so cut is one its method
    builds with other parameters: fewer levels, fewer children per node (RSD-C's Gumbel-top-b
    draws without replacement at any b, multi-draft's independent ones), a narrower beam (RSD-S
    of width c), so its acceptance rule stays exact and a row's floor lowers a tree's budget as
    it lowers a chain's length (decoding/floor.py). Of two trees of as many nodes the deeper
    wins: under 6 nodes RSD-S with a beam of 2 three levels deep, RSD-C with branching 2,1,1,
    rather than two levels of 3 or of 2 and 4 (a CPU's first ceiling, floor.first_ceiling),
    since a sibling seldom saves a round that the first child would not (benchmarks/floor.md,
    "Deeper trees within a CPU's first ceiling")."""
    if budget <= 0 or not levels:
        return ()
    if sum(levels) <= budget:
        return levels
    best: tuple[int, ...] = ()
    for cap in range(1, min(max(levels), budget) + 1):
        kept, total = [], 0
        for size in _narrowed(levels, cap):
            if total + size > budget:
                break
            kept.append(size)
            total += size
        if (total, len(kept)) > (sum(best), len(best)):
            best = tuple(kept)
    return best


def _narrowed(levels: tuple[int, ...], cap: int) -> list[int]:
    """`levels` with at most `cap` nodes at each depth, each level a whole number of children per
    node of the one above (at least one): (2, 4, 4) at 3 -> (2, 2, 2)."""
    out, above = [], 1
    for size in levels:
        width = min(size, cap)
        width -= width % above  # size >= above and cap >= above: at least one child each
        out.append(width)
        above = width
    return out


def tree_nodes(levels: tuple[int, ...], budget: int, depth: int) -> int:
    """The nodes a row asks its drafter for, which drafts `fit_tree(levels, nodes)` from that count
    alone: those of the largest tree `fit_tree` gives within `budget` nodes that is at most `depth`
    levels deep (the tokens the row may still commit, less the one a round always adds); 0 where
    `depth` is 0. Near the end of an answer a tree so gets shallower, never deeper than the row
    may commit."""
    nodes = min(budget, sum(levels)) if depth > 0 else 0
    while nodes > 0 and len(fit_tree(levels, nodes)) > depth:
        nodes -= 1
    return sum(fit_tree(levels, nodes))  # a tree's own count: fit_tree gives it back whole
