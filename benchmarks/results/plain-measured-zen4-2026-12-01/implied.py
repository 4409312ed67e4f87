"""The floor as it is against two others, as columns of one process (bench's runner and order,
`draft_reads.py`):

    python implied.py --prompts SET --columns chain@default,chain@before,chain@implied [-n 64] --json OUT.json

- `METHOD@default`: the floor as it is;
- `METHOD@implied`: no plain rounds are explored (`PlainSteps.explore` answers no), so a lone
  row values its rounds at the plain step its verifies imply (the first run of this directory
  took it against a floor that explored plain rounds for every drafting row);
- `METHOD@before`: the floor of commit 06aaa5d (`git show 06aaa5d:specgen/decoding/floor.py`,
  run from the repository): a round's speed-up at the plain step its own verify implies at the
  device's price, wide or narrow, with plain rounds explored only where the bound was unsure.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

from draft_reads import VariantRunner, main  # noqa: E402

from specgen.decoding import floor, rows  # noqa: E402


def _before() -> type:
    source = subprocess.run(
        ["git", "show", "06aaa5d:specgen/decoding/floor.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    module = sys.modules["floor_before"] = types.ModuleType("floor_before")  # (dataclasses read it)
    exec(compile(source, "floor_before", "exec"), module.__dict__)

    class Before(module.Floor):
        def record(self, *args, proposed=None, **kwargs):  # the new keyword, unknown to it
            super().record(*args, **kwargs)

    return Before


class ImpliedRunner(VariantRunner):
    before = None

    def generate(self, prompt_ids, config):
        if self.variant not in ("implied", "before"):
            return super().generate(prompt_ids, config)
        explore, made = floor.PlainSteps.explore, rows.Floor
        if self.variant == "implied":
            floor.PlainSteps.explore = lambda self, width, unsure: False
        else:
            ImpliedRunner.before = ImpliedRunner.before or _before()
            rows.Floor = ImpliedRunner.before
        try:
            return super().generate(prompt_ids, config)
        finally:
            floor.PlainSteps.explore, rows.Floor = explore, made


if __name__ == "__main__":
    main(ImpliedRunner)
