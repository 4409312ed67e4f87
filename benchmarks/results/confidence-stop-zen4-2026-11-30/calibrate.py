"""The draft's confidence against its acceptance, and the confidence stop replayed at several
thresholds, from record.py's rounds (chain at k = 5, every draft step's top probability).

A drafted token counts where every token before it in its round was accepted. The replay cuts
each recorded round where a stop at T would have cut it (after token i once the product of the
top probabilities p_1 .. p_i is below T), keeps the accepted tokens up to there, and prices the
round at DRAFT plain steps a drafted token and a verify of 1 + SLOPE a token: tokens over plain
steps, over all of a prompt's rounds. It ignores that a cut round moves the next round's start,
and the draft's prompt read, so it ranks thresholds rather than predicting speed-ups.

    python benchmarks/results/confidence-stop-zen4-2026-11-30/calibrate.py rounds-k5.json
"""

import json
import math
import sys

DRAFT, SLOPE = 0.39, 0.01  # a draft step in the loop and a verify's next token, in plain steps
THRESHOLDS = (0.5, 0.6, 0.65, 0.7, 0.75, 0.8)


def calibration(rounds) -> str:
    told = right = count = 0
    bins = {}
    for drafted, accepted, tops in rounds:
        for i, top in enumerate(tops[:drafted]):
            if i > accepted:
                break
            told, right, count = told + top, right + (accepted > i), count + 1
            cell = bins.setdefault(min(int(top * 5), 4), [0, 0])
            cell[0] += accepted > i
            cell[1] += 1
    cells = " ".join(f"[{b / 5:.1f}, {(b + 1) / 5:.1f}) {r}/{n}" for b, (r, n) in sorted(bins.items()))
    return f"n {count:3}  mean top {told / count:.2f}  accepted {right / count:.2f}  {cells}"


def replay(rounds, threshold: float) -> float:
    tokens = steps = 0.0
    for drafted, accepted, tops in rounds:
        if drafted < 5 or len(tops) < 4:
            continue
        reach, kept = 1.0, 5
        for i, top in enumerate(tops):
            reach *= top
            if reach < threshold:
                kept = i + 1
                break
        tokens += min(accepted, kept) + 1
        steps += kept * DRAFT + 1 + SLOPE * kept
    return tokens / steps


def main() -> None:
    recorded = json.load(open(sys.argv[1]))
    print("the draft's top probability against acceptance, drafted tokens reached:")
    for prompt, rounds in recorded.items():
        print(f"  {prompt:14} {calibration(rounds)}")
    print("\ntokens per plain step, the stop replayed at T:")
    print(f"  {'':14}" + "".join(f"{t:>7}" for t in THRESHOLDS))
    table = {t: [replay(rounds, t) for rounds in recorded.values()] for t in THRESHOLDS}
    for j, prompt in enumerate(recorded):
        print(f"  {prompt:14}" + "".join(f"{table[t][j]:7.3f}" for t in THRESHOLDS))
    geomeans = "".join(f"{math.exp(sum(map(math.log, v)) / len(v)):7.3f}" for v in table.values())
    print(f"  {'geomean':14}" + geomeans)
    print(f"  {'minimum':14}" + "".join(f"{min(v):7.3f}" for v in table.values()))


if __name__ == "__main__":
    main()
