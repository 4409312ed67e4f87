"""Does anything a row knows before a round tell whether the draft's next token will be accepted?

Chain at a fixed k = 1 (no floor, no confidence stop), greedy, the default pair, 128 new tokens,
the target's log-probabilities reported. For each drafted round after the first it records
whether its one draft token was accepted, beside two things known before the round: the last
round's verdict, and the target's probability of the last token it committed (its top-1, since
decoding is greedy). Then the acceptance by each, per prompt and over all.

    python benchmarks/results/round-predictors-zen4-2026-11-30/predict.py PROMPTS.jsonl OUT.json
"""

import dataclasses
import json
import math
import sys

from specgen.bench.prompts import encode_all, load_prompts
from specgen.cli.options import generation_config
from specgen.config import Method, ModelSettings
from specgen.decoding import run as driver
from specgen.decoding.build import build_engine, resolve_draft_length
from specgen.decoding.views import Silent
from specgen.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specgen.runtime.pair import load


class Rounds(Silent):
    def __init__(self):
        self.rounds = []

    def on_round(self, result, stats) -> None:
        self.rounds.append(result)


def rate(verdicts) -> str:
    verdicts = list(verdicts)
    return f"{sum(verdicts) / len(verdicts):.2f} ({len(verdicts)})" if verdicts else "- (0)"


def main() -> None:
    settings = ModelSettings(DEFAULT_TARGET, DEFAULT_DRAFT, draft_quant="auto", target_quant="auto")
    pair = load(settings, Method.CHAIN, quiet=True)
    base, _ = resolve_draft_length(
        pair, generation_config(method="chain", max_new_tokens=128, logprobs=1), True
    )
    config = dataclasses.replace(
        base,
        draft_tokens=1,
        device_draft_tokens=False,
        device_confidence=False,
        draft_confidence=0.0,
        floor=False,
    )
    items = load_prompts(sys.argv[1])
    tokenizer = pair.target.tokenizer
    rows = []  # (prompt, accepted, the last round's verdict, the target's p of its last token)
    for item, ids in zip(items, encode_all(tokenizer, items, pair.target.context_length)):
        engine = build_engine(pair, config)
        pair.memories.clear()
        seen = Rounds()
        driver.generate(engine, tokenizer, ids, config, seen)
        last = None
        for result in seen.rounds:
            if not result.draft_tokens:
                continue
            if last is not None:
                rows.append((item.id, len(result.path), *last))
            last = (len(result.path), math.exp(result.logprobs[-1].logprob))
    json.dump(rows, open(sys.argv[2], "w"))
    bins = ((0, 0.5), (0.5, 0.8), (0.8, 0.95), (0.95, 1.01))
    for prompt in sorted({r[0] for r in rows}) + ["all"]:
        mine = [r for r in rows if prompt in ("all", r[0])]
        line = f"{prompt:>14} accepted {rate(r[1] for r in mine)}"
        line += f" | after a hit {rate(r[1] for r in mine if r[2])}"
        line += f" after a miss {rate(r[1] for r in mine if not r[2])}"
        for low, high in bins:
            line += f" | p [{low}, {high}) {rate(r[1] for r in mine if low <= r[3] < high)}"
        line += f" | a miss and p < 0.5 {rate(r[1] for r in mine if not r[2] and r[3] < 0.5)}"
        print(line)


if __name__ == "__main__":
    main()
