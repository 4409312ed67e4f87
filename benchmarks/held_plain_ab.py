# A/B in one process: plain engine vs chain engine held to plain rounds (cap 0), same batch of 8, interleaved
# (python benchmarks/held_plain_ab.py REPEATS; its output on the Zen 4 VM:
# results/serve-measured-rates-zen4-2026-11-23/ab.txt)
import statistics as st
import sys
import time

import torch

sys.path.insert(0, "/work/main")
from specgen.config import GenerationConfig, Method, ModelSettings
from specgen.decoding.build import build_engine, resolve_draft_length
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
texts = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in two sentences.",
    "def fibonacci(n):",
    "List three uses of a linked list.",
    "Write a haiku about caches.",
    "What is a mutex?",
    "Sort a list of integers in Python without sorted().",
    "Explain recursion to a child.",
]
prompts = [
    tok.encode(
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    for t in texts
]
engines = {}
for m in (Method.PLAIN, Method.CHAIN, Method.LOOKUP_CHAIN):
    cfg, _ = resolve_draft_length(pair, GenerationConfig(method=m, max_new_tokens=24))
    e = build_engine(
        pair, cfg, policy=Policy() if m is Method.PLAIN else Policy(width_cap=lambda w, config: 0)
    )
    engines[m] = (e, cfg)
res = {m: {"round": [], "join": [], "wall": []} for m in engines}
with torch.inference_mode():
    for rep in range(int(sys.argv[1])):
        order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
        for m in order:
            e, cfg = engines[m]
            t0 = time.perf_counter()
            last = t0
            rounds = []
            for r in e.generate(prompts, cfg, batch_size=8):
                pass
            res[m]["wall"].append(time.perf_counter() - t0)
for m in res:
    w = res[m]["wall"]
    print(m.value, "wall median %.3f mean %.3f" % (st.median(w), st.mean(w)), " ".join("%.2f" % x for x in w))
