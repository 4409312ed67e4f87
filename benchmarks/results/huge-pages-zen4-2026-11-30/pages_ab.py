"""The default pair's steps with its weights in 4 KB pages against the same weights in 2 MB
pages, in one process. The pair is loaded twice (run this without GLIBC_TUNABLES), and the
anonymous memory the second load added (its packed weights and tensors) is collapsed into 2 MB
pages with madvise(MADV_COLLAPSE), Linux 6.1 and later. Then one-token and six-token steps of
each copy take turns over a 200-token cache, 30 rounds, medians. `--collapse first` collapses the
first load instead, so that neither the order of the loads nor where they landed decides.

    python benchmarks/results/huge-pages-zen4-2026-11-30/pages_ab.py [--collapse first|second]
"""

import ctypes
import ctypes.util
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from outside_products import default_pair  # noqa: E402

from specgen.runtime import kvcache  # noqa: E402
from specgen.runtime.lean import LeanForward  # noqa: E402

HUGE = 1 << 21
MADV_COLLAPSE = 25
CONTEXT = 200


def anonymous_regions() -> set[tuple[int, int]]:
    regions = set()
    for line in open("/proc/self/maps"):
        fields = line.split()
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if len(fields) < 6 and high - low >= HUGE:  # no path: anonymous memory
            regions.add((low, high))
    return regions


def huge_kb() -> str:
    return open("/proc/meminfo").read().split("AnonHugePages:")[1].split("\n")[0].strip()


def main() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    torch.set_num_threads(2)
    first = "--collapse" in sys.argv and sys.argv[sys.argv.index("--collapse") + 1] == "first"
    small = None if first else default_pair()
    before = anonymous_regions()
    huge = default_pair()
    added = sorted(anonymous_regions() - before)
    small = small or default_pair()
    started = time.perf_counter()
    for low, high in added:
        start, end = (low + HUGE - 1) & ~(HUGE - 1), high & ~(HUGE - 1)
        if end > start:
            libc.madvise(start, end - start, MADV_COLLAPSE)
    print(
        f"the collapsed load: {sum(h - low for low, h in added) / 1e9:.2f} GB of anonymous memory, in "
        f"{time.perf_counter() - started:.1f} s; AnonHugePages {huge_kb()}",
        flush=True,
    )
    tokens = torch.tensor([[2000, 2001, 2002, 2003, 2004, 2005]])
    with torch.inference_mode():
        for role, exact in (("target", True), ("draft", False)):
            forwards = {
                "4 KB": LeanForward(getattr(small, role).model, exact),
                "2 MB": LeanForward(getattr(huge, role).model, exact),
            }
            caches = {}
            for name, forward in forwards.items():
                caches[name] = kvcache.new_cache(forward.model)
                kvcache.forward(forward, caches[name], torch.arange(1000, 1000 + CONTEXT)[None], keep=1)
            for width in (1, 6):
                walls = {name: [] for name in forwards}
                for round_ in range(30):
                    for name in ("4 KB", "2 MB") if round_ % 2 == 0 else ("2 MB", "4 KB"):
                        started = time.perf_counter()
                        kvcache.forward(forwards[name], caches[name], tokens[:, :width], keep=width)
                        walls[name].append(time.perf_counter() - started)
                        kvcache.crop(caches[name], CONTEXT)
                small_ms, huge_ms = (statistics.median(walls[n]) * 1e3 for n in ("4 KB", "2 MB"))
                print(
                    f"{role}, {width} token(s): 4 KB pages {small_ms:.1f} ms, 2 MB pages {huge_ms:.1f} ms, "
                    f"2 MB / 4 KB {huge_ms / small_ms:.3f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
