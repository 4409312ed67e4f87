"""The floor halving from what a row proposed against from what it was allowed, in one process.

    python proposed.py --prompts set.jsonl --head HEAD -n 64 --json OUT.json
    python benchmarks/per_prompt.py OUT.json

Columns: plain, then for chain, lookup-chain, rsd-c (the default pair) and eagle (HEAD): the
floor as measured here (`METHOD`: a clear loss halves the most tokens the row proposed at its
ceiling) and as it was (`METHOD@allowed`: it halves the most it was allowed, its k). With a
confidence stop a row allowed 6 that proposes 1 halved to 3, then to 1, before it reached plain
rounds: two verdicts, about ten losing rounds, in which nothing it drafted changed.

Not adopted (benchmarks/floor.md): the two columns measured the same. `floor.BY_PROPOSAL` was
a local switch for this run only, never committed, on commit 9528f9d: in `PlainSteps.measure`,
`state.floor.record((proposal.size if BY_PROPOSAL else k) if proposal.size else 0, ...)`
in place of `state.floor.record(k if proposal.size else 0, ...)`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from draft_reads import head_run, write  # noqa: E402

from specgen.bench.measure import BenchSettings, run_bench
from specgen.bench.prompts import load_prompts
from specgen.bench.runners import EngineRunner
from specgen.cli.options import generation_config
from specgen.config import Method
from specgen.decoding import floor
from specgen.decoding.build import resolve_draft_length


class Allowed(EngineRunner):
    """The floor as it was: a clear loss halves the row's k at its ceiling."""

    def generate(self, prompt_ids, config):
        floor.BY_PROPOSAL = False
        try:
            return super().generate(prompt_ids, config)
        finally:
            floor.BY_PROPOSAL = True


def main() -> None:
    args, pair, head = head_run(__doc__.split("\n\n")[0], Method.CHAIN)
    asked = generation_config(method="chain", max_new_tokens=args.max_new_tokens)
    generation, _ = resolve_draft_length(pair, asked, True)
    own, _ = resolve_draft_length(head, asked, True)
    on_head = {"draft_tokens": own.draft_tokens, "draft_confidence": own.draft_confidence}
    runners = [EngineRunner(pair, Method.PLAIN)]
    for method in (Method.CHAIN, Method.LOOKUP_CHAIN, Method.RSD_C):
        runners += [EngineRunner(pair, method), Allowed(pair, method, f"{method.value}@allowed")]
    runners += [
        EngineRunner(head, Method.EAGLE, "eagle", on_head),
        Allowed(head, Method.EAGLE, "eagle@allowed", on_head),
    ]
    settings = BenchSettings(generation=generation, repeats=args.repeats)
    write(run_bench(pair, [], load_prompts(args.prompts), settings, runners=runners), args.json)


if __name__ == "__main__":
    main()
