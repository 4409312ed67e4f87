"""Where one CPU forward's time goes: a per-op profile of the target and the draft.

    python benchmarks/cpu_profile.py [--target-quant none|int8] [--draft-quant none|int8]
                                     [--dtype auto|float32|bfloat16] [--widths 1,5] [--context 200]
                                     [--out benchmarks/results/cpu-profile.txt]

Both models are loaded as `specgen` loads them (same placement, dtype and quantization), a
`--context`-token prompt is prefilled into a SlotCache, then each width (1 = a plain step or a
draft step, 5 = a k=4 verify) is run `--steps` times through `kvcache.forward` with what the
decode loop calls (the lean forward: specgen/lean.py; a draft's with exact=False), under
torch.profiler. The table lists self time per op per forward, and the
share that is matrix multiplication (the part that should dominate) against everything else.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from specgen.config import Method, ModelSettings
from specgen.models import placement
from specgen.runtime import kvcache
from specgen.runtime.lean import call_for
from specgen.runtime.pair import load

MATMUL_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::_int_mm",
    "quantized::linear_dynamic",
    "aten::_weight_int8pack_mm",
    "quantized::linear_with_input_q_dq_qweight_dq_output_fp32",
    "onednn::qlinear_pointwise",
    "aten::linear",
    "aten::matmul",
)


def cpu_flags() -> str:
    """The CPU's name and its vector flags (what decides the kernels)."""
    flags = sorted(f for f in placement.cpu_flags() or () if f.startswith(("avx", "amx", "fma", "f16c")))
    return f"{placement.cpu_name()}: {' '.join(flags) or '?'}"


def profile_model(
    model, width: int, context: int, steps: int, exact: bool = True
) -> tuple[float, dict[str, float]]:
    """Median wall ms per forward (untraced) and self ms per op per forward (traced), through
    what the decode loop calls (the lean forward on the CPU; exact=False for a draft)."""
    device = next(model.parameters()).device
    call = call_for(model, exact)
    cache = kvcache.new_cache(model)
    prompt = torch.arange(1000, 1000 + context, device=device)[None]
    kvcache.forward(call, cache, prompt, keep=1)
    tokens = torch.arange(2000, 2000 + width, device=device)[None]

    def step():
        logits = kvcache.forward(call, cache, tokens, keep=width)
        kvcache.crop(cache, context)
        return logits

    for _ in range(2):
        step()
    walls = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        walls.append((time.perf_counter() - started) * 1e3)
    walls.sort()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    ops: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        ops[event.key] += event.self_cpu_time_total / 1e3 / steps
    return walls[len(walls) // 2], dict(ops)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--target-quant", default="none")
    parser.add_argument("--draft-quant", default="auto")
    parser.add_argument("--widths", default="1,5")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the report here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pair = load(
        ModelSettings(
            args.target,
            args.draft,
            "cpu",
            None,
            args.dtype,
            args.draft_quant,
            "off",
            target_quant=args.target_quant,
        ),
        Method.CHAIN,
        quiet=True,
    )
    lines = [
        f"cpu: {cpu_flags()}",
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"context {args.context}, {args.steps} forwards per width",
        f"target {pair.target.name}: {pair.target.dtype}, weights {pair.target.weights}",
        f"draft {pair.draft.name}: {pair.draft.dtype}, weights {pair.draft.weights}",
        "",
    ]
    for role, loaded in (("target", pair.target), ("draft", pair.draft)):
        for width in (int(w) for w in args.widths.split(",")):
            wall, ops = profile_model(loaded.model, width, args.context, args.steps, exact=role == "target")
            total = sum(ops.values())
            matmul = sum(v for k, v in ops.items() if k in MATMUL_OPS)
            lines.append(
                f"== {role}, {width} token(s): {wall:.1f} ms per forward (untraced median); "
                f"traced self time {total:.1f} ms, matmuls {matmul:.1f} ms ({matmul / total:.0%}), "
                f"other {total - matmul:.1f} ms"
            )
            for name, ms in sorted(ops.items(), key=lambda kv: -kv[1])[: args.top]:
                lines.append(f"   {name:<44}{ms:9.2f} ms {ms / total:6.1%}")
            lines.append("")
            print("\n".join(lines[-(min(args.top, len(ops)) + 2) :]), flush=True)
    report = "\n".join(lines)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as fh:
            fh.write(report + "\n")
    print(report)


if __name__ == "__main__":
    main()
