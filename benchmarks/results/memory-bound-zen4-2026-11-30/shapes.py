"""One-row int8 products of the default target's four shapes, each streamed from memory (copies
totalling about 400 MB per shape, cycled), beside the machine's read bandwidth, twelve times.

    python benchmarks/results/memory-bound-zen4-2026-11-30/shapes.py
"""

import statistics
import time

import torch

from specgen.runtime import int8

torch.set_num_threads(2)
stream = torch.ones((2 << 30) // 4)
SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}


def bandwidth() -> float:
    walls = []
    for _ in range(3):
        started = time.perf_counter()
        stream.sum()
        walls.append(time.perf_counter() - started)
    return (2 << 30) / statistics.median(walls) / 1e9


copies = {
    name: [int8.linear_of(torch.randn(n, k)) for _ in range(max(2, int(400e6 // (n * k))))]
    for name, (n, k) in SHAPES.items()
}
for _ in range(12):
    line = f"bw {bandwidth():.1f} GB/s |"
    for name, linears in copies.items():
        n, k = SHAPES[name]
        x = torch.randn(1, k)
        with torch.inference_mode():
            for linear in linears:
                linear(x)
            started = time.perf_counter()
            for _ in range(3):
                for linear in linears:
                    linear(x)
            wall = (time.perf_counter() - started) / (3 * len(linears))
        line += f" {name} {wall * 1e3:.3f} ms {n * k / wall / 1e9:.1f} GB/s |"
    print(line, flush=True)
