"""The lean forward of this tree against an older one (its `runtime/lean.py` alone, loaded from a
file), on the default pair, in one process: steps of each taking turns over a 200-token cache,
40 rounds each at 1 and 6 tokens, and whether their logits are bitwise the same.

    git show REV:specgen/runtime/lean.py > /tmp/lean_old.py
    python benchmarks/results/lean-rotary-zen4-2026-11-30/ab_lean.py /tmp/lean_old.py
"""

import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from outside_products import default_pair  # noqa: E402

from specgen.runtime import kvcache  # noqa: E402
from specgen.runtime.lean import LeanForward  # noqa: E402

CONTEXT = 200


def main() -> None:
    spec = importlib.util.spec_from_file_location("lean_old", sys.argv[1])
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    torch.set_num_threads(2)
    pair = default_pair()
    tokens = torch.tensor([[2000, 2001, 2002, 2003, 2004, 2005]])
    with torch.inference_mode():
        for role, exact in (("target", True), ("draft", False)):
            model = getattr(pair, role).model
            forwards = {"old": old.LeanForward(model, exact), "new": LeanForward(model, exact)}
            caches = {}
            for name, forward in forwards.items():
                caches[name] = kvcache.new_cache(model)
                kvcache.forward(forward, caches[name], torch.arange(1000, 1000 + CONTEXT)[None], keep=1)
            for width in (1, 6):

                def step(name):
                    out = kvcache.forward(forwards[name], caches[name], tokens[:, :width], keep=width)
                    kvcache.crop(caches[name], CONTEXT)
                    return out

                same = torch.equal(step("old"), step("new"))
                walls = {name: [] for name in forwards}
                for round_ in range(40):
                    for name in ("old", "new") if round_ % 2 == 0 else ("new", "old"):
                        started = time.perf_counter()
                        step(name)
                        walls[name].append(time.perf_counter() - started)
                before, after = (statistics.median(walls[n]) * 1e3 for n in ("old", "new"))
                print(
                    f"{role} width {width}: old {before:.2f} ms, new {after:.2f} ms, "
                    f"new/old {after / before:.3f}, bitwise {same}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
