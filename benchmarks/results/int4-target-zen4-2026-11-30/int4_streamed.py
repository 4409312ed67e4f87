"""torch's CPU int4 product against specgen's int8 row product over the default target's 28
layers of linears, each layer with weights of its own (so that they stream from memory as in a
step), at 1 to 8 rows, twice. The int4 packing is int4_products.py's (groups of 32, bf16
activations), from the Xeon folder beside this one.

    python benchmarks/results/int4-target-zen4-2026-11-30/int4_streamed.py
"""

import statistics
import sys
import time
from pathlib import Path

import torch

from specgen.runtime import int8

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "int4-target-xeon-amx-2026-11-29"))

from int4_products import SHAPES, int4_mm, to_int4  # noqa: E402

LAYERS = 28


def median_ms(call, repeats: int = 7) -> float:
    call()
    walls = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        walls.append(time.perf_counter() - started)
    return statistics.median(walls) * 1e3


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    int8s, int4s = [], []
    for _ in range(LAYERS):
        for shape in SHAPES:
            weight = torch.randn(shape) * 0.02
            int8s.append(int8.linear_of(weight))
            int4s.append(to_int4(weight))
    with torch.inference_mode():
        for _ in range(2):
            for rows in (1, 2, 3, 4, 5, 6, 8):
                xs = [torch.randn(rows, shape[1]) for shape in SHAPES]
                halves = [x.bfloat16() for x in xs]
                step8 = median_ms(lambda: [linear(xs[i % 4]) for i, linear in enumerate(int8s)])
                step4 = median_ms(lambda: [int4_mm(halves[i % 4], p, sz) for i, (p, sz) in enumerate(int4s)])
                print(f"{rows} rows: int8 {step8:.1f} ms, int4 {step4:.1f} ms, int4/int8 {step4 / step8:.2f}")


if __name__ == "__main__":
    main()
