"""A target verify's time by its width (tokens fed at once over a 100-token context), the
default pair's int8 target as specgen loads it, medians of 9, two passes.

    python verify_widths.py
"""

import statistics
import time

import torch

from specgen.config import Method, ModelSettings
from specgen.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specgen.runtime import kvcache
from specgen.runtime.compiled import Steps
from specgen.runtime.pair import load

pair = load(
    ModelSettings(DEFAULT_TARGET, DEFAULT_DRAFT, draft_quant="auto", target_quant="auto", compile="auto"),
    Method.CHAIN,
)
steps = Steps(pair.target.model, "off", exact=True)
cache = kvcache.SlotCache(pair.target.model.config, rows=1)
cache.reserve(512)
with torch.inference_mode():
    steps.forward(cache, torch.randint(0, 1000, (1, 100)))
    base = cache.lengths[0]

    def median_ms(width: int, n: int = 9) -> float:
        ids = torch.randint(0, 1000, (1, width))
        times = []
        for _ in range(n):
            kvcache.set_length(cache, 0, base)
            started = time.perf_counter()
            steps.forward(cache, ids)
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1000

    for _ in range(2):
        print([(width, round(median_ms(width), 1)) for width in (1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 13, 16)])
