"""The floor's verdict on a loss with nothing accepted: after eight misses in a row (adopted)
against after four (as it was), as columns of one process (bench's runner and order):

    python misses.py --prompts set.jsonl -n 64 --json OUT.json
    python benchmarks/per_prompt.py OUT.json

Columns: plain, then for chain, lookup-chain and rsd-c: the floor as it is (`METHOD`: a clear
loss sends the row to plain rounds at once only where its last MISSES = 8 drafting rounds
accepted nothing, else halves its ceiling) and `METHOD@four` (MISSES = 4: the rule as it was,
nothing accepted in the four rounds of a first comparison sends the row to plain rounds).
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
from specgen.decoding import floor  # noqa: E402
from specgen.decoding.build import resolve_draft_length  # noqa: E402
from specgen.runtime.pair import load  # noqa: E402


class Four(EngineRunner):
    """The floor as it was: four misses in a row are enough for plain rounds at once."""

    def generate(self, prompt_ids, config):
        floor.MISSES = 4
        try:
            return super().generate(prompt_ids, config)
        finally:
            floor.MISSES = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("-n", "--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    pair = load(MODELS, Method.CHAIN)
    asked = generation_config(method="chain", max_new_tokens=args.max_new_tokens)
    generation, _ = resolve_draft_length(pair, asked, True)
    runners = [EngineRunner(pair, Method.PLAIN)]
    for method in (Method.CHAIN, Method.LOOKUP_CHAIN, Method.RSD_C):
        runners += [EngineRunner(pair, method), Four(pair, method, f"{method.value}@four")]
    settings = BenchSettings(generation=generation, repeats=args.repeats)
    write(run_bench(pair, [], load_prompts(args.prompts), settings, runners=runners), args.json)


if __name__ == "__main__":
    main()
