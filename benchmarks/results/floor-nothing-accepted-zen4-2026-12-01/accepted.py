"""The floor's verdict on a loss with nothing accepted, as adopted against as it was, in one
process (bench's runner and order):

    python accepted.py --prompts set.jsonl --head HEAD -n 64 --json OUT.json
    python benchmarks/per_prompt.py OUT.json

Columns: plain, then for chain, lookup-chain, rsd-c (the default pair) and eagle (HEAD): the
floor as it is (`METHOD`: a clear loss whose rounds accepted nothing sets the ceiling to 0, plain
rounds, at once) and as it was (`METHOD@halving`: every clear loss halves the ceiling, so a row
allowed 6 that accepts nothing takes three verdicts, about twelve losing rounds, to reach plain
rounds).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/

from draft_reads import head_run, write  # noqa: E402

from specgen.bench.measure import BenchSettings, run_bench  # noqa: E402
from specgen.bench.prompts import load_prompts  # noqa: E402
from specgen.bench.runners import EngineRunner  # noqa: E402
from specgen.cli.options import generation_config  # noqa: E402
from specgen.config import Method  # noqa: E402
from specgen.decoding import floor  # noqa: E402


class Halving(EngineRunner):
    """The floor as it was: every clear loss halves the row's ceiling, accepted or not."""

    def generate(self, prompt_ids, config):
        lower = floor.Floor._lower

        def halving(row):
            row.accepted = row.accepted or 1  # as though something were accepted
            lower(row)

        floor.Floor._lower = halving
        try:
            return super().generate(prompt_ids, config)
        finally:
            floor.Floor._lower = lower


def main() -> None:
    from specgen.decoding.build import resolve_draft_length

    args, pair, head = head_run(__doc__.split("\n\n")[0], Method.CHAIN)
    asked = generation_config(method="chain", max_new_tokens=args.max_new_tokens)
    generation, _ = resolve_draft_length(pair, asked, True)
    own, _ = resolve_draft_length(head, asked, True)
    on_head = {"draft_tokens": own.draft_tokens, "draft_confidence": own.draft_confidence}
    runners = [EngineRunner(pair, Method.PLAIN)]
    for method in (Method.CHAIN, Method.LOOKUP_CHAIN, Method.RSD_C):
        runners += [EngineRunner(pair, method), Halving(pair, method, f"{method.value}@halving")]
    runners += [
        EngineRunner(head, Method.EAGLE, "eagle", on_head),
        Halving(head, Method.EAGLE, "eagle@halving", on_head),
    ]
    settings = BenchSettings(generation=generation, repeats=args.repeats)
    write(run_bench(pair, [], load_prompts(args.prompts), settings, runners=runners), args.json)


if __name__ == "__main__":
    main()
