"""Tree rows under chain's read rule (variant `read`): a row whose prompt read costs more than the
tree can save over its tokens drafts nothing (proposes EMPTY every round). Run on commit baa865d,
before PerRow had the rule itself; on later commits `default` has it too."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import draft_reads

from specgen.decoding import costs
from specgen.decoding.drafters import base

GAIN_TREE = 0.1


class TreeReadRunner(draft_reads.VariantRunner):
    def generate(self, prompt_ids, config):
        if self.variant != "read":
            return super().generate(prompt_ids, config)
        join, propose = base.PerRow.join, base.PerRow.propose
        price = costs.read_price(self.pair)
        dear = {}

        def j(self_, row, prompt_ids_, generator, capacity, config_):
            join(self_, row, prompt_ids_, generator, capacity, config_)
            dear[row] = price is not None and len(prompt_ids_) * price > GAIN_TREE * config_.max_new_tokens

        def p(self_, contexts, ks, samplings, features=None):
            ks = [0 if dear.get(r) else k for r, k in enumerate(ks)]
            return propose(self_, contexts, ks, samplings, features)

        base.PerRow.join, base.PerRow.propose = j, p
        try:
            return draft_reads.EngineRunner.generate(self, prompt_ids, config)
        finally:
            base.PerRow.join, base.PerRow.propose = join, propose


if __name__ == "__main__":
    draft_reads.main(TreeReadRunner)
