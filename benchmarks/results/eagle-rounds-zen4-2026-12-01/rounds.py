"""Each round of a head's row against plain decoding, per prompt: plain and METHOD in turn,
REPEATS times; each generation's time, its rounds (drafting and plain) and, for METHOD, every
round as proposed:committed:milliseconds:ceiling:speed-up the floor read ('-': no ceiling yet;
None: no verdict yet).

    python benchmarks/results/eagle-rounds-zen4-2026-12-01/rounds.py \
        PROMPT_ID[,ID] TOKENS REPEATS HEAD [METHOD]

Prompt ids are those of benchmarks/results/tree-stop-zen4-2026-12-01/set.jsonl."""

import sys
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

ids, n, reps, head = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
method = sys.argv[5] if len(sys.argv) > 5 else "eagle"
here = Path(__file__).resolve().parents[1]
prompts = {p.id: p for p in load_prompts(str(here / "tree-stop-zen4-2026-12-01" / "set.jsonl"))}
pair = load(replace(MODELS, draft=head), Method(method))
config, choice = resolve_draft_length(pair, generation_config(method=method, max_new_tokens=n), True)
print("choice", choice)
plain_config = replace(config, method=Method.PLAIN)
rounds = []
measure_before = floor.PlainSteps.measure


def measure(self, rows, ks, proposals, results, seconds, verify_seconds, cost):
    measure_before(self, rows, ks, proposals, results, seconds, verify_seconds, cost)
    row = rows[0].floor
    read = row.speedup() if isinstance(row, floor.Floor) else None
    ceiling = getattr(row, "ceiling", floor.NONE)
    rounds.append(
        (
            seconds,
            len(results[0].emitted),
            proposals[0].size,
            "-" if ceiling >= floor.NONE else ceiling,
            None if read is None else round(read[0], 3),
        )
    )


def line(name: str, generation) -> str:
    total = sum(r[0] for r in rounds)
    drafting = [r for r in rounds if r[2]]
    plain = [r for r in rounds if not r[2]]
    return (
        f"  {name:8s} {len(generation.token_ids) / generation.seconds:6.2f} tok/s"
        f"  {generation.seconds:.2f}s  outside the rounds {generation.seconds - total:.2f}s"
        f"  rounds {len(rounds)}  drafting {len(drafting)} ({sum(r[0] for r in drafting):.2f}s,"
        f" {sum(r[1] for r in drafting)} tok, proposed {sum(r[2] for r in drafting)})"
        f"  plain {len(plain)} ({1000 * sum(r[0] for r in plain) / max(1, len(plain)):.1f} ms each)"
    )


floor.PlainSteps.measure = measure
for pid in ids:
    prompt_ids = encode_all(pair.target.tokenizer, [prompts[pid]], pair.target.context_length)[0]
    print(pid, len(prompt_ids), "prompt tokens", flush=True)
    for _ in range(reps):
        for name, run_config in (("plain", plain_config), (method, config)):
            rounds.clear()
            generation = EngineRunner(pair, Method(name)).generate(prompt_ids, run_config)
            print(line(name, generation), flush=True)
            if name != "plain":
                print("    " + " ".join(f"{r[2]}:{r[1]}:{1000 * r[0]:.0f}:{r[3]}:{r[4]}" for r in rounds))
