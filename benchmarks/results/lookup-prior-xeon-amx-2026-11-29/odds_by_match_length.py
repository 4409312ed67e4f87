"""How often lookup's copied tokens were accepted, by the length of the match behind them.

    python odds_by_match_length.py PROMPTS.jsonl

Runs `specgen bench --methods plain,lookup -n 64` in this process with `MatchOdds.record`
wrapped, and prints per match length: proposals, tokens proposed and accepted, and the share of
proposals whose first token was accepted.
"""

import sys

import specgen.decoding.drafters.lookup as lookup
from specgen.cli.app import app

counts: dict[int, list[int]] = {}
record = lookup.MatchOdds.record


def counted(self, n, proposed, accepted):
    row = counts.setdefault(n, [0, 0, 0, 0])
    row[0] += 1
    row[1] += proposed
    row[2] += accepted
    row[3] += accepted > 0
    record(self, n, proposed, accepted)


lookup.MatchOdds.record = counted
try:
    app(
        ["bench", "--prompts", sys.argv[1], "--methods", "plain,lookup", "-n", "64", "--repeats", "1"],
        standalone_mode=False,
    )
except SystemExit:
    pass
for n, (proposals, tokens, accepted, first) in sorted(counts.items()):
    print(
        f"n={n}: proposals {proposals}, tokens {tokens}, "
        f"accepted {accepted} ({accepted / max(tokens, 1):.2f}), "
        f"first token accepted {first / max(proposals, 1):.2f}"
    )
