# In-process A/B at fixed batch widths, engines interleaved (from the repository root: python
# benchmarks/fixed_widths.py
# REPEATS MAX_NEW lookup|chain; its output on the Zen 4 VM:
# results/serve-draft-lengths-zen4-2026-11-23/inprocess.txt):
# lookup: plain vs prompt lookup at draft caps 1, 2, 4 at widths 4 and 8; chain: plain vs chain at caps 1,
# 2, 3
# and lookup-chain at 2, width 2
import json
import statistics as st
import sys
import time

import torch

from specgen.config import GenerationConfig, Method, ModelSettings
from specgen.decoding.build import build_engine, resolve_draft_length
from specgen.decoding.events import RoundResult
from specgen.decoding.policy import Policy
from specgen.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specgen.runtime.pair import load

torch.set_flush_denormal(True)
pair = load(
    ModelSettings(DEFAULT_TARGET, DEFAULT_DRAFT, draft_quant="auto", target_quant="auto", compile="auto"),
    Method.CHAIN,
    quiet=True,
)
tok = pair.target.tokenizer
texts = [json.loads(line)["prompt"] for line in open("prompts/quick.jsonl")]
prompts = [
    tok.encode(
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    for t in texts
]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 64
SETS = {
    "lookup": (
        [("lookup1", Method.LOOKUP, 1), ("lookup2", Method.LOOKUP, 2), ("lookup4", Method.LOOKUP, 4)],
        (4, 8),
    ),
    "chain": (
        [
            ("chain1", Method.CHAIN, 1),
            ("chain2", Method.CHAIN, 2),
            ("chain3", Method.CHAIN, 3),
            ("lc2", Method.LOOKUP_CHAIN, 2),
        ],
        (2,),
    ),
}
spec, widths = SETS[sys.argv[3]]
engines = {}
for name, m, cap in [("plain", Method.PLAIN, None)] + spec:
    cfg, _ = resolve_draft_length(pair, GenerationConfig(method=m, max_new_tokens=N))
    policy = Policy(width_cap=(lambda c: lambda w, config: c)(cap)) if cap is not None else Policy()
    e = build_engine(pair, cfg, policy=policy)
    engines[name] = (e, cfg)
for width in widths:
    batch = (prompts * 4)[:width]
    res = {m: [] for m in engines}
    acc = {m: [0, 0, 0] for m in engines}
    for rep in range(int(sys.argv[1])):
        order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
        for m in order:
            e, cfg = engines[m]
            for r in e.generate(batch, cfg, batch_size=width):
                pass  # warm
            t0 = time.perf_counter()
            for r in e.generate(batch, cfg, batch_size=width):
                if isinstance(r.event, RoundResult):
                    acc[m][0] += len(r.event.draft_tokens)
                    acc[m][1] += r.event.accepted
                    acc[m][2] += 1
            res[m].append(time.perf_counter() - t0)
    base = st.median(res["plain"])
    for m in res:
        w = res[m]
        a = acc[m]
        print(
            f"width {width} {m:8s} median {st.median(w):.2f}s  x{base / st.median(w):.3f}  drafted/row-round "
            f"{a[0] / max(a[2], 1):.2f} accepted {a[1] / max(a[2], 1):.2f}",
            " ".join("%.2f" % x for x in w),
            flush=True,
        )
