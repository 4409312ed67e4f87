"""GPU speed: specgen against transformers' own generate, on random-weight models of real shapes.

Usage (on a CUDA machine; nothing is downloaded):
    python benchmarks/gpu_speed.py OUT.json [--shapes q15,q7] [--new 128] [--modes graphs]
                                   [--ks 1,2,3,4] [--histogram benchmarks/results/quick-greedy.json]
    python benchmarks/gpu_speed.py OUT.json --synthetic benchmarks/results/quick-greedy.json[:chain]
                                   [--shapes q15,q7] [--modes inductor] [--skip costs]
A smoke run on the CPU (tiny shapes, eager, transformers' static cache not compiled there):
    python benchmarks/gpu_speed.py /tmp/smoke.json --device cpu --shapes tiny --draft tiny-draft \
        --modes off --new 32 --repeats 1 --skip hf-eager,costs --synthetic
        benchmarks/results/quick-greedy.json

Builds Qwen2 models with the exact shapes of Qwen2.5 0.5B / 1.5B / 7B (random bf16 weights,
lm_head scaled so greedy paths are not near-ties) and reports, in one run on one GPU:
  * transformers `generate`, eager (DynamicCache) and with `cache_implementation="static"`
    (compiled by transformers itself), greedy, N new tokens after a 64-token prompt;
  * specgen plain decoding and chain decoding at k = 1..4 with the 0.5B-shape draft, per
    fixed-shape mode (`graphs`: CUDA graphs; `inductor`: torch.compile reduce-overhead; `off`);
  * per-forward costs (ms) of each model at widths 1..5, eager and replayed;
  * with --eagle FILE[:method]: eagle-k{k} cells, an EAGLE-3 head of the target's shape (random
    weights, so its step costs what a trained head's does) with acceptance replayed from FILE's
    recording of `method` (default eagle: a bench of a trained head);
  * with --synthetic FILE[:method]: chain speed at k = 1..4 MEASURED end to end with synthetic
    acceptance (specgen/decoding/synthetic.py): each round accepts a length drawn from the
    accepted-length histogram that FILE (a `specgen bench --json` of the real pair) records for
    `method` (default chain), clipped to what the round drafted, and the target adds its own
    token; everything else (draft steps, verify, caches, rewinds) runs as for real acceptances.
    Reported against transformers' static-cache generate; every such figure is labelled
    "synthetic acceptance"; its speed is pooled over max(--repeats, 20) runs, each replaying
    another seed's draws (total tokens / total seconds). Without --synthetic:
  * a projection of chain speed: random weights accept nothing, so each chain round here costs
    what a real round costs but emits one token. The accepted lengths come from the real
    default pair (Qwen2.5-Coder 1.5B / 0.5B, greedy, k=4) in a bench JSON measured on the CPU;
    under greedy decoding the draft proposes the same tokens whatever k is, so at k <= 4 a
    round accepts min(a, k) where a is what k=4 accepted. Projected tokens/s at k =
    (1 + mean(min(a, k))) / (measured seconds per round at k).
Every speed is end to end (prefill included) and the median of --repeats runs; warm-up
(capture, compilation) is timed separately.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specgen.config import Acceptance, GenerationConfig, Method  # noqa: E402
from specgen.decoding import synthetic  # noqa: E402
from specgen.decoding.drafters.eagle import EagleDrafter  # noqa: E402
from specgen.decoding.drafters.model import ChainDrafter  # noqa: E402
from specgen.decoding.engine import Engine  # noqa: E402
from specgen.decoding.events import RoundResult  # noqa: E402
from specgen.errors import ConfigError  # noqa: E402
from specgen.models.eagle_head import Eagle3Head, HeadConfig, default_layers  # noqa: E402
from specgen.runtime import features, kvcache  # noqa: E402
from specgen.runtime.compiled import Steps  # noqa: E402

SHAPES = {  # Qwen2.5 0.5B / 1.5B / 7B
    "q05": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        vocab_size=151936,
    ),
    "q15": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        vocab_size=151936,
    ),
    "q7": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        vocab_size=152064,
    ),
    # CPU smoke checks of this script (--device cpu): a target and a draft of a few MB
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        vocab_size=2048,
    ),
    "tiny-draft": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        vocab_size=2048,
    ),
}
DEVICE = torch.device("cuda")  # --device sets it once in main()
SYNTHETIC_RUNS = 20  # at least this many seeds per synthetic cell (about 600 rounds at 128 tokens)


def build(name: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        **SHAPES[name],
        max_position_embeddings=32768,
        rope_theta=1e6,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if DEVICE.type == "cuda" else torch.float32)
    try:
        with DEVICE:
            model = Qwen2ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def sync_time(fn) -> float:
    synchronize()
    started = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - started


def measure(fn, repeats: int) -> tuple[float, float]:
    """(warm-up seconds, median seconds of `repeats` runs)."""
    warm = sync_time(fn)
    return warm, statistics.median(sync_time(fn) for _ in range(repeats))


def hf_generate(model, prompt, n: int, static: bool):
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"

    def go():
        out = model.generate(prompt, **kwargs)
        assert out.shape[1] == prompt.shape[1] + n, out.shape

    return go


def specgen_run(engine, prompt_ids, config, record):
    def go():
        rounds = [r.event for r in engine.generate([prompt_ids], config) if isinstance(r.event, RoundResult)]
        record["rounds"] = len(rounds)
        record["tokens"] = sum(len(r.emitted) for r in rounds)
        record["accepted"] = sum(r.accepted for r in rounds)
        record["drafted"] = sum(len(r.draft_tokens) for r in rounds)
        record["draft_seconds"] = sum(r.draft_seconds for r in rounds)
        record["verify_seconds"] = sum(r.verify_seconds for r in rounds)

    return go


@torch.inference_mode()
def forward_costs(model, mode: str, widths=(1, 2, 3, 4, 5), context: int = 200, reps: int = 30) -> dict:
    steps = Steps(model, mode)
    cache = kvcache.new_cache(model, capacity=512)
    kvcache.forward(model, cache, torch.randint(0, 1000, (1, context), device=DEVICE))
    costs = {}
    for w in widths:
        x = torch.randint(0, 1000, (1, w), device=DEVICE)

        def step():
            steps.forward(cache, x)
            kvcache.crop(cache, context)

        for _ in range(3):
            step()
        costs[w] = round(1000 * statistics.median(sync_time(step) for _ in range(reps)), 3)
    return costs


def run_mode(mode, shape, model, draft, row, result, prompt_ids, counts, ks, args, skip):
    n, total = args.new, sum(counts.values())
    if "costs" not in skip:
        row.setdefault("forward_ms", {})[mode] = forward_costs(model, mode)
        print(shape, mode, "forward ms", row["forward_ms"][mode], flush=True)
        if mode not in result.setdefault("draft_forward_ms", {}):
            result["draft_forward_ms"][mode] = forward_costs(draft, mode)
            print(args.draft, mode, "forward ms", result["draft_forward_ms"][mode], flush=True)
    cell = row.setdefault("specgen", {}).setdefault(mode, {})
    config = GenerationConfig(method=Method.PLAIN, max_new_tokens=n)
    engine = Engine(model, DEVICE, frozenset(), 32768, None, compile=mode)
    record = {}
    warm, seconds = measure(specgen_run(engine, prompt_ids, config, record), args.repeats)
    cell["plain"] = {"tokens_per_second": round(n / seconds, 2), "warmup_seconds": round(warm, 2)}
    print(shape, mode, "plain", cell["plain"], flush=True)
    if mode == "off" and DEVICE.type == "cuda":
        return  # eager chain is known to lose (one eager forward costs 23-30 ms at any size)
    if args.eagle_acceptance is not None:  # an EAGLE-3 head of the target's shape, random weights
        head = eagle_head(model)
        # a recording at k replays rounds of at most k drafts (config refuses longer ones)
        for k in [k for k in ks if k <= args.eagle_acceptance.draft_tokens]:
            drafter = EagleDrafter(
                head, DEVICE, head.config.vocab_size, compile=mode
            )  # the head's steps as run's
            engine = Engine(model, DEVICE, frozenset(), 32768, drafter, compile=mode)
            config = GenerationConfig(
                method=Method.EAGLE, max_new_tokens=n, draft_tokens=k, acceptance=args.eagle_acceptance
            )
            warm, seconds, record = measure_synthetic(engine, prompt_ids, config, args.repeats)
            cell[f"eagle-k{k}"] = synthetic_cell(args.eagle_acceptance, k, seconds, warm, record)
            print(shape, mode, f"eagle-k{k}", "(synthetic acceptance)", cell[f"eagle-k{k}"], flush=True)
    # the ids target and draft share, as build.py passes them (runtime/pair.Pair.vocab): the 7B
    # shape's head is padded to 152,064 rows, the 0.5B draft's to 151,936, and a target token past
    # the draft's table was a device-side assert in its embedding
    sizes = (model.config.vocab_size, draft.config.vocab_size)
    shared = min(sizes) if sizes[0] != sizes[1] else None
    for k in ks:
        drafter = ChainDrafter(draft, DEVICE, shared, compile=mode)
        engine = Engine(model, DEVICE, frozenset(), 32768, drafter, shared, compile=mode)
        config = GenerationConfig(
            method=Method.CHAIN, max_new_tokens=n, draft_tokens=k, acceptance=args.acceptance
        )
        if args.acceptance.synthetic:
            warm, seconds, record = measure_synthetic(engine, prompt_ids, config, args.repeats)
            cell[f"chain-k{k}"] = synthetic_cell(args.acceptance, k, seconds, warm, record)
            print(shape, mode, f"chain-k{k}", "(synthetic acceptance)", cell[f"chain-k{k}"], flush=True)
            continue
        record = {}
        warm, seconds = measure(specgen_run(engine, prompt_ids, config, record), args.repeats)
        per_round = seconds / record["rounds"]
        expected = 1 + sum(min(a, k) * c for a, c in counts.items()) / total if total else None
        cell[f"chain-k{k}"] = {
            "tokens_per_second": round(n / seconds, 2),
            "warmup_seconds": round(warm, 2),
            "rounds": record["rounds"],
            "acceptance": round(record["accepted"] / max(record["drafted"], 1), 4),
            "ms_per_round": round(1000 * per_round, 3),
            # host clock per phase of the last run: drafting (k queued draft steps) and verifying
            # (the target's forward, acceptance and the one sync that reads the verdict)
            "draft_ms_per_round": round(1000 * record["draft_seconds"] / record["rounds"], 3),
            "verify_ms_per_round": round(1000 * record["verify_seconds"] / record["rounds"], 3),
            "projected_tokens_per_round": round(expected, 3) if expected else None,
            "projected_tokens_per_second": round(expected / per_round, 1) if expected else None,
        }
        costs, draft_costs = row.get("forward_ms", {}).get(mode), result.get("draft_forward_ms", {}).get(mode)
        if costs and draft_costs and k + 1 in costs:
            # what the round costs beyond its forwards: acceptance, commit, bookkeeping, syncs
            device_ms = k * draft_costs[1] + costs[k + 1]
            cell[f"chain-k{k}"]["forwards_ms_per_round"] = round(device_ms, 3)
            cell[f"chain-k{k}"]["host_overhead_ms_per_round"] = round(1000 * per_round - device_ms, 3)
        print(shape, mode, f"chain-k{k}", cell[f"chain-k{k}"], flush=True)


def eagle_head(model):
    """A random EAGLE-3 head for `model` (its hidden size, heads and MLP width; a 32,000-id draft
    vocabulary; vLLM's default layers), in the model's dtype on DEVICE, reading its features."""
    config = model.config
    layers = config.num_hidden_layers
    vocab = config.vocab_size
    used = torch.arange(min(32000, vocab))
    head = Eagle3Head(
        HeadConfig(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.hidden_size // config.num_attention_heads,
            config.intermediate_size,
            vocab,
            used.shape[0],
            default_layers(layers),
        )
    )
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0, 0.02)
        head.t2d[used] = True
    head.use_embedding(model.get_input_embeddings())
    features.install(model)
    return head.to(DEVICE, next(model.parameters()).dtype).eval()


def measure_synthetic(engine, prompt_ids, config, repeats: int) -> tuple[float, float, dict]:
    """(warm-up seconds, total seconds, pooled record) of max(repeats, SYNTHETIC_RUNS) runs, each
    replaying another seed's draws: one run of 128 tokens is about 30 rounds, so a single seed's
    mean accepted length strays from the recording's by several percent; pooling averages it out."""

    def run(seed: int, record: dict):
        acceptance = replace(config.acceptance, seed=seed)
        return specgen_run(engine, prompt_ids, replace(config, acceptance=acceptance), record)

    warm = sync_time(run(10**6, {}))
    records = [{} for _ in range(max(repeats, SYNTHETIC_RUNS))]
    seconds = sum(sync_time(run(seed, record)) for seed, record in enumerate(records))
    pooled = {key: sum(r[key] for r in records) for key in records[0]}
    return warm, seconds, dict(pooled, runs=len(records))


def synthetic_cell(acceptance: Acceptance, k: int, seconds: float, warm: float, record: dict) -> dict:
    """A chain cell measured with synthetic acceptance, pooled over its runs: its speed, and its
    acceptance next to the recording's (they agree within sampling noise; the last round of a
    run may draft fewer)."""
    rounds = record["rounds"]
    return {
        "acceptance_mode": "synthetic",
        "tokens_per_second": round(record["tokens"] / seconds, 2),
        "warmup_seconds": round(warm, 2),
        "runs": record["runs"],
        "rounds": rounds,
        "tokens_per_round": round(record["tokens"] / rounds, 3),
        "recorded_tokens_per_round": round(1 + synthetic.expected_accepted(acceptance, k), 3),
        "acceptance": round(record["accepted"] / max(record["drafted"], 1), 4),
        "recorded_acceptance": round(synthetic.expected_accepted(acceptance, k) / k, 4),
        "ms_per_round": round(1000 * seconds / rounds, 3),
        "draft_ms_per_round": round(1000 * record["draft_seconds"] / rounds, 3),
        "verify_ms_per_round": round(1000 * record["verify_seconds"] / rounds, 3),
    }


def summary(result: dict) -> str:
    """The synthetic run's table: speculative and plain against transformers' static cache."""
    lines = [
        f"synthetic acceptance: accepted lengths replayed from {result['synthetic_acceptance']['source']} "
        f"(recorded at k={result['synthetic_acceptance']['draft_tokens']}); {result['device']}, "
        f"{result['new_tokens']} new tokens; plain and hf: median of {result['repeats']} runs, chain: "
        f"pooled over {max(result['repeats'], SYNTHETIC_RUNS)} seeds"
        + ("" if result["hf_static_compiled"] else "; transformers does not compile its static cache here"),
        f"{'shape':<6} {'mode':<9} {'method':<10} {'tok/s':>9} {'vs hf-static':>12} {'acceptance':>10} "
        f"{'recorded':>8} {'tok/round':>9}",
    ]
    for shape, row in result["shapes"].items():
        base = row.get("hf-static", {}).get("tokens_per_second")
        if base:
            lines.append(f"{shape:<6} {'':<9} {'hf-static':<10} {base:>9.2f} {1:>12.3f}")
        for mode, cells in row.get("specgen", {}).items():
            for method, c in cells.items():
                ratio = f"{c['vs_hf_static']:.3f}" if "vs_hf_static" in c else "-"
                accepted = [
                    f"{c[key]:.3f}" if key in c else ""
                    for key in ("acceptance", "recorded_acceptance", "tokens_per_round")
                ]
                lines.append(
                    f"{shape:<6} {mode:<9} {method:<10} {c['tokens_per_second']:>9.2f} {ratio:>12} "
                    f"{accepted[0]:>10} {accepted[1]:>8} {accepted[2]:>9}"
                )
    return "\n".join(lines)


def histogram(paths: list[str]) -> Counter:
    counts = Counter()
    for path in paths:
        data = json.load(open(path))
        if data["settings"].get("draft_tokens") != 4 or not data["settings"].get("greedy", True):
            continue
        for m in data["measurements"]:
            if m["method"] == "chain" and m.get("accepted_length_histogram"):
                for a, c in m["accepted_length_histogram"].items():
                    counts[int(a)] += c
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--shapes", default="q15,q7")
    parser.add_argument("--draft", default="q05")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--modes", default="graphs")
    parser.add_argument("--ks", default="1,2,3,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--skip", default="", help="comma list of parts to skip: hf-eager,hf-static,costs,eager"
    )
    parser.add_argument("--histogram", nargs="*", default=["benchmarks/results/quick-greedy.json"])
    parser.add_argument(
        "--synthetic",
        metavar="FILE[:METHOD]",
        help="measure chain with synthetic acceptance replayed from this bench JSON's recording "
        "of METHOD (default chain) instead of projecting it",
    )
    parser.add_argument(
        "--eagle",
        metavar="FILE[:METHOD]",
        help="also measure an EAGLE-3 head of each shape (random weights, a draft step of its real "
        "cost) with synthetic acceptance replayed from this bench JSON's recording of METHOD "
        "(default eagle): the acceptance a trained head showed on the CPU",
    )
    parser.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: a smoke check of this script (use --shapes tiny --draft tiny-draft --modes off)",
    )
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    skip = set(filter(None, args.skip.split(",")))
    ks = [int(k) for k in args.ks.split(",") if k]
    args.acceptance = Acceptance()
    if args.synthetic:
        try:
            args.acceptance = synthetic.parse(args.synthetic)
            for k in ks:
                GenerationConfig(method=Method.CHAIN, draft_tokens=k, acceptance=args.acceptance)
        except ConfigError as exc:
            parser.error(str(exc))
    args.eagle_acceptance = None
    if args.eagle:
        try:
            args.eagle_acceptance = synthetic.parse(
                args.eagle if ":" in args.eagle else args.eagle + ":eagle"
            )
        except ConfigError as exc:
            parser.error(str(exc))
    torch.backends.cuda.matmul.allow_tf32 = True
    name = (
        torch.cuda.get_device_properties(0).name
        if DEVICE.type == "cuda"
        else f"CPU, {torch.get_num_threads()} threads"
    )
    import transformers

    result = {
        "device": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "new_tokens": args.new,
        "prompt_tokens": args.prompt,
        "repeats": args.repeats,
        "shapes": {},
        # transformers compiles a static cache's forward on CUDA, not on the CPU
        "hf_static_compiled": DEVICE.type == "cuda",
    }
    if args.acceptance.synthetic:
        a = args.acceptance
        result["acceptance"] = "synthetic"
        result["synthetic_acceptance"] = {
            "source": a.source,
            "draft_tokens": a.draft_tokens,
            "seed": a.seed,
            "histogram": {str(length): n for length, n in zip(a.lengths, a.rounds)},
            "note": "accepted lengths replayed from the recording: speeds measured end to end, "
            "tokens not the target's",
        }
        counts = Counter()
        print(
            f"# {name}, torch {torch.__version__}, transformers {transformers.__version__}; synthetic "
            f"acceptance "
            f"from {a.source} (k={a.draft_tokens}): {result['synthetic_acceptance']['histogram']}",
            flush=True,
        )
    else:
        counts = histogram(args.histogram)
        result["histogram_k4"] = {str(a): c for a, c in sorted(counts.items())}
        print(
            f"# {name}, torch {torch.__version__}, transformers {transformers.__version__}; "
            f"k=4 accepted-length histogram {dict(sorted(counts.items()))}",
            flush=True,
        )

    draft = build(args.draft)
    modes = [m for m in args.modes.split(",") if m]
    for shape in args.shapes.split(","):
        model = build(shape)
        row = result["shapes"][shape] = {"params": sum(p.numel() for p in model.parameters())}
        gen = torch.Generator().manual_seed(1)
        top = min(150000, SHAPES[shape]["vocab_size"])
        prompt = torch.randint(100, top, (1, args.prompt), generator=gen).to(DEVICE)
        prompt_ids = prompt[0].tolist()
        n = args.new
        for name, static in (("hf-eager", False), ("hf-static", True)):
            if name in skip:
                continue
            warm, seconds = measure(hf_generate(model, prompt, n, static), args.repeats)
            row[name] = {"tokens_per_second": round(n / seconds, 2), "warmup_seconds": round(warm, 2)}
            print(shape, name, row[name], flush=True)
        for mode in dict.fromkeys((["off"] if "eager" not in skip else []) + modes):
            try:
                run_mode(mode, shape, model, draft, row, result, prompt_ids, counts, ks, args, skip)
            except Exception as exc:  # report, do not hide; the other modes and shapes still run
                row.setdefault("errors", {})[mode] = repr(exc)[:600]
                print(shape, mode, "FAILED", repr(exc)[:600], flush=True)
        base = row.get("hf-static", {}).get("tokens_per_second")
        if base:
            for mode, cells in row.get("specgen", {}).items():
                for method, values in cells.items():
                    values["vs_hf_static"] = round(values["tokens_per_second"] / base, 3)
                    if values.get("projected_tokens_per_second"):
                        values["projected_vs_hf_static"] = round(
                            values["projected_tokens_per_second"] / base, 3
                        )
        del model
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    if args.acceptance.synthetic:
        print(summary(result))


if __name__ == "__main__":
    main()
