"""An EAGLE-3 head's k under its stop: the device's (`costs.choose`) against the 4 a head drafted
before it had one, both with the floor and the head's priced stop, as columns of one process.

    python head_k.py --prompts set.jsonl --head HEAD -n 64 --json OUT.json
    python benchmarks/per_prompt.py OUT.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from draft_reads import head_run, write  # noqa: E402

from specgen.bench.measure import BenchSettings, run_bench
from specgen.bench.prompts import load_prompts
from specgen.bench.runners import EngineRunner
from specgen.cli.options import generation_config
from specgen.config import Method
from specgen.decoding.build import resolve_draft_length


def main() -> None:
    args, pair, head = head_run(__doc__.split("\n\n")[0], Method.PLAIN)
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
