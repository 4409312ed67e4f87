"""Skipping layers of the draft model (a throwaway probe, not in specgen): bench columns
METHOD@VARIANT[/sA-B,C], where VARIANT is draft_reads.py's and /s lists the draft layers its lean
forward skips (their K/V is never written or read).

    python skip.py --prompts prompts.jsonl --columns "chain@k3;chain@k3/s21;chain@k3/s18-21" --json a.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import draft_reads  # noqa: E402
from draft_reads import VariantRunner  # noqa: E402

from specgen.runtime import lean  # noqa: E402

SKIP: set[int] = set()
DRAFT = None
_call = lean.LeanForward.__call__


def patched(self, *args, **kwargs):
    if self.model is DRAFT:
        if not hasattr(self, "_all"):
            self._all = self.layers
        self.layers = [layer for layer in self._all if layer.index not in SKIP]
    return _call(self, *args, **kwargs)


lean.LeanForward.__call__ = patched


def parse(spec: str) -> set[int]:
    out = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        out |= set(range(int(first), int(last or first) + 1))
    return out


class SkipRunner(VariantRunner):
    def __init__(self, pair, method, variant):
        global DRAFT
        DRAFT = pair.draft.model
        variant, _, skip = variant.partition("/s")
        super().__init__(pair, method, variant)
        self.skip = parse(skip) if skip else set()
        self.name = f"{self.name}/s{skip}" if skip else self.name

    def generate(self, prompt_ids, config):
        global SKIP
        SKIP = self.skip
        try:
            return super().generate(prompt_ids, config)
        finally:
            SKIP = set()


if __name__ == "__main__":
    draft_reads.main(SkipRunner, separator=";")  # columns hold commas ("/s12,14")
