"""Each round's time in lookup's rows by the tokens it proposed, against plain decoding's rounds:
plain and lookup in turn, three times per prompt, 64 tokens, the default pair, every default.

    python benchmarks/results/lookup-multi-xeon-amx-2026-12-03/rounds.py all.jsonl explain-09,translate-06

Prints each generation's tok/s and its drafting rounds (proposed:committed), then per method and
tokens proposed the rounds' count and median milliseconds (each generation's first round, which
holds the prompt's catch-up, left out)."""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/

from draft_reads import MODELS  # noqa: E402

from specgen.bench.prompts import encode_all, load_prompts  # noqa: E402
from specgen.bench.runners import EngineRunner  # noqa: E402
from specgen.cli.options import generation_config  # noqa: E402
from specgen.config import Method  # noqa: E402
from specgen.decoding import floor  # noqa: E402
from specgen.decoding.build import resolve_draft_length  # noqa: E402
from specgen.runtime.pair import load  # noqa: E402

rounds: list[tuple[int, int, float]] = []
measure_before = floor.PlainSteps.measure


def measure(self, rows, ks, proposals, results, seconds, verify_seconds, cost):
    measure_before(self, rows, ks, proposals, results, seconds, verify_seconds, cost)
    rounds.append((proposals[0].size, len(results[0].emitted), seconds))


def main() -> None:
    prompts = {p.id: p for p in load_prompts(sys.argv[1])}
    pair = load(MODELS, Method.LOOKUP, quiet=True)
    config, _ = resolve_draft_length(pair, generation_config(method="lookup", max_new_tokens=64), True)
    floor.PlainSteps.measure = measure
    for pid in sys.argv[2].split(","):
        ids = encode_all(pair.target.tokenizer, [prompts[pid]], pair.target.context_length)[0]
        by = defaultdict(list)
        for _ in range(3):
            for name in ("plain", "lookup"):
                rounds.clear()
                method = Method(name)
                generation = EngineRunner(pair, method).generate(ids, replace(config, method=method))
                for proposed, _, seconds in rounds[1:]:
                    by[(name, proposed)].append(seconds)
                drafting = " ".join(f"{p}:{c}" for p, c, _ in rounds if p)
                print(
                    pid,
                    name,
                    f"{len(generation.token_ids) / generation.seconds:.2f} tok/s",
                    drafting,
                    flush=True,
                )
        for (name, proposed), seconds in sorted(by.items()):
            print(pid, name, proposed, len(seconds), f"median {1000 * statistics.median(seconds):.1f} ms")


if __name__ == "__main__":
    main()
