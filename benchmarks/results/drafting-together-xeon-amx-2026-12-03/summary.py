"""The A/B runs of `one.sh` side by side: each server's three loads (medians of two rounds) with
their ratios to plain:4, and from its trace the seconds its width-4 rounds took beyond plain
rounds' pace, split by how many rows drafted.

    python summary.py DIR base1 new1 base2 ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from by_round import rounds

LOADS = ("plain:4", "lookup-chain:4", "plain:2,lookup-chain:2")


def beyond_at_four(path: Path) -> dict[str, dict[int, float]]:
    """Per load, per number of drafting rows: seconds beyond plain rounds at width 4."""
    plain_tokens, plain_ms, groups = 0, 0.0, {}
    parsed = list(rounds(str(path)))
    for load, width, drafting, tokens, ms in parsed:
        if width == 4 and drafting == 0:
            plain_tokens, plain_ms = plain_tokens + tokens, plain_ms + ms
    per_token = plain_ms / plain_tokens
    for load, width, drafting, tokens, ms in parsed:
        if width == 4 and drafting:
            cell = groups.setdefault(load, {})
            cell[drafting] = cell.get(drafting, 0.0) + (ms - tokens * per_token) / 1000
    return groups


def main(folder: str, names: list[str]) -> None:
    print(
        f"{'run':7s} {'plain:4':>8s} {'lc:4':>7s} {'mixed':>7s} {'lc/pl':>6s} {'mix/pl':>6s}"
        "   width-4 seconds beyond plain rounds, by rows drafting (lookup-chain:4 | mixed)"
    )
    for name in names:
        loads = json.loads((Path(folder) / f"{name}.json").read_text())
        plain, chain, mixed = (loads[load]["tok_s"] for load in LOADS)
        groups = beyond_at_four(Path(folder) / f"{name}.rounds.gz")
        cells = []
        for load in ("lookup-chain", "mixed"):
            got = groups.get(load, {})
            cells.append(
                " ".join(f"{n}:{s:+.2f}" for n, s in sorted(got.items())) + f" = {sum(got.values()):+.2f}"
            )
        print(
            f"{name:7s} {plain:8.2f} {chain:7.2f} {mixed:7.2f} {chain / plain:6.3f} {mixed / plain:6.3f}"
            f"   {cells[0]} | {cells[1]}"
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
