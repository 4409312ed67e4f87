"""Chain at a fixed k = 3 over prompt files, accepted/drafted per prompt, with the draft quantized as
`sys.argv[1]` says (auto: the pruned head; int8: the whole head). Greedy: one run is the answer."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from loop_overhead import config_for

from specgen.bench.prompts import encode_all, load_prompts
from specgen.cli.options import generation_config
from specgen.config import Method, ModelSettings
from specgen.decoding import run as driver
from specgen.decoding.build import build_engine, resolve_draft_length
from specgen.decoding.views import Silent
from specgen.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specgen.runtime.pair import load

quant = sys.argv[1]
files = sys.argv[2].split(",")
pair = load(
    ModelSettings(DEFAULT_TARGET, DEFAULT_DRAFT, draft_quant=quant, target_quant="auto", compile="auto"),
    Method.CHAIN,
    quiet=True,
)
base, _ = resolve_draft_length(pair, generation_config(method="chain", max_new_tokens=64), True)
config = config_for(base, "chain@k3")
tok = pair.target.tokenizer
items = [i for f in files for i in load_prompts(f)]
tot_a = tot_d = 0
for item, ids in zip(items, encode_all(tok, items, pair.target.context_length)):
    engine = build_engine(pair, config)
    pair.memories.clear()
    r = driver.generate(engine, tok, ids, config, Silent())
    s = r.stats
    a, d = s.accepted, s.drafted
    tot_a += a
    tot_d += d
    print(
        f"{item.id} {quant}: {len(r.token_ids)} tok, accepted {a}/{d} = {a / max(d, 1):.2f}, "
        f"rounds {s.rounds}",
        flush=True,
    )
print(f"TOTAL {quant}: {tot_a}/{tot_d} = {tot_a / tot_d:.3f}")
