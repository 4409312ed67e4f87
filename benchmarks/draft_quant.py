"""Draft forward cost under each --draft-quant variant, measured in one process.

    python benchmarks/draft_quant.py [--draft qwen2.5-coder-0.5b-instruct] [--steps 24] [--context 200]
    python benchmarks/draft_quant.py --acceptance [-n 48] [-k 4]   # chain acceptance per variant

For each variant: load the draft as `specgen` would (bf16 on CPU), apply the variant, prefill a
`--context`-token prompt, then time `--steps` single-token forwards with the KV cache (the
draft's hot path). Reports ms per token, draft tokens/s, and the ratio to the unmodified
draft measured in the same run. Variants run in a rotating order over `--repeats` rounds so
machine drift hits them alike; the median is reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specgen.bench.prompts import encode, load_prompts
from specgen.config import GenerationConfig, Method, ModelSettings
from specgen.decoding.build import build_engine
from specgen.decoding.run import run_prompts
from specgen.models.compat import CACHE_ARG
from specgen.models.load import load_pair
from specgen.runtime import kvcache
from specgen.runtime.pair import load
from specgen.runtime.quant import DRAFT_CHOICES as QUANT_CHOICES
from specgen.runtime.quant import apply_draft_quant


def time_steps(model, context: int, steps: int) -> float:
    cache = kvcache.new_cache(model)
    ids = torch.arange(1000, 1000 + context).unsqueeze(0)
    with torch.inference_mode():
        model(input_ids=ids, **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1)
        token = torch.tensor([[1234]])
        model(input_ids=token, **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1)  # warm
        started = time.perf_counter()
        for _ in range(steps):
            logits = model(input_ids=token, **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1).logits
            token = logits[:, -1:].argmax(-1)
        int(token)
    return (time.perf_counter() - started) / steps


def acceptance(variants: list[str], max_new_tokens: int, k: int) -> None:
    """Chain acceptance on the quick set per variant (the target is the same in every run)."""
    print(
        f"chain k={k}, quick set, {max_new_tokens} new tokens, greedy: acceptance per --draft-quant variant"
    )
    print(f"{'variant':<16}{'acceptance':>11}{'tok/fwd':>9}")
    for name in variants:
        pair = load(
            ModelSettings(
                "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "cpu", None, "auto", name
            ),
            Method.CHAIN,
            quiet=True,
        )
        config = GenerationConfig(method=Method.CHAIN, max_new_tokens=max_new_tokens, draft_tokens=k)
        prompts = [encode(pair.target.tokenizer, item) for item in load_prompts("quick")]
        outcomes = [
            o for _, o in run_prompts(build_engine(pair, config), pair.target.tokenizer, prompts, config)
        ]
        stats = outcomes[0].stats
        for outcome in outcomes[1:]:
            stats = stats.merge(outcome.stats)
        print(f"{name:<16}{stats.acceptance_rate:>11.1%}{stats.tokens_per_target_forward:>9.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--variants", default=",".join(QUANT_CHOICES))
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--acceptance", action="store_true", help="measure chain acceptance instead of speed")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=48)
    parser.add_argument("-k", "--draft-tokens", type=int, default=4)
    args = parser.parse_args()
    variants = args.variants.split(",")
    if args.acceptance:
        acceptance(variants, args.max_new_tokens, args.draft_tokens)
        return
    models = {}
    for name in variants:
        loaded, _ = load_pair(args.draft, None, device="cpu", dtype="auto", quiet=True)
        models[name] = apply_draft_quant(loaded.model, name)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.repeats):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for name in order:
            times[name].append(time_steps(models[name], args.context, args.steps))
    base = statistics.median(times[variants[0]])
    print(
        f"draft {args.draft}, {args.context}-token context, {args.steps} steps x {args.repeats} repeats, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"{'variant':<16}{'ms/token':>10}{'tok/s':>8}{'vs ' + variants[0]:>12}")
    for name in variants:
        t = statistics.median(times[name])
        print(f"{name:<16}{t * 1000:>10.1f}{1 / t:>8.2f}{base / t:>11.2f}x")


if __name__ == "__main__":
    main()
