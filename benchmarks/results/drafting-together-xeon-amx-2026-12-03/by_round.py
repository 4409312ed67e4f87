"""The rounds of `trace_serve.py`'s log grouped by load, width and how many rows drafted: tokens,
seconds, tokens per second, and the seconds each group took beyond what plain rounds of its width
would have taken for the same tokens (each width's plain rounds' ms per token, measured in the
same log).

    python by_round.py rounds.log   (or rounds.gz)
"""

from __future__ import annotations

import collections
import gzip
import sys


def rounds(path: str):
    for line in gzip.open(path, "rt") if path.endswith(".gz") else open(path):
        if not line[0].isdigit():
            continue  # a floor's start or keep
        fields = line.split()
        width, ms = int(fields[1][1:]), float(fields[2][:-2])
        cells = [cell.split(":") for cell in fields[4:]]  # method:k:proposed:committed:ceiling
        methods = {cell[0] for cell in cells}
        load = "mixed" if methods == {"pl", "lo"} else ("lookup-chain" if "lo" in methods else "plain")
        drafting = sum(1 for cell in cells if int(cell[2]) > 0)
        yield load, width, drafting, sum(int(cell[3]) for cell in cells), ms


def main(path: str) -> None:
    groups = collections.defaultdict(lambda: [0, 0.0, 0])
    plain = collections.defaultdict(lambda: [0, 0.0])
    for load, width, drafting, tokens, ms in rounds(path):
        group = groups[(load, width, drafting)]
        group[0], group[1], group[2] = group[0] + tokens, group[1] + ms, group[2] + 1
        if drafting == 0:
            plain[width][0] += tokens
            plain[width][1] += ms
    per_token = {width: ms / tokens for width, (tokens, ms) in plain.items()}
    print("load          width drafting rounds tokens seconds tok/s  beyond plain rounds (s)")
    for load in ("plain", "lookup-chain", "mixed"):
        totals = [0, 0.0]
        for (name, width, drafting), (tokens, ms, count) in sorted(groups.items()):
            if name != load:
                continue
            beyond = (ms - tokens * per_token[width]) / 1000 if width in per_token else float("nan")
            totals[0], totals[1] = totals[0] + tokens, totals[1] + ms
            print(
                f"{load:13s} {width:5d} {drafting:8d} {count:6d} {tokens:6d} {ms / 1000:7.2f}"
                f" {1000 * tokens / ms:5.1f}  {beyond:+.2f}"
            )
        print(f"{load:13s} all: {totals[0]} tokens in {totals[1] / 1000:.1f} s of rounds")
        wide = [(t, ms) for (n, w, _), (t, ms, _) in groups.items() if n == load and w == 4]
        tokens, ms = sum(t for t, _ in wide), sum(ms for _, ms in wide)
        print(f"{load:13s} at width 4 only: {1000 * tokens / ms:.1f} tok/s")


if __name__ == "__main__":
    main(sys.argv[1])
