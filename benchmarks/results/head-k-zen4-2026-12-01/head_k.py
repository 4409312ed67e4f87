"""An EAGLE-3 head's k under its stop: the device's (`costs.choose`) against the 4 a head drafted
before it had one, both with the floor and the head's priced stop, as columns of one process.

    python head_k.py --prompts set.jsonl --head HEAD -n 64 --json OUT.json
    python benchmarks/per_prompt.py OUT.json
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from draft_reads import write  # noqa: E402

from specgen.bench.measure import BenchSettings, run_bench
from specgen.bench.prompts import load_prompts
from specgen.bench.runners import EngineRunner
from specgen.cli.options import generation_config
from specgen.config import Method, ModelSettings
from specgen.decoding.build import resolve_draft_length
from specgen.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specgen.runtime.pair import load, load_draft_alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--head", required=True)
    parser.add_argument("-n", "--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    models = ModelSettings(
        DEFAULT_TARGET, DEFAULT_DRAFT, draft_quant="auto", target_quant="auto", compile="auto"
    )
    pair = load(models, Method.PLAIN)
    head = replace(pair, draft=load_draft_alone(replace(models, draft=args.head), pair.target))
    asked = generation_config(method="eagle", max_new_tokens=args.max_new_tokens)
    generation, choice = resolve_draft_length(head, asked, True)  # the head's k and stop, the floor on
    print(f"the head: k={choice.k} ({choice.reason})", file=sys.stderr)
    runners = [
        EngineRunner(pair, Method.PLAIN),
        EngineRunner(head, Method.EAGLE, f"eagle@k{generation.draft_tokens}"),
    ]
    runners += [EngineRunner(head, Method.EAGLE, f"eagle@k{k}", {"draft_tokens": k}) for k in (4, 2)]
    settings = BenchSettings(generation=generation, repeats=args.repeats)
    write(run_bench(pair, [], load_prompts(args.prompts), settings, runners=runners), args.json)


if __name__ == "__main__":
    main()
