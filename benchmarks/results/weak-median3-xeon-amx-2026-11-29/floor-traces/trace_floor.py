"""`specgen ...` with every `Floor.record` call logged: the round's inputs (k, tokens, seconds,
the verify's seconds and cost, the plain step where measured) and the floor's state after it
(ceiling, mean speed-up, its error, rounds counted). Throwaway instrumentation:

    python trace_floor.py OUT.json run --prompts-file one.jsonl --method chain -n 64 --format json
"""

import json
import sys

from specgen.cli.app import main
from specgen.decoding import floor

LOG: list[dict] = []
OUT = sys.argv.pop(1)
_record = floor.Floor.record


def record(self, k, tokens, seconds, verify_seconds, plain, verify=None, tree=False, idle=0.0):
    _record(self, k, tokens, seconds, verify_seconds, plain, verify, tree, idle)
    LOG.append(
        {
            "k": k,
            "tokens": tokens,
            "seconds": seconds,
            "verify_seconds": verify_seconds,
            "plain": plain,
            "verify": verify,
            "idle": idle,
            "ceiling": self.ceiling,
            "mean": self.speedup.value,
            "error": self.speedup.error,
            "n": self.speedup.count,
        }
    )
    with open(OUT, "w") as fh:
        json.dump(LOG, fh)


floor.Floor.record = record
sys.argv[0] = "specgen"
main()
