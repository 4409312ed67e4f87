import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import torch
from loop_overhead import config_for, timed_pair

from specgen.bench.prompts import encode_all, load_prompts
from specgen.decoding import run as driver
from specgen.decoding.build import build_engine
from specgen.decoding.probes import ratios
from specgen.decoding.views import Silent

pair, base, timers = timed_pair(64)
items = load_prompts("quick")
tok = pair.target.tokenizer
for rep in range(2):
    for item, ids in zip(items, encode_all(tok, items, pair.target.context_length)):
        res = {}
        for column in ("plain", "chain"):
            config = config_for(base, column)
            engine = build_engine(pair, config)
            pair.memories.clear()
            timers.calls.clear()
            driver.generate(engine, tok, ids, config, Silent())
            res[column] = timers.table()
        step = statistics.median(res["plain"][("target", 1)])
        tb = res["chain"]
        d1 = tb.get(("draft", 1), [0])
        draft = statistics.median(d1)
        print(
            f"{item.id}: plain step {step * 1e3:.1f} ms; "
            f"draft w1 {draft * 1e3:.1f} ms ({len(d1)}) -> {draft / step:.3f}",
            flush=True,
        )
    timers.calls.clear()
    with torch.inference_mode():
        r = ratios(pair)
    tb = timers.table()
    print(
        "ratios():",
        [round(x, 3) for x in r],
        " target w1 in probe",
        f"{statistics.median(tb[('target', 1)]) * 1e3:.1f}",
        "draft w1 in probe",
        f"{statistics.median(tb[('draft', 1)]) * 1e3:.1f}",
        flush=True,
    )
