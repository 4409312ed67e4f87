"""The int8 CPU path's future: today's kernel against the supported replacements, on this CPU.

Today's int8 linears (specgen/runtime/int8.py) stand on torch.ao's quantized ops (fbgemm's
`linear_with_input_q_dq_qweight_dq_output_fp32`, per-channel quantized tensors), which torch
2.13 says "are deprecated and will be removed in a future PyTorch release". Candidates:
- torchao's `Int8DynamicActivationInt8WeightConfig` (int8 activations quantized per token,
  int8 weights per channel, an int32 product);
- `torch._weight_int8pack_mm` (int8 weights per channel, bf16 activations and products);
- `torch.compile` (inductor) of a dequantize-then-matmul in bf16.

Each runs the default target's (Qwen2.5-1.5B) linears of one decoder layer (q/k/v fused,
o, gate/up fused, down) and its output layer, at 1, 5, 9 and 17 rows (one plain step, and
verifies of k = 4, 8, 16 drafted tokens), with random weights of those shapes. Besides the time,
two things decide whether a kernel can replace today's:
- batch invariance: a row's output must be bitwise the same alone and among 5, 9 or 17 rows,
  or a k+1-token verify scores a token differently from a plain step and greedy speculative
  decoding stops reproducing plain decoding (today's kernel is built for exactly this);
- error against fp32.

    python benchmarks/int8_kernels.py --threads 2 --out benchmarks/results/int8-kernels-<machine>-<date>
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from specgen.runtime import int8

HIDDEN, INTERMEDIATE, VOCAB, HEADS_KV = (
    1536,
    8960,
    151936,
    2 * 128,
)  # Qwen2.5-1.5B: 12 q heads, 2 kv heads of 128
SHAPES = {
    "qkv": (HIDDEN + 2 * HEADS_KV, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (2 * INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
    "lm_head": (VOCAB, HIDDEN),
}
ROWS = (1, 5, 9, 17)
LAYERS = 28


def today(weight):
    return int8.linear_of(weight)


def torchao_dynamic(weight):
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_  # the candidate

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data.copy_(weight)
    quantize_(linear, Int8DynamicActivationInt8WeightConfig())
    return lambda x: linear(x)


def int8pack(weight):
    q, scales = int8.quantize_weight(weight)
    scales = scales.to(torch.bfloat16)
    return lambda x: torch._weight_int8pack_mm(x.to(torch.bfloat16), q, scales).float()


def compiled_dequant(weight):
    q, scales = int8.quantize_weight(weight)
    scales = scales.to(torch.bfloat16)[:, None]

    @torch.compile(dynamic=False)
    def forward(x, q, scales):
        return F.linear(x.to(torch.bfloat16), q.to(torch.bfloat16) * scales).float()

    return lambda x: forward(x, q, scales)


def _onednn(weight, levels: int, zero_point: int, dtype, per_row: bool, static: float | None = None):
    """oneDNN's int8 linear (AMX where the CPU has it). `per_row`: each row divided by its own
    max |x| and quantized with one fixed scale, as today's kernel does (then one scale per call
    is row-exact); else one scale per call from the whole input (`static`: a fixed calibrated
    one, clipping what lies beyond)."""
    q, scales = int8.quantize_weight(weight)
    packed = torch.ops.onednn.qlinear_prepack(q, None)
    zeros = torch.zeros(len(scales), dtype=torch.int64)
    low, high = (0, 255) if dtype == torch.uint8 else (-128, 127)

    def forward(x):
        if per_row:
            peak = torch.amax(torch.abs(x), -1, True).clamp_(min=1e-30)
            scale = 1.0 / levels
        else:
            peak = None
            scale = static if static is not None else max(x.abs().max().item(), 1e-30) / levels
        qx = (
            torch.round(x / peak * levels if per_row else x / scale)
            .add_(zero_point)
            .clamp_(low, high)
            .to(dtype)
        )
        out = torch.ops.onednn.qlinear_pointwise(
            qx, scale, zero_point, packed, scales, zeros, None, 1.0, 0, torch.float32, "none", [], ""
        )
        return out.mul_(peak) if per_row else out

    return forward


def onednn_u8_row(weight):  # today's numbers: 7 bits, zero point 64, each row by its own peak
    return _onednn(weight, 63, 64, torch.uint8, per_row=True)


def onednn_s8_row(weight):  # 8 bits, symmetric, each row by its own peak
    return _onednn(weight, 127, 0, torch.int8, per_row=True)


def onednn_s8_call(weight):  # one dynamic scale per call: the whole input's peak
    return _onednn(weight, 127, 0, torch.int8, per_row=False)


def onednn_s8_static(weight):  # one calibrated scale per layer (here: 4 standard deviations of N(0,1))
    return _onednn(weight, 127, 0, torch.int8, per_row=False, static=4.0 / 127)


def dense_bf16(weight):  # not int8: the reference a replacement has to beat in memory, at least
    w = weight.to(torch.bfloat16)
    return lambda x: F.linear(x.to(torch.bfloat16), w).float()


KERNELS = {
    "today (fbgemm row-exact)": today,
    "torchao int8 dyn-act int8-weight": torchao_dynamic,
    "_weight_int8pack_mm (bf16 act)": int8pack,
    "compiled dequant-matmul (bf16)": compiled_dequant,
    "dense bf16 (no int8)": dense_bf16,
    "onednn u8 per-row (today's numbers)": onednn_u8_row,
    "onednn s8 per-row": onednn_s8_row,
    "onednn s8 one scale per call": onednn_s8_call,
    "onednn s8 static per layer": onednn_s8_static,
}


def seconds(fn, x, repeats: int) -> float:
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def invariant(fn, x, widths) -> bool:
    """Each row's output alone equals its output inside every wider batch, bitwise."""
    alone = torch.cat([fn(x[i : i + 1]) for i in range(len(x))])
    return all(torch.equal(fn(x[:rows]), alone[:rows]) for rows in widths if rows > 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--kernels", default=",".join(KERNELS), help="comma list of: " + ", ".join(KERNELS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma list of row counts, or A-B")
    args = parser.parse_args()
    if "-" in args.rows:
        first, last = map(int, args.rows.split("-"))
        widths = tuple(range(first, last + 1))
    else:
        widths = tuple(int(r) for r in args.rows.split(","))
    warnings.simplefilter("ignore")
    torch._dynamo.config.recompile_limit = 64  # one compiled product per shape and row count
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next(
        (line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("Model name")), "?"
    )
    wanted = [k for k in args.kernels.split(",") if k]
    weights = {name: torch.randn(shape) * 0.02 for name, shape in SHAPES.items()}
    inputs = {name: torch.randn(max(widths), shape[1]) for name, shape in SHAPES.items()}
    results = {
        "cpu": cpu,
        "flags": [
            f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags.split()
        ],
        "torch": torch.__version__,
        "threads": args.threads,
        "date": time.strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "rows": list(widths),
        "kernels": {},
    }
    firsts = {}
    for kernel in wanted:
        row = {"ms": {}, "exact_rows": True, "max_rel_error": 0.0}
        try:
            fns = {name: KERNELS[kernel](w) for name, w in weights.items()}
        except Exception as exc:  # a kernel this CPU or torch build lacks
            results["kernels"][kernel] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            print(f"{kernel}: {results['kernels'][kernel]['error']}", flush=True)
            continue
        for name, fn in fns.items():
            x = inputs[name]
            with torch.no_grad():
                reference = F.linear(x, weights[name])
                out = fn(x)
                error = ((out - reference).norm(dim=-1) / reference.norm(dim=-1)).max().item()
                row["max_rel_error"] = max(row["max_rel_error"], round(error, 4))
                row["exact_rows"] &= invariant(fn, x, widths)
                if kernel != wanted[0] and wanted[0] in results["kernels"]:
                    row["same_as_first"] = row.get("same_as_first", True) and torch.equal(out, firsts[name])
                elif kernel == wanted[0]:
                    firsts[name] = out
                for rows in widths:
                    row["ms"].setdefault(name, {})[rows] = round(
                        1000 * seconds(fn, x[:rows], args.repeats), 3
                    )
        # one decode step's linears: every layer's four, once the output layer
        row["step_ms"] = {
            rows: round(
                LAYERS * sum(row["ms"][n][rows] for n in ("qkv", "o", "gate_up", "down"))
                + row["ms"]["lm_head"][rows],
                2,
            )
            for rows in widths
        }
        results["kernels"][kernel] = row
        print(
            f"{kernel}: step linears {row['step_ms']} ms; row-exact {row['exact_rows']}; "
            f"max rel error {row['max_rel_error']}",
            flush=True,
        )
    base = results["kernels"].get(wanted[0], {}).get("step_ms")
    if base:
        print(f"\nrelative to {wanted[0]} (lower is faster), rows {list(widths)}:")
        for kernel, row in results["kernels"].items():
            if "step_ms" in row:
                ratios = " ".join(f"{row['step_ms'][r] / base[r]:.2f}" for r in widths)
                same = row.get("same_as_first", "-")
                print(f"  {kernel:36s} {ratios}   row-exact {row['exact_rows']} same as first {same}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "int8-kernels.json").write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out / 'int8-kernels.json'}")


if __name__ == "__main__":
    sys.exit(main())
