"""`specgen ...` with every chain round's draft confidences recorded: per round, the draft's top
probability at each step the confidence stop read, how many tokens it proposed and how many
the target accepted. Throwaway instrumentation (wraps length.unsure and the chain drafter):

    python record_rounds.py OUT.json run --prompts-file one.jsonl --method chain -n 64 --format json

Then `python simulate.py *-rounds.json` replays the rounds under a calibrated stop."""

import json
import sys

from specgen.cli.app import main
from specgen.decoding.drafters import model

ROUNDS: list[dict] = []
OUT = sys.argv.pop(1)
_unsure, _propose, _observe = model.unsure, model.ChainDrafter.propose, model.ChainDrafter.observe


def unsure(threshold, logits, probs=None, reach=None):
    stop, new = _unsure(threshold, logits, probs, reach)
    if reach is None:
        ROUNDS.append({"tops": [], "proposed": None, "accepted": None})
    top = new if reach is None else new / reach
    ROUNDS[-1]["tops"].append(float(top.reshape(-1)[0]))
    return stop, new


def propose(self, *args, **kwargs):
    out = _propose(self, *args, **kwargs)
    if ROUNDS and ROUNDS[-1]["proposed"] is None:
        ROUNDS[-1]["proposed"] = int(out[0].size)
    return out


def observe(self, row, path):
    if ROUNDS and ROUNDS[-1]["accepted"] is None:
        ROUNDS[-1]["accepted"] = len(path)
        with open(OUT, "w") as fh:
            json.dump(ROUNDS, fh)
    return _observe(self, row, path)


model.unsure, model.ChainDrafter.propose, model.ChainDrafter.observe = unsure, propose, observe
sys.argv[0] = "specgen"
main()
