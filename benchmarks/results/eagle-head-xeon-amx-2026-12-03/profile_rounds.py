"""Per-round cost of a row at k = 1 (a fixed draft length: no floor) against plain decoding, on
translate-02, twice each, then one generation of each under cProfile.

    python profile_rounds.py METHOD [DRAFT] > profile-k1.txt     (here: eagle HEAD)
"""

import cProfile
import pstats
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/

from draft_reads import MODELS  # noqa: E402

from specgen.bench.prompts import encode_all, load_prompts  # noqa: E402
from specgen.bench.runners import EngineRunner  # noqa: E402
from specgen.cli.options import generation_config  # noqa: E402
from specgen.config import Method  # noqa: E402
from specgen.decoding.build import resolve_draft_length  # noqa: E402
from specgen.runtime.pair import load  # noqa: E402

method = sys.argv[1]
models = replace(MODELS, draft=sys.argv[2]) if len(sys.argv) > 2 else MODELS
here = Path(__file__).resolve().parents[1]
prompts = {p.id: p for p in load_prompts(str(here / "tree-stop-zen4-2026-12-01" / "set.jsonl"))}
pair = load(models, Method(method))
asked = generation_config(method=method, max_new_tokens=64, draft_tokens=1)
config, _ = resolve_draft_length(pair, asked, True)
plain = replace(config, method=Method.PLAIN)
ids = encode_all(pair.target.tokenizer, [prompts["translate-02"]], pair.target.context_length)[0]
for name, run_config in (("plain", plain), (method, config)) * 2:
    generation = EngineRunner(pair, Method(name)).generate(ids, run_config)
    stats = generation.stats
    print(
        name,
        f"{len(generation.token_ids) / generation.seconds:.2f} tok/s rounds {stats.rounds}",
        f"draft {stats.draft_seconds:.3f} verify {stats.verify_seconds:.3f}",
        f"decode {stats.decode_seconds:.3f}",
        flush=True,
    )
for name, run_config in (("plain", plain), (method, config)):
    profile = cProfile.Profile()
    profile.enable()
    generation = EngineRunner(pair, Method(name)).generate(ids, run_config)
    profile.disable()
    print("=====", name, generation.stats.rounds, "rounds")
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
