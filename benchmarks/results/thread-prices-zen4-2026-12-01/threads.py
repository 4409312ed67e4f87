"""The device probe's prices (costs.choose's: draft step, 2-, 5- and 13-token verifies and a prompt
token's read, in target steps) at 2 threads and at 1, in turn, three times each: does an entry
measured at one thread count price a drafter that runs at another?"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from draft_reads import MODELS

from specgen.config import Method
from specgen.decoding.probes import ratios
from specgen.runtime.pair import load

pair = load(MODELS, Method.CHAIN, quiet=True)
with torch.inference_mode():
    for turn in range(6):
        threads = 2 if turn % 2 == 0 else 1
        torch.set_num_threads(threads)
        draft, two, five, wide, read = ratios(pair)
        print(
            f"{threads} threads: draft step {draft:.3f}, verifies of 2, 5 and 13 tokens "
            f"{two:.3f}, {five:.3f}, {wide:.3f}, a prompt token read {read:.4f}",
            flush=True,
        )
