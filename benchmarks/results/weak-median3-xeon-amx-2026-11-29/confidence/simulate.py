"""Replay recorded chain rounds (record_rounds.py) under the confidence stop as it is and under
a calibrated one: the reach scaled by the row's own first-token acceptance over the draft's
first-token confidence so far (a prior of 4 tokens at 1.0, never above 1). A round can only be
shortened on paper, so this prices what calibration could save, in plain steps: a draft step
of C target steps, a verify of 1.10 + 0.033 per proposed token after the first (this Xeon).

    python simulate.py *-rounds.json"""

import json
import sys

C, STOP = 0.38, 0.5


def verify(m: int) -> float:
    return 1.0 if m == 0 else 1.10 + 0.033 * (m - 1)


for path in sys.argv[1:]:
    with open(path) as fh:
        rounds = [r for r in json.load(fh) if r["proposed"] is not None and r["accepted"] is not None]
    base = [0.0, 0.0]
    calibrated = [0.0, 0.0]
    predicted = accepted = 4.0
    for r in rounds:
        m, a, tops = r["proposed"], min(r["accepted"], r["proposed"]), r["tops"]
        base[0] += a + 1
        base[1] += m * C + verify(m)
        factor, reach, shorter = min(1.0, accepted / predicted), 1.0, m
        for i, top in enumerate(tops[:m]):
            reach *= top
            if factor * reach < STOP:
                shorter = i + 1
                break
        calibrated[0] += min(a, shorter) + 1
        calibrated[1] += shorter * C + verify(shorter)
        predicted += tops[0]
        accepted += 1.0 if a >= 1 else 0.0
    print(
        f"{path.split('/')[-1][:-12]:<14} rounds {len(rounds):3d}  speed-up as is {base[0] / base[1]:.3f}"
        f"  calibrated {calibrated[0] / calibrated[1]:.3f}"
        f"  first-token acceptance / confidence {accepted / predicted:.2f}"
    )
