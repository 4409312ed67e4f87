"""`specgen ...` with the pruned draft head's covering rule chosen: what packing the vocabulary
blocks a text lives in costs and gives, against packing the whole head or never packing.

    python benchmarks/head_cover.py MODE bench --prompts zh.jsonl --methods plain,chain -n 64 --json out.json

MODE:
- `scripts`: as specgen runs (runtime/pruned.py: once three different ids of one script are
  among the last 128 read outside the kept ids, every id of that script; then the blocks' rule);
- `blocks`: the blocks' rule alone (once three different ids of one block of 4096 are among
  them, every block with two or more), as specgen ran before scripts;
- `whole`: one block of every id, the former widening of the whole head at once;
- `never`: the head keeps its static ids and the ids it read one by one, whatever the text.

Each covering prints its blocks, ids and seconds on stderr. Covering happens once per process
(for the first text in another script), so compare modes in separate processes, interleaved,
several times: `results/head-cover-xeon-amx-2026-11-28/` and floor.md's "Draft heads for other
scripts" section.
"""

import sys
import time

from specgen.runtime import pruned

MODES = ("scripts", "blocks", "whole", "never")

if len(sys.argv) < 2 or sys.argv[1] not in MODES:
    sys.exit(f"usage: head_cover.py {{{','.join(MODES)}}} SPECGEN-ARGS...")
mode = sys.argv.pop(1)
if mode == "never":
    pruned.TRIP = 1 << 30  # more ids than a block or a script has
elif mode == "blocks":
    pruned.Scripts.tripped = lambda self, ids: []  # no script trips
elif mode == "whole":
    pruned.PrunedHead.__init__.__defaults__ = (1 << 30, None)
    pruned.prune_head.__defaults__ = ((), 1 << 30, None)

_pack = pruned.PrunedHead.pack


def _timed(self, groups):
    start = time.perf_counter()
    _pack(self, groups)
    ids = sum(len(i) for i in self.block_ids)
    print(
        f"cover: {len(self.block_ids)} products, {ids} ids, {time.perf_counter() - start:.3f} s",
        file=sys.stderr,
    )


pruned.PrunedHead.pack = _timed

from specgen.cli import main  # noqa: E402  (after the patches, which the model's load reads)

main()
