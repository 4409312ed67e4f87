"""lookup-chain's copies taken only where copies of their match length have committed what the
row's model rounds do per plain step (measured yields) against every copy found (as it was), as
columns of one process (bench's runner and order):

    python choice.py --prompts set.jsonl -n 128 --json OUT.json
    python benchmarks/per_prompt.py OUT.json

Columns: plain, chain, `lookup-chain` (the row's copies weighed against its model rounds by
what each has committed a plain step: yields.patch's drafters/lookup_chain.py) and
`lookup-chain@every` (no prices: every copy found is taken, the rule before).
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
from specgen.decoding import costs  # noqa: E402
from specgen.decoding.build import resolve_draft_length  # noqa: E402
from specgen.runtime.pair import load  # noqa: E402

PRICED = costs.round_prices


class Every(EngineRunner):
    """lookup-chain as it was: no prices, every copy found is taken."""

    def generate(self, prompt_ids, config):
        costs.round_prices = lambda pair: None
        try:
            return super().generate(prompt_ids, config)
        finally:
            costs.round_prices = PRICED


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("-n", "--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--no-chain", action="store_true", help="plain and the two lookup-chain columns only")
    args = parser.parse_args()
    pair = load(MODELS, Method.CHAIN)
    asked = generation_config(method="chain", max_new_tokens=args.max_new_tokens)
    generation, _ = resolve_draft_length(pair, asked, True)
    print("prices:", costs.round_prices(pair), flush=True)
    runners = [
        EngineRunner(pair, Method.PLAIN),
        *([EngineRunner(pair, Method.CHAIN)] if not args.no_chain else []),
        EngineRunner(pair, Method.LOOKUP_CHAIN),
        Every(pair, Method.LOOKUP_CHAIN, "lookup-chain@every"),
    ]
    settings = BenchSettings(generation=generation, repeats=args.repeats)
    write(run_bench(pair, [], load_prompts(args.prompts), settings, runners=runners), args.json)


if __name__ == "__main__":
    main()
