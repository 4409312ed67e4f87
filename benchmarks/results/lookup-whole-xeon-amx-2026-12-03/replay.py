"""Lookup's copies replayed on recorded greedy outputs: before and after a copy was priced as a
whole and cut before control tokens.

    python replay.py BENCH.json PROMPTS.jsonl

Greedy output does not depend on what is drafted, so plain decoding's recorded tokens (bench's
JSON) are every method's. Each prompt's rounds are replayed through specgen's own
`PromptLookupDrafter`: it proposes from the context, the tokens that agree with the recorded ones
are accepted, and one more comes from the target. No timing and no floor, so no machine's state
enters: a ranking of the two rules, not their speed. Each round is priced in plain steps two ways:
- `device`: the verify cost this VM's probe measured (2, 3, 5 and 13 tokens at 1.09, 1.19, 1.20
  and 1.38 steps), which is also what the rules decide by;
- `rounds`: lookup's rounds timed in the decode loop (1, 2 and 4 tokens proposed 1.11, 1.23 and
  1.23 steps; ../lookup-multi-xeon-amx-2026-12-03/rounds.txt).

Rules:
- `before` (commit 4077d02): a copy is cut at the first token whose chance of being reached and
  accepted is below the mean price of a proposed token in a 5-token verify; control tokens are
  copied like any other;
- `after` (specgen now): the copy's length with the most expected tokens less its verify's cost,
  as a whole; a copy ends before the target tokenizer's control tokens.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/

from draft_reads import MODELS  # noqa: E402

from specgen.bench.prompts import encode_all, load_prompts  # noqa: E402
from specgen.config import Method  # noqa: E402
from specgen.decoding.costs import VerifyCost  # noqa: E402
from specgen.decoding.drafters.lookup import MatchOdds, PromptLookupDrafter  # noqa: E402
from specgen.text import common_prefix, special_ids  # noqa: E402

K = 6  # the device's draft length on this machine
DEVICE = VerifyCost(0.0938, 0.0056, wide=0.0275, kink=0.0907)


class Rounds:
    """What lookup's rounds cost in the decode loop, by the tokens proposed."""

    table = {0: 1.0, 1: 1.11, 2: 1.23, 3: 1.23, 4: 1.23, 5: 1.25, 6: 1.26}

    def steps(self, proposed: int) -> float:
        return self.table[min(proposed, 6)]


class TokenByToken(MatchOdds):
    """The rule before: each token while its chance of being reached and accepted is worth the
    mean price of a proposed token in a 5-token verify."""

    def length(self, n: int, k: int, cost: VerifyCost, held: int = 0) -> int:
        chance, reach, length, price = self.chance(n), 1.0, 0, cost.per_token()
        while length < k:
            reach *= chance
            if reach < price:
                break
            length += 1
        return length


def replay(
    prompt: list[int], out: list[int], rule: str, never: frozenset[int], price
) -> tuple[float, int, int]:
    """Tokens per plain step of the prompt's rounds, tokens proposed, tokens accepted."""
    drafter = PromptLookupDrafter(cost=DEVICE, never=never if rule == "after" else frozenset())
    if rule == "before":
        drafter.odds = TokenByToken()
    drafter.start(list(prompt))
    context, done, steps, proposed, accepted = list(prompt), 0, 0.0, 0, 0
    while done < len(out):
        tokens = drafter.find(context, K) or []
        agreed = common_prefix(tokens, out[done : done + len(tokens)])
        taken = min(agreed + 1, len(out) - done)
        context += out[done : done + taken]
        done += taken
        steps += price.steps(len(tokens))
        proposed, accepted = proposed + len(tokens), accepted + agreed
    return len(out) / steps, proposed, accepted


def geomean(values) -> float:
    return math.exp(statistics.mean(math.log(v) for v in values))


def recorded(bench: str, prompts_path: str) -> tuple[frozenset[int], dict, dict]:
    """The target tokenizer's control tokens, each prompt's ids and plain decoding's recorded
    answer in `bench` (bench's JSON), by prompt id."""
    from specgen.runtime.pair import load

    pair = load(MODELS, Method.LOOKUP, quiet=True)
    never = frozenset(special_ids(pair.target.tokenizer))
    prompts = load_prompts(prompts_path)
    encoded = encode_all(pair.target.tokenizer, prompts, pair.target.context_length)
    ids = {p.id: e for p, e in zip(prompts, encoded)}
    outs = {
        x["prompt_id"]: x["token_ids"]
        for x in json.loads(Path(bench).read_text())["measurements"]
        if x["method"] == "plain"
    }
    return never, ids, outs


def main() -> None:
    never, ids, outs = recorded(sys.argv[1], sys.argv[2])
    for name, price in (("device", DEVICE), ("rounds", Rounds())):
        print(f"# each round priced by: {name}")
        results = {
            r: {pid: replay(ids[pid], out, r, never, price) for pid, out in outs.items()}
            for r in ("before", "after")
        }
        for rule, found in results.items():
            rates = {pid: r[0] for pid, r in found.items()}
            below = sorted((round(rate, 3), pid) for pid, rate in rates.items() if rate < 1.0)
            print(
                f"{rule:7s} geomean {geomean(rates.values()):.4f} min {min(rates.values()):.3f} "
                f"proposed {sum(r[1] for r in found.values())} accepted {sum(r[2] for r in found.values())} "
                f"below 1: {len(below)} {below[:5]}"
            )
        for category in sorted({pid.rsplit("-", 1)[0] for pid in outs}):
            members = [pid for pid in outs if pid.rsplit("-", 1)[0] == category]
            cells = " ".join(f"{r} {geomean(results[r][pid][0] for pid in members):.3f}" for r in results)
            print(f"  {category:14s} {cells}")


if __name__ == "__main__":
    main()
