"""Tokens per target forward at equal tree budgets (benchmarks/trees.md).

Chain drafting (k = 3 and 4) against multi-draft (i.i.d. children, with replacement),
RSD-C (Gumbel-top-k, without replacement) and RSD-S (stochastic beam search) with the same
number of draft nodes scored per target forward, at temperature 1, on the default pair.

    python benchmarks/tree_budget.py --prompts all --limit 3 --max-new-tokens 32 --json out.json

Block efficiency (tokens per target forward) does not depend on the machine's speed, so it
is the headline figure; tokens/s is reported too, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch

from specgen.bench.prompts import encode, load_prompts
from specgen.config import GenerationConfig, Method, ModelSettings, SamplingConfig
from specgen.decoding.build import build_engine
from specgen.decoding.run import timed
from specgen.runtime.pair import load

CONFIGS = {
    "chain k=3": dict(method=Method.CHAIN, draft_tokens=3),
    "chain k=4": dict(method=Method.CHAIN, draft_tokens=4),
    "multi-draft (2,2) [6]": dict(method=Method.MULTI_DRAFT, branching=(2, 2)),
    "rsd-c (2,2) [6]": dict(method=Method.RSD_C, branching=(2, 2)),
    "rsd-s W2 L3 [6]": dict(method=Method.RSD_S, beam_width=2, depth=3),
    "multi-draft (3,3) [12]": dict(method=Method.MULTI_DRAFT, branching=(3, 3)),
    "rsd-c (3,3) [12]": dict(method=Method.RSD_C, branching=(3, 3)),
    "rsd-s W3 L4 [12]": dict(method=Method.RSD_S, beam_width=3, depth=4),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", default="all")
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--configs", default=";".join(CONFIGS), help="semicolon-separated config names")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    names = [n.strip() for n in args.configs.split(";") if n.strip()]
    pair = load(ModelSettings(args.target, args.draft), Method.CHAIN, quiet=True)
    prompts = [(p, encode(pair.target.tokenizer, p)) for p in load_prompts(args.prompts, args.limit)]
    rows = {name: [] for name in names}
    for number, (item, ids) in enumerate(prompts):
        for name in names:  # interleaved prompt by prompt
            config = GenerationConfig(
                max_new_tokens=args.max_new_tokens,
                sampling=SamplingConfig(temperature=args.temperature, seed=1000 + number),
                **CONFIGS[name],
            )
            _, stats, _, _ = timed(build_engine(pair, config), ids, config, label=name)
            rows[name].append({"prompt": item.id, "category": item.category, **stats.as_dict()})
            print(
                f"{item.id:18s} {name:24s} {stats.tokens_per_target_forward:5.2f} tok/fwd "
                f"{stats.tokens_per_second:5.2f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    summary = {}
    for name in names:
        tpf = [r["tokens_per_target_forward"] for r in rows[name]]
        tps = [r["tokens_per_second"] for r in rows[name]]
        summary[name] = {
            "budget": GenerationConfig(**CONFIGS[name]).tree_budget,
            "tokens_per_target_forward_mean": round(statistics.mean(tpf), 3),
            "tokens_per_target_forward_stderr": round(statistics.stdev(tpf) / math.sqrt(len(tpf)), 3)
            if len(tpf) > 1
            else 0.0,
            "tokens_per_second_median": round(statistics.median(tps), 3),
            "prompts": len(tpf),
        }
    print("| config | budget | tokens/target forward (mean ± s.e.) | tok/s (median) |")
    print("|---|---|---|---|")
    for name, s in summary.items():
        print(
            f"| {name} | {s['budget']} | {s['tokens_per_target_forward_mean']} ± "
            f"{s['tokens_per_target_forward_stderr']} | {s['tokens_per_second_median']} |"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "settings": vars(args),
                    "threads": torch.get_num_threads(),
                    "summary": summary,
                    "runs": rows,
                },
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
