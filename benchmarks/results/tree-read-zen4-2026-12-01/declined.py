import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from loop_overhead import config_for, timed_pair

from specgen.bench.prompts import encode_all, load_prompts
from specgen.decoding import run as driver
from specgen.decoding.build import build_engine
from specgen.decoding.views import Silent

pair, base, timers = timed_pair(64)
items = [i for i in load_prompts("prompts/summarization.jsonl") if i.id == "summarize-05"]
tok = pair.target.tokenizer
ids = encode_all(tok, items, pair.target.context_length)[0]
cols = ["plain", "rsd-c", "chain"]
walls = {c: [] for c in cols}
steps = {c: [] for c in cols}
outs = {c: [] for c in cols}
for rep in range(6):
    for c in cols if rep % 2 == 0 else cols[::-1]:
        config = config_for(base, c)
        engine = build_engine(pair, config)
        pair.memories.clear()
        timers.calls.clear()
        t = time.perf_counter()
        r = driver.generate(engine, tok, ids, config, Silent())
        wall = time.perf_counter() - t
        tb = timers.table()
        w1 = tb.get(("target", 1), [])
        reads = sum(sum(tb.get((role, "read"), [])) for role in ("target", "draft"))
        inside = sum(sum(v) for v in tb.values())
        walls[c].append(wall)
        steps[c].append(statistics.median(w1) if w1 else 0)
        outs[c].append(wall - inside)
        median = statistics.median(w1) * 1e3 if w1 else 0
        print(
            f"{rep} {c:6} wall {wall:.3f} reads {reads:.3f} target w1 n={len(w1)} median {median:.2f} ms "
            f"sum {sum(w1):.3f} outside {wall - inside:.3f} declined {r.stats.declined}",
            flush=True,
        )
for c in cols:
    print(
        c,
        "wall median",
        f"{statistics.median(walls[c]):.3f}",
        "step median",
        f"{statistics.median(steps[c]) * 1e3:.2f}",
        "outside median",
        f"{statistics.median(outs[c]):.3f}",
    )
