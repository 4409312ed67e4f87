"""A draft's forwards of 2-4 tokens through fbgemm's dynamic kernel (one scale for the rows)
against row_linear (a scale per row), as columns of one process (bench's runner and order):

    python shared.py --prompts set.jsonl -n 64 --json OUT.json
    python benchmarks/per_prompt.py OUT.json

Columns: plain, then for chain and lookup-chain: `METHOD` (SHARED_SCALE_ROWS = 1, a scale per
row past one row, as it was) and `METHOD@shared4` (up to 4 rows share fbgemm's dynamic scale).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/

from draft_reads import MODELS, write  # noqa: E402

from specgen.bench.measure import BenchSettings, run_bench  # noqa: E402
from specgen.bench.prompts import load_prompts  # noqa: E402
from specgen.bench.runners import EngineRunner  # noqa: E402
from specgen.cli.options import generation_config  # noqa: E402
from specgen.config import Method  # noqa: E402
from specgen.decoding.build import resolve_draft_length  # noqa: E402
from specgen.runtime import lean  # noqa: E402
from specgen.runtime.pair import load  # noqa: E402


class Shared(EngineRunner):
    def generate(self, prompt_ids, config):
        lean.SHARED_SCALE_ROWS = 4
        try:
            return super().generate(prompt_ids, config)
        finally:
            lean.SHARED_SCALE_ROWS = 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", required=True)
    parser.add_argument("-n", "--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    lean.SHARED_SCALE_ROWS = 1
    pair = load(MODELS, Method.CHAIN)
    asked = generation_config(method="chain", max_new_tokens=args.max_new_tokens)
    generation, _ = resolve_draft_length(pair, asked, True)
    runners = [EngineRunner(pair, Method.PLAIN)]
    for method in (Method.CHAIN, Method.LOOKUP_CHAIN):
        runners += [EngineRunner(pair, method), Shared(pair, method, f"{method.value}@shared4")]
    settings = BenchSettings(generation=generation, repeats=args.repeats)
    write(run_bench(pair, [], load_prompts(args.prompts), settings, runners=runners), args.json)


if __name__ == "__main__":
    main()
