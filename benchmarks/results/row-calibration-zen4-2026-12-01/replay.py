"""A row's own calibration of the confidence stop, replayed on recorded rounds.

The draft is overconfident on German and underconfident on English prose (floor.md, "The
confidence stop priced by the draft's cost"). Could each row learn its own factor? Here a row
keeps A, the drafted tokens accepted, and P, the sum of their top probabilities, over its
rounds so far (tokens that its round reached: every token before them accepted), and scales
every top probability by g = (A + n0) / (P + n0) before the stop compares the product with T
(`down`: g at most 1, so it only cuts). The replay is calibrate.py's: rounds recorded by
record.py at a fixed k = 5, each cut where the stop would have cut it, priced at DRAFT plain
steps a drafted token and a verify of 1 + SLOPE a token; it ranks rules, it does not predict
speed-ups.

    python benchmarks/results/row-calibration-zen4-2026-12-01/replay.py \
        benchmarks/results/confidence-stop-zen4-2026-11-30/rounds-k5.json
"""

import json
import math
import sys

DRAFT, SLOPE = 0.39, 0.01  # as calibrate.py
K = 5


def replay(rounds, threshold: float, n0: float | None = None, down: bool = False) -> float:
    tokens = steps = accepted_sum = told = 0.0
    for drafted, accepted, tops in rounds:
        if drafted < K or len(tops) < K - 1:
            continue
        g = 1.0 if n0 is None else (accepted_sum + n0) / (told + n0)
        g = min(g, 1.0) if down else g
        reach, kept = 1.0, K
        for i, top in enumerate(tops):
            reach *= min(1.0, g * top)
            if reach < threshold:
                kept = i + 1
                break
        tokens += min(accepted, kept) + 1
        steps += kept * DRAFT + 1 + SLOPE * kept
        for i in range(min(kept, len(tops))):  # what the row saw of its round
            if i > accepted:
                break
            accepted_sum += accepted > i
            told += tops[i]
    return tokens / steps


def main() -> None:
    recorded = json.load(open(sys.argv[1]))
    names = list(recorded)
    print("tokens per plain step; columns: " + ", ".join(names))
    for threshold in (0.5, 0.65, 0.7):
        for n0, down in [(None, False)] + [(n, d) for n in (2, 4, 8, 16) for d in (False, True)]:
            values = [replay(recorded[name], threshold, n0, down) for name in names]
            geo = math.exp(sum(map(math.log, values)) / len(values))
            label = f"T {threshold}" + ("" if n0 is None else f", n0 {n0}" + (", down" if down else ""))
            cells = " ".join(f"{v:.3f}" for v in values)
            print(f"{label:22} geomean {geo:.3f}  min {min(values):.3f}  {cells}")


if __name__ == "__main__":
    main()
