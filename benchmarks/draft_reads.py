"""What a CPU draft should read of a prompt: bench's per-prompt measurement with columns that
differ only in it, against plain decoding, in one process.

    python benchmarks/draft_reads.py --prompts SET --columns lookup-chain@w512,lookup-chain@w64 \
        [-n 64] [--repeats 1] --json OUT.json
    python benchmarks/per_prompt.py OUT.json --table

A column is METHOD@VARIANT:
- `wN`: the draft reads at most a prompt's last N tokens (`drafters.model.WINDOW`, 512 by default);
- `always`: every row reads its prompt, however dear (no read rule: `costs.read_price` None);
- `kN`: a fixed draft length N, with no floor and no confidence stop (what a row whose floor
  settled at N would draft, from its first round);
- `point`: the floor acts on its point estimate (its standard error taken as 0): a row whose
  rounds so far lose lowers its draft at once, where specgen waits for a clear loss;
- `zero`: the floor held at plain rounds from the first round to the last (no draft, no probe):
  what a row at its floor costs against plain decoding, with the method's machinery around it;
- `default`: as specgen runs.

On a CPU a draft model reads a prompt at about a fifth of the target's cost a token (4.7 ms a
token on a 2-core AVX2 EPYC, where a plain step takes 120-140 ms): a 300-token prompt costs
about ten plain steps before the first draft, a sixth of a 64-token answer's decoding. A window
makes that read cheaper and the proposals worse (prompt lookup still copies from the whole
prompt); the read rule skips the draft where the read costs more than drafting can save.

Every column runs in this one process, through bench's own runner and order (plain first, the
order reversed every turn), so the columns of a prompt share the machine's state. The output is
a bench JSON file, read by `per_prompt.py`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from specgen.bench import report, table
from specgen.bench.measure import BenchSettings, run_bench
from specgen.bench.prompts import load_prompts
from specgen.bench.runners import EngineRunner
from specgen.cli.options import generation_config
from specgen.config import Method, ModelSettings
from specgen.decoding import costs, floor
from specgen.decoding.build import resolve_draft_length
from specgen.decoding.drafters import model as chain_model
from specgen.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specgen.runtime.pair import load, load_draft_alone

MODELS = ModelSettings(DEFAULT_TARGET, DEFAULT_DRAFT, draft_quant="auto", target_quant="auto", compile="auto")


class VariantRunner(EngineRunner):
    """An engine method whose draft reads a prompt as `variant` says (see the module)."""

    def __init__(self, pair, method: Method, variant: str):
        fixed = {
            "draft_tokens": int(variant[1:]) if variant.startswith("k") else 0,
            "device_draft_tokens": False,
            "device_confidence": False,
            "draft_confidence": 0.0,
            "floor": False,
        }
        overrides = fixed if variant.startswith("k") else None
        super().__init__(pair, method, name=f"{method.value}@{variant}", overrides=overrides)
        self.variant = variant

    def generate(self, prompt_ids, config):
        window, price, error = chain_model.WINDOW, costs.read_price, floor._Mean.error
        limit = floor.Floor.limit
        if self.variant == "zero":
            floor.Floor.limit = lambda row: 0
        if self.variant == "point":
            floor._Mean.error = property(lambda mean: 0.0)
        if self.variant.startswith("w"):
            chain_model.WINDOW = int(self.variant[1:])
        elif self.variant == "always":
            costs.read_price = lambda pair: None
        try:
            return super().generate(prompt_ids, config)
        finally:
            chain_model.WINDOW, costs.read_price, floor._Mean.error = window, price, error
            floor.Floor.limit = limit


def main(runner: type[VariantRunner] = VariantRunner, separator: str = ",") -> None:
    """Bench's runner with plain and the `--columns` (split at `separator`), each a `runner`:
    a script that varies something else (results/draft-layer-skip-*/skip.py) brings its own."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True, help="a prompt set or JSONL file, as bench takes")
    parser.add_argument("--columns", default="lookup-chain@default,lookup-chain@always")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    pair = load(MODELS, Method.CHAIN)
    asked = generation_config(method="chain", max_new_tokens=args.max_new_tokens)  # bench's defaults
    generation, choice = resolve_draft_length(pair, asked, True)
    if choice is not None:
        print(f"draft length k={choice.k} ({choice.reason})", file=sys.stderr)
    runners = [EngineRunner(pair, Method.PLAIN)]
    for column in args.columns.split(separator):
        method, _, variant = column.partition("@")
        runners.append(runner(pair, Method(method), variant or "default"))
    settings = BenchSettings(generation=generation, repeats=args.repeats)
    write(run_bench(pair, [], load_prompts(args.prompts), settings, runners=runners), args.json)


def write(result, path: Path) -> None:
    """A run's bench JSON file, with the CPU's flags beside it, and bench's table."""
    flags = "lscpu | grep -o -w -E 'avx|avx2|avx512[a-z_0-9]*|amx[a-z_0-9]*|f16c|fma' | sort -u"
    result.environment["cpu_flags"] = " ".join(
        subprocess.run(flags, shell=True, capture_output=True, text=True).stdout.split()
    )
    report.write_json(result, path)
    Console(width=160).print(table.table(result))


if __name__ == "__main__":
    main()


def head_overrides(head, max_new_tokens: int) -> dict:
    """The draft length and stop the device gives a head's chains (a head column's overrides)."""
    asked = generation_config(method="eagle", max_new_tokens=max_new_tokens)
    own, _ = resolve_draft_length(head, asked, True)
    return {"draft_tokens": own.draft_tokens, "draft_confidence": own.draft_confidence}


def head_run(description: str, load_as: Method):
    """A script that runs columns with an EAGLE-3 head beside the default pair: its arguments
    (--prompts, --head, -n, --repeats, --json), the default pair loaded for `load_as`, and that
    pair with the head as its draft."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--head", required=True)
    parser.add_argument("-n", "--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    pair = load(MODELS, load_as)
    return args, pair, replace(pair, draft=load_draft_alone(replace(MODELS, draft=args.head), pair.target))
