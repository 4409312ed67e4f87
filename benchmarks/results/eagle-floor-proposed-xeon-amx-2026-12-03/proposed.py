"""A weak EAGLE-3 head's floor halving what the row proposed against what it was allowed, as
columns of one process.

    python proposed.py --prompts weak.jsonl --head HEAD -n 64 --repeats 2 --json OUT.json
    python benchmarks/per_prompt.py OUT.json

Columns: plain; `eagle`, the floor as it is (a clear loss halves the most tokens the row was
allowed at its ceiling, its k); `eagle@proposed`, the variant (it halves the most the row
proposed: with the confidence stop cutting a weak head's drafts to one token, a loss then sends
the row to plain rounds at once, where halving 6 to 3 changed nothing it drafted and cost four
more losing rounds). The variant is made here, not in specgen: for its column's rounds each row's
allowed k is replaced by the size of its proposal before the floor records the round.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/

from draft_reads import head_overrides, head_run, write  # noqa: E402

from specgen.bench.measure import BenchSettings, run_bench  # noqa: E402
from specgen.bench.prompts import load_prompts  # noqa: E402
from specgen.bench.runners import EngineRunner  # noqa: E402
from specgen.cli.options import generation_config  # noqa: E402
from specgen.config import Method  # noqa: E402
from specgen.decoding import floor  # noqa: E402
from specgen.decoding.build import resolve_draft_length  # noqa: E402

AS_IS = floor.PlainSteps.measure


def by_proposal(self, rows, ks, proposals, results, seconds, verify_seconds, cost):
    AS_IS(self, rows, [p.size for p in proposals], proposals, results, seconds, verify_seconds, cost)


class Proposed(EngineRunner):
    """The variant: a clear loss halves what the row proposed."""

    def generate(self, prompt_ids, config):
        floor.PlainSteps.measure = by_proposal
        try:
            return super().generate(prompt_ids, config)
        finally:
            floor.PlainSteps.measure = AS_IS


def main() -> None:
    args, pair, head = head_run(__doc__.split("\n\n")[0], Method.PLAIN)
    on_head = head_overrides(head, args.max_new_tokens)
    runners = [
        EngineRunner(pair, Method.PLAIN),
        EngineRunner(head, Method.EAGLE, "eagle", on_head),
        Proposed(head, Method.EAGLE, "eagle@proposed", on_head),
    ]
    plain, _ = resolve_draft_length(pair, generation_config(max_new_tokens=args.max_new_tokens), True)
    settings = BenchSettings(generation=plain, repeats=args.repeats)
    write(run_bench(pair, [], load_prompts(args.prompts), settings, runners=runners), args.json)


if __name__ == "__main__":
    main()
