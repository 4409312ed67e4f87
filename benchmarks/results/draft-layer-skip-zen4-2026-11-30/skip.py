"""Skipping layers of the draft model (a throwaway probe, not in specgen): bench columns
METHOD@VARIANT[/sA-B,C], where VARIANT is draft_reads.py's and /s lists the draft layers its lean
forward skips (their K/V is never written or read).

    python skip.py --prompts prompts.jsonl --columns "chain@k3;chain@k3/s21;chain@k3/s18-21" --json a.json
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from draft_reads import VariantRunner  # noqa: E402
from rich.console import Console  # noqa: E402

from specgen.bench import report  # noqa: E402
from specgen.bench.measure import BenchSettings, run_bench  # noqa: E402
from specgen.bench.prompts import load_prompts  # noqa: E402
from specgen.bench.runners import EngineRunner  # noqa: E402
from specgen.cli.options import generation_config  # noqa: E402
from specgen.config import Method, ModelSettings  # noqa: E402
from specgen.decoding.build import resolve_draft_length  # noqa: E402
from specgen.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402
from specgen.runtime import lean  # noqa: E402
from specgen.runtime.pair import load  # noqa: E402

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


parser = argparse.ArgumentParser()
parser.add_argument("--prompts", required=True)
parser.add_argument("--columns", required=True)
parser.add_argument("-n", type=int, default=64)
parser.add_argument("--repeats", type=int, default=1)
parser.add_argument("--json", required=True)
args = parser.parse_args()
pair = load(
    ModelSettings(DEFAULT_TARGET, DEFAULT_DRAFT, draft_quant="auto", target_quant="auto", compile="auto"),
    Method.CHAIN,
)
DRAFT = pair.draft.model
asked = generation_config(method="chain", max_new_tokens=args.n)
generation, choice = resolve_draft_length(pair, asked, True)
runners = [EngineRunner(pair, Method.PLAIN)]
for column in args.columns.split(";"):
    method, _, variant = column.partition("@")
    runners.append(SkipRunner(pair, Method(method), variant or "default"))
settings = BenchSettings(generation=generation, repeats=args.repeats)
result = run_bench(pair, [], load_prompts(args.prompts), settings, runners=runners)
report.write_json(result, args.json)
Console(width=200).print(report.table(result))
