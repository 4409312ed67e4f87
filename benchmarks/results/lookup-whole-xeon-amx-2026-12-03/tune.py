"""The rule now (replay.py's `after`) replayed with other priors and halflives, each round priced
as lookup's rounds were timed in the decode loop (replay.Rounds).

    python tune.py ../lookup-multi-xeon-amx-2026-12-03/all-64.json all.jsonl
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay import Rounds, recorded, replay  # noqa: E402

from specgen.decoding.drafters import lookup  # noqa: E402

VARIANTS = (  # name, priors changed, halflife
    ("now", {}, 16.0),
    ("half8", {}, 8.0),
    ("half32", {}, 32.0),
    ("p1=.3/1.7", {1: (0.3, 1.7)}, 16.0),
    ("p1=.7/1.3", {1: (0.7, 1.3)}, 16.0),
    ("p2=.7/1.3", {2: (0.7, 1.3)}, 16.0),
    ("p2=1.3/.7", {2: (1.3, 0.7)}, 16.0),
    ("p3=1.8/.2", {3: (1.8, 0.2)}, 16.0),
)


def geomean(values) -> float:
    return math.exp(statistics.mean(math.log(v) for v in values))


def main() -> None:
    never, ids, outs = recorded(sys.argv[1], sys.argv[2])
    priors, halflife = dict(lookup.PRIORS), lookup.HALFLIFE
    for name, changed, half in VARIANTS:
        lookup.PRIORS.update(changed)
        lookup.HALFLIFE = half
        try:
            rates = {pid: replay(ids[pid], out, "after", never, Rounds())[0] for pid, out in outs.items()}
        finally:
            lookup.PRIORS.clear()
            lookup.PRIORS.update(priors)
            lookup.HALFLIFE = halflife
        summaries = geomean(rate for pid, rate in rates.items() if pid.startswith("summarize"))
        print(
            f"{name:10s} geomean {geomean(rates.values()):.4f} min {min(rates.values()):.3f} "
            f"below 1: {sum(r < 1 for r in rates.values())} summaries {summaries:.3f}"
        )


if __name__ == "__main__":
    main()
