"""Lookup's copies priced as a whole and cut before control tokens (specgen now) against the rule
before (each token while its chance is worth a verify's mean price a token; control tokens
copied), as columns of one bench process.

    python benchmarks/results/lookup-whole-xeon-amx-2026-12-03/whole.py --prompts SET \
        --columns lookup,lookup@before,lookup-chain,lookup-chain@before -n 64 --repeats 1 --json OUT.json
    python benchmarks/per_prompt.py OUT.json

A `@before` column's rows get lookups with the rule of commit 4077d02 (`replay.py`'s
`TokenByToken`, no control tokens left out); everything else is as specgen runs. What a round
commits never differs between the columns, only what is proposed.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parent))

from draft_reads import VariantRunner, main  # noqa: E402
from replay import TokenByToken  # noqa: E402

from specgen.decoding import build  # noqa: E402
from specgen.decoding.drafters.lookup import PromptLookupDrafter  # noqa: E402


def before(pair):
    """Each row's lookup as it was: the same measured cost, read token by token, and no cut."""

    def make(cost):
        drafter = PromptLookupDrafter(cost=cost)
        drafter.odds = TokenByToken()
        return drafter

    return functools.partial(make, build.costs.lookup_cost(pair))


class BeforeRunner(VariantRunner):
    """`before`: the rule of 4077d02; `default`: as specgen drafts."""

    def generate(self, prompt_ids, config):
        if self.variant != "before":
            return super(VariantRunner, self).generate(prompt_ids, config)
        priced = build._priced
        build._priced = before
        try:
            return super(VariantRunner, self).generate(prompt_ids, config)
        finally:
            build._priced = priced


if __name__ == "__main__":
    main(BeforeRunner)
