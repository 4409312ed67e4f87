"""What memory allows a decode step on this machine, against what specgen's and llama.cpp's take.

    python benchmarks/memory_bound.py [--repeats 15] [--llamacpp-python /path/to/venv/bin/python]
                                      [--out benchmarks/results/.../bound.txt]

A one-token decode step reads every weight of the model once, and on a 2-core CPU those
weights (1.5 GB for the default target in int8) are far past the caches. So a step cannot take
less than its weight bytes over the machine's read bandwidth, whatever its kernels do. This
script measures both sides of that bound, in one process:

* the read bandwidth: a sum over a 2 GiB float32 tensor (torch's vectorised reduction on every
  thread: a stream of reads and nothing else), sampled before, between and after the steps (a
  VM's bandwidth moves with its neighbours), and the bandwidth specgen's own int8 kernels reach
  at one row (the target's products alone, in a step's order, over real weights);
* the bytes a one-token step reads: every int8 product's weights and scales (fused groups
  once), and any float linear the step runs; for llama.cpp the GGUF's tensors, all but the
  token embedding (one row of it is read);
* the step itself: specgen's target and draft (`outside_products.measure`: the lean forward
  over a `--context`-token cache), and, with `--llamacpp-python`, llama.cpp's: llama-cpp-python's
  `eval` of one token at a time after a context of the same length, in a child process of that
  interpreter, with the same threads.

It prints each step against its bound: the bandwidth it reaches (bytes / step) and what an
ideal kernel at the measured read bandwidth would take. Speed here is a ratio within one run.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_profile import cpu_flags  # noqa: E402
from outside_products import default_pair, measure, median_ms, step_arguments  # noqa: E402

from specgen.runtime import int8  # noqa: E402

GGUF = Path.home() / ".cache" / "specgen" / "gguf" / "qwen2.5-coder-1.5b-instruct.gguf"
STREAM_BYTES = 2 << 30

LLAMACPP_STEP = """
import json, statistics, sys, time
import llama_cpp
path, context, repeats, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_ctx=context + repeats + 16, n_threads=threads,
                      n_threads_batch=threads, verbose=False)
prompt = [1000 + i for i in range(context)]
llm.eval(prompt)
walls = []
for step in range(repeats + 3):  # one token at a time after the context, as decoding does
    started = time.perf_counter()
    llm.eval([2000 + step])
    walls.append(time.perf_counter() - started)
print(json.dumps({"step_ms": statistics.median(walls[3:]) * 1e3, "version": llama_cpp.__version__}))
"""


def read_bandwidth(repeats: int) -> float:
    """GB/s of a float32 sum over STREAM_BYTES (every thread torch has)."""
    x = torch.ones(STREAM_BYTES // 4)
    ms = median_ms(lambda: x.sum(), repeats)
    return STREAM_BYTES / ms / 1e6


def step_bytes(model: nn.Module) -> int:
    """The weight bytes a one-token step of `model` reads: int8 products (weights, scales, bias),
    each fused group once, and float linears; not the input embedding (one row is read), nor a
    pruned draft head's blocks held until their first id (`waiting`: not in the forward yet)."""
    total, groups = 0, set()
    for name, module in model.named_modules():
        if ".waiting." in f".{name}.":
            continue
        if isinstance(module, int8.RowInt8Part):
            fused = module._fused
            if id(fused) not in groups:
                groups.add(id(fused))
                out = sum(fused.sizes)
                total += out * module.in_features + 4 * out + (0 if fused.bias is None else 4 * out)
        elif isinstance(module, int8.RowInt8Linear):
            out = module.out_features
            total += out * module.in_features + 4 * out + (0 if module.bias is None else 4 * out)
        elif isinstance(module, nn.Linear):
            total += sum(p.numel() * p.element_size() for p in module.parameters())
    return total


def gguf_step_bytes(path: Path) -> int:
    """The bytes llama.cpp's one-token step reads from a GGUF: every tensor but the token embedding
    (one row), unless the output layer is the embedding itself (tied: no output tensor)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if tied or name != "token_embd.weight")


def llamacpp_step(python: str, gguf: Path, context: int, repeats: int, threads: int) -> dict:
    out = subprocess.run(
        [python, "-c", LLAMACPP_STEP, str(gguf), str(context), str(repeats), str(threads)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = step_arguments()
    parser.add_argument("--llamacpp-python", default=None, help="an interpreter with llama-cpp-python")
    parser.add_argument("--gguf", default=str(GGUF), help="llama.cpp's target (default: the cache's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lines = [
        f"cpu: {cpu_flags()}",
        f"torch {torch.__version__}, threads {args.threads}, context {args.context}, "
        f"medians of {args.repeats}",
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
    ]
    pair = default_pair()
    samples = [read_bandwidth(args.repeats)]  # the VM's bandwidth moves: sampled around every step
    rows = []
    for name, exact in (("target", True), ("draft", False)):
        model = getattr(pair, name).model
        with torch.inference_mode():
            timed = measure(model, exact, 1, args.context, args.repeats)
        rows.append((f"specgen {name} (int8)", step_bytes(model), timed["step"], timed["products"]))
        samples.append(read_bandwidth(args.repeats))
    if args.llamacpp_python:
        llama = llamacpp_step(args.llamacpp_python, Path(args.gguf), args.context, args.repeats, args.threads)
        lines.append(f"llama-cpp-python {llama['version']}: {args.gguf}")
        rows.append(("llama.cpp target (GGUF)", gguf_step_bytes(Path(args.gguf)), llama["step_ms"], None))
        samples.append(read_bandwidth(args.repeats))
    read = statistics.median(samples)
    lines += [
        "read bandwidth (float32 sum over 2 GiB), before, between and after the steps: "
        + ", ".join(f"{sample:.1f}" for sample in samples)
        + f" GB/s; bounds below use the median, {read:.1f}",
        "",
        f"{'step, one token':<26} {'reads':>8} {'bound':>9} {'step':>9} {'reached':>10} "
        f"{'step/bound':>10} {'products':>9} {'reached':>10}",
    ]
    for name, nbytes, step, products in rows:
        bound = nbytes / read / 1e6
        product_cols = "" if products is None else f" {products:7.1f}ms {nbytes / products / 1e6:6.1f}GB/s"
        lines.append(
            f"{name:<26} {nbytes / 1e9:6.3f}GB {bound:7.1f}ms {step:7.1f}ms {nbytes / step / 1e6:6.1f}GB/s "
            f"{step / bound:10.2f}{product_cols}"
        )
    target, draft = rows[0], rows[1]
    lines += [
        "",
        f"draft step / target step: {draft[2] / target[2]:.2f} (bytes alone: {draft[1] / target[1]:.2f})",
    ]
    if len(rows) > 2:
        llama = rows[2]
        lines.append(
            f"specgen's target at the read bound would take {target[1] / read / 1e6:.1f} ms a token; "
            f"llama.cpp's step takes {llama[2]:.1f} ms: to match it, specgen's int8 step would have to "
            f"read at {target[1] / llama[2] / 1e6:.1f} GB/s"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
