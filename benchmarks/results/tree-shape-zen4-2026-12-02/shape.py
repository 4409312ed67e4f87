"""Tree shapes within the CPU's first ceiling of BEND nodes: bench's per-prompt run (draft_reads'
runner and order) with tree columns that differ only in their shape, against plain and chain.

    python benchmarks/results/tree-shape-zen4-2026-12-02/shape.py --prompts SET \
        --columns 'chain;rsd-c;rsd-c@2,1,1,1,1;rsd-s@w2' -n 64 --json OUT.json

A column is METHOD or METHOD@SHAPE, split at ';': for rsd-c and multi-draft SHAPE is a
branching (`2,1,1,1,1`), for rsd-s `wN` is a beam width (at the default depth). Each row keeps
specgen's defaults otherwise: its floor, its ceiling of BEND nodes at the start, the growth to
the whole tree where it wins.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from draft_reads import main  # noqa: E402

from specgen.bench.runners import EngineRunner  # noqa: E402
from specgen.config import parse_branching  # noqa: E402


class ShapeRunner(EngineRunner):
    def __init__(self, pair, method, variant: str):
        overrides = {}
        if variant.startswith("w"):
            overrides["beam_width"] = int(variant[1:])
        elif variant != "default":
            overrides["branching"] = parse_branching(variant)
        name = method.value if variant == "default" else f"{method.value}@{variant}"
        super().__init__(pair, method, name=name, overrides=overrides)


if __name__ == "__main__":
    main(runner=ShapeRunner, separator=";")
