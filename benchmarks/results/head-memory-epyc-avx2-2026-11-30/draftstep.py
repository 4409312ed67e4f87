"""One process's draft and target steps (medians of 25, in turn), and what its head was primed with.

python draftstep.py LABEL
"""

import statistics
import sys

import torch

from specgen.config import Method, ModelSettings
from specgen.decoding.probes import Probe
from specgen.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specgen.runtime import head_memory
from specgen.runtime.pair import load

settings = ModelSettings(DEFAULT_TARGET, DEFAULT_DRAFT, draft_quant="auto", target_quant="auto")
pair = load(settings, Method.CHAIN, quiet=True)
torch.set_grad_enabled(False)
draft = Probe(pair.draft.model, 1, context=200, exact=False)
target = Probe(pair.target.model, 1, context=200)
drafts, targets = [], []
for _ in range(25):
    drafts.append(draft.seconds())
    targets.append(target.seconds())
d, t = statistics.median(drafts) * 1e3, statistics.median(targets) * 1e3
primed = head_memory.primed(pair.draft.model)
print(sys.argv[1], primed, f"draft {d:.1f} ms target {t:.1f} ms ratio {d / t:.3f}", flush=True)
