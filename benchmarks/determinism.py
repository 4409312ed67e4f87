"""How often does the output depend on method, draft length or batch without --deterministic?

Runs each prompt under several settings (plain, chain k=2/4, rsd-c, and batched plain with
batch sizes 1/3/8) with and without deterministic mode, and counts prompts whose tokens differ
from plain decoding of the same prompt alone. Reported, never asserted (benchmarks/exactness.md).

    python benchmarks/determinism.py --prompts quick --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import json

from specgen.bench.prompts import encode, load_prompts
from specgen.config import GenerationConfig, Method, ModelSettings
from specgen.decoding.build import build_engine
from specgen.decoding.run import run_prompts
from specgen.runtime.pair import load

SETTINGS = {
    "plain": dict(method=Method.PLAIN),
    "chain k=2": dict(method=Method.CHAIN, draft_tokens=2),
    "chain k=4": dict(method=Method.CHAIN, draft_tokens=4),
    "rsd-c (2,1)": dict(method=Method.RSD_C, branching=(2, 1)),
}


def tokens(pair, ids, **settings):
    config = GenerationConfig(**settings)
    engine = build_engine(pair, config)
    return next(run_prompts(engine, pair.target.tokenizer, [ids], config))[1].token_ids


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", default="quick")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    pair = load(
        ModelSettings("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"), Method.CHAIN, quiet=True
    )
    items = load_prompts(args.prompts, args.limit)
    prompts = [encode(pair.target.tokenizer, item) for item in items]
    report = {}
    for deterministic in (False, True):
        extra = dict(
            max_new_tokens=args.max_new_tokens, deterministic=deterministic, verify_window=args.window
        )
        outputs = {name: [tokens(pair, ids, **s, **extra) for ids in prompts] for name, s in SETTINGS.items()}
        for size in (3, 8):
            config = GenerationConfig(method=Method.PLAIN, **extra)
            by_index = dict(
                run_prompts(build_engine(pair, config), pair.target.tokenizer, prompts, config, size)
            )
            outputs[f"batch {size}"] = [by_index[i].token_ids for i in range(len(prompts))]
        reference = outputs["plain"]
        differ = {name: sum(o != r for o, r in zip(out, reference)) for name, out in outputs.items()}
        report["deterministic" if deterministic else "fast only"] = differ
        print(
            ("deterministic" if deterministic else "fast only"),
            {name: f"{n}/{len(prompts)} differ" for name, n in differ.items()},
            flush=True,
        )
    if args.json:
        json.dump({"settings": vars(args), "differ_from_plain": report}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
