"""The tree cut of shapes.fit_tree (the largest tree within the budget, of those the deepest)
against the cut before it (whole levels from the root, else fewer children of the root), as
bench columns in one process: METHOD@old and METHOD@new.

    python benchmarks/results/tree-shape-zen4-2026-12-02/fit.py --prompts SET \
        --columns 'rsd-c@old;rsd-c@new;rsd-s@old;rsd-s@new' -n 64 --json OUT.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from draft_reads import main  # noqa: E402

from specgen.bench.runners import EngineRunner  # noqa: E402
from specgen.decoding import rows, shapes  # noqa: E402
from specgen.decoding.drafters import eagle, tree  # noqa: E402

NEW = shapes.fit_tree
USERS = (shapes, rows, tree, eagle)


def old_fit(levels: tuple[int, ...], budget: int) -> tuple[int, ...]:
    """The cut before: whole levels from the root while they fit, else `budget` children of the
    root alone."""
    kept, total = [], 0
    for size in levels:
        if total + size > budget:
            break
        kept.append(size)
        total += size
    if not kept and budget > 0 and levels:
        kept.append(min(levels[0], budget))
    return tuple(kept)


class FitRunner(EngineRunner):
    def __init__(self, pair, method, variant: str):
        super().__init__(pair, method, name=f"{method.value}@{variant}")
        self.fit = old_fit if variant == "old" else NEW

    def generate(self, prompt_ids, config):
        for module in USERS:
            module.fit_tree = self.fit
        try:
            return super().generate(prompt_ids, config)
        finally:
            for module in USERS:
                module.fit_tree = NEW


if __name__ == "__main__":
    main(runner=FitRunner, separator=";")
