"""What a CPU step spends outside its matrix products, and what compiling the rest would save.

    python benchmarks/outside_products.py [--context 200] [--widths 1,6] [--repeats 15]
                                          [--out benchmarks/results/.../outside.txt]

The default pair is loaded as `specgen` loads it (int8 target, int8 pruned draft; the lean
forward the decode loop calls). For each model and width it times, as medians of `--repeats`:

* `step`: one forward over a `--context`-token cache, as the decode loop runs it;
* `products`: the same products alone, in the step's order (4 per layer and the head, each as
  the step calls it: the int8 product with its per-row scaling for the target), on inputs of the
  step's shapes;
* `kernels`: the int8 kernels alone (fbgemm's or oneDNN's op on pre-scaled inputs): what the
  scaling around them costs is `products - kernels`;
* `rest, warm`: the step with every product replaced by a ready output of its shape: the other
  ops alone, their data and code in the caches;
* `rest, cold`: the same with a 64 MB memory sweep before each layer (about what a layer's
  products stream through the caches), the sweeps' own time subtracted: the other ops as the
  step meets them.

Then the pointwise parts of a layer (residual add, RMSNorm and the per-row input scaling; SiLU,
product and scaling) eagerly and compiled by inductor (`torch.compile(dynamic=True)`), per call:
what fusing them would save against what a compiled region costs to enter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from specgen.config import Method, ModelSettings
from specgen.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specgen.runtime import int8, kvcache, onednn
from specgen.runtime.lean import LeanForward
from specgen.runtime.pair import load

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_profile import cpu_flags  # noqa: E402  (the machine line every profile prints)

SWEEP_BYTES = 64 << 20


def median_ms(call, repeats: int) -> float:
    for _ in range(3):
        call()
    walls = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        walls.append(time.perf_counter() - started)
    return statistics.median(walls) * 1e3


def _kernel(module, rows: int):
    """The bare int8 kernel of a RowInt8Linear (or of a fused group) on `rows` pre-scaled rows."""
    fused = getattr(module, "_fused", None)
    packed, wide = (fused.packed, fused.wide) if fused is not None else (module._packed, module._wide)
    scale, zero = int8._INPUT_SCALE, int8._ZERO_POINT

    def call(x):
        if wide is not None and rows >= onednn.WIDE:
            return onednn.product(x, scale, zero, wide)
        for part in packed if isinstance(packed, tuple) else (packed,):
            int8._int8_product(x, scale, zero, part)

    return call


def measure(model, exact: bool, width: int, context: int, repeats: int) -> dict[str, float]:
    config = model.config
    hidden_size, inner = config.hidden_size, config.intermediate_size
    forward = LeanForward(model, exact)
    cache = kvcache.new_cache(model)
    kvcache.forward(forward, cache, torch.arange(1000, 1000 + context)[None], keep=1)
    tokens = torch.arange(2000, 2000 + width)[None]

    def step():
        kvcache.forward(forward, cache, tokens, keep=width)
        kvcache.crop(cache, context)

    out = {"step": median_ms(step, repeats)}
    narrow, wide_in = torch.rand(1, width, hidden_size) * 2 - 1, torch.rand(1, width, inner) * 2 - 1
    layers = [model.model.layers[layer.index] for layer in forward.layers]

    def products():
        for layer in forward.layers:
            layer.qkv(narrow), layer.o_proj(narrow), layer.gate_up(narrow), layer.down(wide_in)
        forward.head(narrow[:, -1:])

    out["products"] = median_ms(products, repeats)
    if exact:  # the target: the kernels without the per-row scaling around them
        kernels = [
            (_kernel(module, width), narrow[0] if module is not layer.mlp.down_proj else wide_in[0])
            for layer in layers
            for module in (
                layer.self_attn.q_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_proj,
                layer.mlp.down_proj,
            )
        ]
        head = _kernel(model.lm_head, 1)
        out["kernels"] = median_ms(lambda: [k(x) for k, x in kernels] + [head(narrow[0, -1:])], repeats)

    ready = {}  # each product replaced by a ready output of its shape
    for layer in forward.layers:
        for name in ("qkv", "o_proj", "gate_up", "down"):
            product = getattr(layer, name)
            result = product(wide_in if name == "down" else narrow).reshape(width, -1)
            ready[layer, name] = product
            setattr(layer, name, lambda x, r=result: r.view(*x.shape[:-1], r.shape[-1]))
    head, logits = forward.head, forward.head(narrow[:, -1:])
    forward.head = lambda x: logits
    out["rest, warm"] = median_ms(step, repeats)
    sweep = torch.empty(SWEEP_BYTES // 4)
    for layer in forward.layers:
        qkv = layer.qkv
        layer.qkv = lambda x, qkv=qkv: (sweep.add_(0.0), qkv(x))[1]
    sweeps = median_ms(lambda: [sweep.add_(0.0) for _ in forward.layers], repeats)
    out["rest, cold"] = median_ms(step, repeats) - sweeps
    for (layer, name), product in ready.items():
        setattr(layer, name, product)
    forward.head = head
    return out


def _scale(x):
    peak = torch.amax(torch.abs(x), -1, True).clamp_(min=1e-30)
    return x / peak, peak


def norm_and_scale(hidden, product, peak, weight):
    """A layer's residual add, RMSNorm and the next product's per-row input scaling."""
    hidden = hidden + product * peak
    return hidden, *_scale(nn.functional.rms_norm(hidden, weight.shape, weight, 1e-6))


def activation_and_scale(product, peak):
    """The MLP's gate and up outputs rescaled, SiLU(gate) x up, and the down product's scaling."""
    gate, up = (product * peak).chunk(2, -1)
    return _scale(nn.functional.silu(gate) * up)


def pointwise(hidden_size: int, inner: int, repeats: int) -> list[str]:
    lines = []
    for rows in (1, 6):
        hidden, product, peak = (
            torch.randn(rows, hidden_size),
            torch.randn(rows, hidden_size),
            torch.rand(rows, 1),
        )
        weight, gate_up = torch.rand(hidden_size), torch.randn(rows, 2 * inner)
        for name, function, args in (
            ("residual + norm + scaling", norm_and_scale, (hidden, product, peak, weight)),
            ("silu x up + scaling", activation_and_scale, (gate_up, peak)),
        ):
            compiled = torch.compile(function, dynamic=True, fullgraph=True)
            eager_us = median_ms(lambda: [function(*args) for _ in range(100)], repeats) * 10
            compiled_us = median_ms(lambda: [compiled(*args) for _ in range(100)], repeats) * 10
            times = f"eager {eager_us:6.1f} us   compiled {compiled_us:6.1f} us a call"
            lines.append(f"   {rows} row(s), {name:<28} {times}")
    return lines


def step_arguments() -> argparse.ArgumentParser:
    """The options every step-timing script here takes (compiled_step.py adds its own)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--widths", default="1,6")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    return parser


def default_pair():
    """The default pair as `specgen` loads it on the CPU: int8 target, int8 pruned draft."""
    settings = ModelSettings(
        DEFAULT_TARGET, DEFAULT_DRAFT, device="cpu", draft_quant="auto", compile="off", target_quant="int8"
    )
    return load(settings, Method.CHAIN, quiet=True)


def main() -> None:
    args = step_arguments().parse_args()
    torch.set_num_threads(args.threads)
    pair = default_pair()
    lines = [
        f"cpu: {cpu_flags()}",
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, context {args.context}, "
        f"medians of {args.repeats}",
        "",
    ]
    with torch.inference_mode():
        for role, exact in (("target", True), ("draft", False)):
            model = getattr(pair, role).model
            for width in (int(w) for w in args.widths.split(",")):
                out = measure(model, exact, width, args.context, args.repeats)
                line = f"{role}, {width} token(s): " + ", ".join(f"{k} {v:.1f} ms" for k, v in out.items())
                line += f"; step / products {out['step'] / out['products']:.2f}"
                if "kernels" in out:
                    line += f", step / kernels {out['step'] / out['kernels']:.2f}"
                lines.append(line)
                print(line, flush=True)
        lines += ["", "pointwise parts of a target layer, per call:"]
        lines += pointwise(
            pair.target.model.config.hidden_size, pair.target.model.config.intermediate_size, 9
        )
    report = "\n".join(lines)
    print("\n".join(lines[-5:]))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as fh:
            fh.write(report + "\n")


if __name__ == "__main__":
    main()
