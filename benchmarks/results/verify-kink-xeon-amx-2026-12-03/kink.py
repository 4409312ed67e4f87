"""The verify's cost through its measured 3-token point (specgen's VerifyCost with its `kink`)
against the line through 2 and 5 tokens it replaced, as columns of one bench process.

    python benchmarks/results/verify-kink-xeon-amx-2026-12-03/kink.py --prompts SET \
        --columns chain,chain@line,lookup-chain,lookup-chain@line -n 64 --repeats 1 --json OUT.json
    python benchmarks/per_prompt.py OUT.json

A `@line` column's engine prices its verifies as before: `first` from the 2-token verify and one
slope from there to 5 tokens (the same 2- and 5-token costs, so every price but those of 3 and 4
tokens is unchanged). The floor's plain step from a verify's seconds reads that price, so only
the floor's verdicts differ between the columns; what a round commits never does.

A `@k5` column drafts at most 5 tokens a round with everything else as specgen's (the device's
stop, the floor): the k the line's prices chose on this machine, where the measured 3-token
point chooses 6 (a verify of 3-5 tokens costs about the same, so a longer chain is cheaper).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/

from draft_reads import VariantRunner, main  # noqa: E402

from specgen.decoding import build  # noqa: E402


def line(cost):
    """The line through the same 2- and 5-token costs: slope + kink / 3 a token, no kink."""
    return cost if cost is None else replace(cost, slope=cost.slope + cost.kink / 3, kink=0.0)


class LineRunner(VariantRunner):
    """`line`: the verify priced along the line; `k5`: at most 5 tokens a round; `default`: as
    specgen drafts."""

    def __init__(self, pair, method, variant: str):
        super().__init__(pair, method, variant)
        if variant == "k5":
            self.overrides = {"draft_tokens": 5}

    def generate(self, prompt_ids, config):
        if self.variant != "line":
            return super(VariantRunner, self).generate(prompt_ids, config)
        measured = build.costs.verify_cost
        build.costs.verify_cost = lambda pair: line(measured(pair))
        try:
            return super().generate(prompt_ids, config)
        finally:
            build.costs.verify_cost = measured


if __name__ == "__main__":
    main(LineRunner)
