"""DraftTree: draft tokens plus parents; everything else is derived.

Nodes are in BFS order with index 0 the root (the last committed token, not yet in the
target cache); parents[i] < i. A chain is a tree whose nodes each have one child.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True, eq=False)
class DraftTree:
    tokens: torch.Tensor  # [N] int64 on the device that drafted them
    parents: tuple[int, ...]  # parents[0] == -1; known on the host, so no sync to walk the tree

    def __post_init__(self) -> None:
        if not self.parents or self.parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        if any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError("parents must precede their children (BFS order)")
        if self.tokens.shape[0] != len(self.parents):
            raise ValueError("one token per node")

    @classmethod
    def chain(cls, root: torch.Tensor, drafts: torch.Tensor) -> "DraftTree":
        n = drafts.shape[0]
        return cls(torch.cat([root.view(1), drafts]), tuple(range(-1, n)))

    @property
    def size(self) -> int:
        return len(self.parents)

    @cached_property
    def depth(self) -> tuple[int, ...]:
        depth = [0] * self.size
        for i in range(1, self.size):
            depth[i] = depth[self.parents[i]] + 1
        return tuple(depth)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Children of each node, in index order (= draw order: drafters append in that order)."""
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for i in range(1, self.size):
            kids[self.parents[i]].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: node i may attend to node j iff j is i or an ancestor of i."""
        mask = torch.zeros(self.size, self.size, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                mask[i] = mask[parent]
            mask[i, i] = True
        return mask

    def position_ids(self, cached: int, device=None) -> torch.Tensor:
        """[1, N]: cached length + depth (siblings share a position)."""
        return (torch.tensor(self.depth, device=device) + cached).unsqueeze(0)

    def attention_mask(self, cached: int, device=None) -> torch.Tensor:
        """[1, 1, N, cached + N] bool: every node sees the whole cache and its own ancestors."""
        visible_cache = torch.ones(self.size, cached, dtype=torch.bool)
        return torch.cat([visible_cache, self.ancestor_mask], dim=1).to(device)[None, None]

    def path_to(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    @cached_property
    def leaves(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.size) if not self.children[i])

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path as node indices."""
        return [self.path_to(leaf) for leaf in self.leaves]
