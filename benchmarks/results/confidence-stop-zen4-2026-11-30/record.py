"""How well the draft's own confidence predicts acceptance: chain at a fixed k = 5, with no floor
and a confidence stop so low that it stops nothing (so that every draft step reports its top
probability), greedy, the default pair, 128 new tokens. For every round it records the tokens
drafted, the tokens accepted and the draft's top probability at each step but the last.

    python benchmarks/results/confidence-stop-zen4-2026-11-30/record.py PROMPTS.jsonl OUT.json
"""

import dataclasses
import json
import sys

import specgen.decoding.drafters.model as drafting
from specgen.bench.prompts import encode_all, load_prompts
from specgen.cli.options import generation_config
from specgen.config import Method, ModelSettings
from specgen.decoding import run as driver
from specgen.decoding.build import build_engine, resolve_draft_length
from specgen.decoding.views import Silent
from specgen.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specgen.runtime.pair import load

TOPS = []  # each draft step's top probabilities, per row (one row here)
_unsure = drafting.unsure


def recording(threshold, logits, probs=None, reach=None):
    logits32 = logits.float()
    TOPS.append((logits32.amax(-1) - logits32.logsumexp(-1)).exp().tolist())
    return _unsure(threshold, logits, probs, reach)


class Rounds(Silent):
    def __init__(self):
        self.rounds = []

    def on_round(self, result, stats) -> None:
        self.rounds.append((len(result.draft_tokens), len(result.path), len(TOPS)))


def main() -> None:
    drafting.unsure = recording
    settings = ModelSettings(DEFAULT_TARGET, DEFAULT_DRAFT, draft_quant="auto", target_quant="auto")
    pair = load(settings, Method.CHAIN, quiet=True)
    base, _ = resolve_draft_length(pair, generation_config(method="chain", max_new_tokens=128), True)
    config = dataclasses.replace(
        base,
        draft_tokens=5,
        device_draft_tokens=False,
        device_confidence=False,
        draft_confidence=1e-12,
        floor=False,
    )
    items = load_prompts(sys.argv[1])
    out = {}
    for item, ids in zip(items, encode_all(pair.target.tokenizer, items, pair.target.context_length)):
        engine = build_engine(pair, config)
        pair.memories.clear()
        TOPS.clear()
        seen = Rounds()
        driver.generate(engine, pair.target.tokenizer, ids, config, seen)
        rounds, done = [], 0
        for drafted, accepted, steps in seen.rounds:
            rounds.append((drafted, accepted, [top[0] for top in TOPS[done:steps]]))
            done = steps
        out[item.id] = rounds
        print(item.id, len(rounds), sum(r[1] for r in rounds), sum(r[0] for r in rounds), flush=True)
    json.dump(out, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
