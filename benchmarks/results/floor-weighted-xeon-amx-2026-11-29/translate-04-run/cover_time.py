"""`specgen ...` with each `PrunedHead.cover` call's blocks and seconds appended to cover.log.
Throwaway instrumentation: python cover_time.py run --prompts-file t04.jsonl --method chain -n 64"""

import sys
import time

from specgen.cli.app import main
from specgen.runtime import pruned

_cover = pruned.PrunedHead.cover


def cover(self, chosen):
    started = time.perf_counter()
    _cover(self, chosen)
    with open("cover.log", "a") as fh:
        fh.write(repr(("cover", chosen, round(time.perf_counter() - started, 4))) + "\n")


pruned.PrunedHead.cover = cover
sys.argv[0] = "specgen"
main()
