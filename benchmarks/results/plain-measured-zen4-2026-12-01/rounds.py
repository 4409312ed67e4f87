"""A row's rounds against the plain step, per generation: total, prefill (outside the rounds), the
rounds, the plain method's round, and the plain step the drafting rounds' verifies imply at the
device's price (verify seconds / VerifyCost.steps).

    python rounds.py PROMPT_ID[,ID] METHOD[,METHOD] TOKENS REPEATS

Prompt ids are those of benchmarks/results/tree-stop-zen4-2026-12-01/set.jsonl."""

import sys
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

ids, methods, n, reps = sys.argv[1].split(","), sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4])
prompts = {
    p.id: p
    for p in load_prompts(
        str(Path(__file__).resolve().parents[1] / "tree-stop-zen4-2026-12-01" / "set.jsonl")
    )
}
pair = load(MODELS, Method.CHAIN)
generation, choice = resolve_draft_length(pair, generation_config(method="chain", max_new_tokens=n), True)
rounds = []
orig = floor.PlainSteps.measure


def measure(self, rows, ks, proposals, results, seconds, verify_seconds, cost):
    rounds.append(
        (
            seconds,
            verify_seconds,
            sum(len(r.emitted) for r in results),
            proposals[0].size,
            None if cost is None else cost.steps(proposals[0].size),
        )
    )
    orig(self, rows, ks, proposals, results, seconds, verify_seconds, cost)


floor.PlainSteps.measure = measure
for pid in ids:
    p = prompts[pid]
    prompt_ids = encode_all(pair.target.tokenizer, [p], pair.target.context_length)[0]
    print(pid, len(prompt_ids), "prompt tokens")
    for rep in range(reps):
        for m in methods:
            rounds.clear()
            g = EngineRunner(pair, Method(m)).generate(prompt_ids, generation)
            rs = sum(r[0] for r in rounds)
            drafting = [r for r in rounds[1:] if r[3]]
            plainr = [r for r in rounds if not r[3]]
            implied = [r[1] / r[4] for r in drafting if r[4]]
            line = (
                f"  {m:13s} {len(g.token_ids) / g.seconds:6.2f} tok/s total {g.seconds:.2f} rounds {rs:.2f}"
                f" outside {g.seconds - rs:.2f} first {rounds[0][0] * 1000:.0f}ms n={len(rounds)}"
            )
            if plainr:
                line += f" plain-round {1000 * sum(r[0] for r in plainr) / len(plainr):.1f}ms"
            if implied:
                line += (
                    f" implied-plain {1000 * sum(implied) / len(implied):.1f}ms"
                    f" drafting-rounds {len(drafting)}"
                    f" tok {sum(r[2] for r in drafting)} sec {sum(r[0] for r in drafting):.2f}"
                )
            print(line, flush=True)
