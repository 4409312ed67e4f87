"""A CPU decode step compiled as one inductor region, against the lean eager step.

    python benchmarks/compiled_step.py [--context 200] [--widths 1,6] [--repeats 15]
                                       [--kernel-threads 1] [--out benchmarks/results/.../compiled.txt]

`--compile inductor` compiles each decoder layer as a region of its own, built for CUDA graphs;
on the CPU entering a compiled region costs more than the small ops it fuses
(benchmarks/cpu-speed.md). This script measures the other way round: the decoder layers of one
step as ONE compiled region, entered once per step. The default pair is loaded as `specgen`
loads it (int8 target, int8 pruned draft), and the step is the lean forward's op sequence
(`runtime/lean.py`) over a K/V buffer of `--context` tokens:

* the int8 products are opaque custom ops (fbgemm's packed weights are script objects, which
  dynamo cannot trace): the target's per-row input scaling and its epilogue stay in the compiled
  graph, so inductor fuses them with the norm, rotary and SiLU around them; the draft's product
  is its whole `_draft_product`;
* embedding, rotary tables, the final norm and the head run eagerly around the region;
* inductor's kernels run on `--kernel-threads` threads (the products keep torch's two). With
  two, inductor splits a one-row RMSNorm's sum over the threads, so a token's activations in a
  one-token step differ in the last bit from the same token's in a wider forward, which int8's
  per-row rounding can turn into a different logit; with one they do not (checked below).

It prints, for each model and width, medians over `--repeats` rounds that time the three one
after another (the VM's speed drifts): `lean` (what the decode loop runs today, through
`kvcache.forward`), `eager` (this script's step uncompiled) and `compiled`; the seconds the
compile took; and two checks: whether each row of a width-6 forward is bitwise that of six
one-token and three two-token forwards (row-exactness, which greedy speculative decoding
needs), and how far the compiled logits are from the eager ones.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from specgen.runtime import int8, kvcache, onednn
from specgen.runtime.exact_attention import NAME as EXACT_NAME
from specgen.runtime.exact_attention import grouped_attention
from specgen.runtime.lean import LeanForward, _draft_product, _sdpa

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_profile import cpu_flags  # noqa: E402  (the machine line every profile prints)
from outside_products import default_pair, step_arguments  # noqa: E402

PRODUCTS: list = []  # (packed, bias, wide, exact) by handle: the custom ops' weights


@torch.library.custom_op("specgen_bench::int8_product", mutates_args=())
def int8_product(x: torch.Tensor, handle: int, width: int) -> torch.Tensor:
    """The target's int8 kernel on pre-scaled rows (row_linear without its scaling); the
    draft's whole product (exact False)."""
    packed, bias, wide, exact = PRODUCTS[handle]
    if not exact:
        return _draft_product(x, packed, bias, wide)
    scale, zero = int8._INPUT_SCALE, int8._ZERO_POINT
    if wide is not None and x.numel() >= onednn.WIDE * x.shape[-1]:  # AMX: oneDNN's wide products
        return onednn.product(x, scale, zero, wide)
    if isinstance(packed, tuple):
        return torch.cat([int8._int8_product(x, scale, zero, p) for p in packed], -1)
    return int8._int8_product(x, scale, zero, packed)


@int8_product.register_fake
def _(x, handle, width):
    return x.new_empty(*x.shape[:-1], width)


def product(module_or_group, exact: bool):
    """x -> the product of an int8 linear (or of a fused q/k/v or gate/up group), traceable."""
    fused = getattr(module_or_group, "_fused", None)
    if fused is not None:
        packed, bias, wide, width = fused.packed, fused.bias, fused.wide, sum(fused.sizes)
    else:
        packed, bias, wide = module_or_group._packed, module_or_group.bias, module_or_group._wide
        width = module_or_group.out_features
    PRODUCTS.append((packed, bias, wide, exact))
    handle = len(PRODUCTS) - 1
    if not exact:
        return lambda x: int8_product(x, handle, width)

    def call(x):  # int8.row_linear's arithmetic, its kernel opaque
        peak = torch.amax(torch.abs(x), -1, True).clamp(min=1e-30)
        out = int8_product(x / peak, handle, width)
        return torch.addcmul(bias, out, peak) if bias is not None else out * peak

    return call


class Step:
    """One decode step of `model` over its own K/V buffers: the lean forward's ops."""

    def __init__(self, model, exact: bool, capacity: int):
        lean = self.lean = LeanForward(model, exact)
        config = model.config
        self.heads, self.groups, self.dim = lean.heads, lean.groups, lean.head_dim
        self.exact_attention = config._attn_implementation == EXACT_NAME
        self.layers = []
        for layer in lean.layers:
            own = model.model.layers[layer.index]
            attn, mlp = own.self_attn, own.mlp
            products = [product(m, exact) for m in (attn.q_proj, attn.o_proj, mlp.gate_proj, mlp.down_proj)]
            self.layers.append((layer, *products))
        shape = (1, self.groups, capacity, self.dim)
        self.keys = [torch.zeros(shape) for _ in self.layers]
        self.values = [torch.zeros(shape) for _ in self.layers]

    def decoder(self, hidden, cos, sin, slots, mask):
        """hidden [1, n, H] -> hidden after the last layer; K/V written at `slots`, attention
        over the first mask.shape[-1] slots."""
        n, view = hidden.shape[1], mask.shape[-1]
        heads, groups, dim = self.heads, self.groups, self.dim
        half = dim // 2
        for index, (layer, qkv_product, o_product, gate_up_product, down_product) in enumerate(self.layers):
            residual = hidden
            x = nn.functional.rms_norm(hidden, layer.ln1.shape, layer.ln1, layer.eps1)
            qkv = qkv_product(x).view(1, n, heads + 2 * groups, dim)
            qk = qkv[:, :, : heads + groups]
            qk = (qk * cos) + (torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin)
            q, k = qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2)
            self.keys[index].index_copy_(2, slots, k)
            self.values[index].index_copy_(2, slots, qkv[:, :, heads + groups :].transpose(1, 2))
            keys, values = self.keys[index][:, :, :view], self.values[index][:, :, :view]
            if self.exact_attention:
                out = grouped_attention(q, keys, values, mask, layer.scaling)
            else:
                out = _sdpa(q, keys, values, mask, layer.scaling, heads // groups)
            hidden = residual + o_product(out.reshape(1, n, -1))
            residual = hidden
            x = nn.functional.rms_norm(hidden, layer.ln2.shape, layer.ln2, layer.eps2)
            gate, up = gate_up_product(x).chunk(2, -1)
            hidden = residual + down_product(nn.functional.silu(gate) * up)
        return hidden

    def inputs(self, context: int, tokens: torch.Tensor):
        """The region's inputs for `tokens` [1, n] after `context` committed slots."""
        n = tokens.shape[1]
        slots = torch.arange(context, context + n)
        hidden = self.lean.embed(tokens)
        cos, sin = self.lean.rotary(hidden, slots[None])
        mask = torch.zeros(1, 1, n, context + n)
        mask[..., context:] = torch.full((n, n), float("-inf")).triu(1)
        return hidden, cos.unsqueeze(2), sin.unsqueeze(2), slots, mask

    def logits(self, decoder, context: int, tokens: torch.Tensor) -> torch.Tensor:
        hidden = decoder(*self.inputs(context, tokens))
        return self.lean.head(
            nn.functional.rms_norm(hidden, self.lean.norm.shape, self.lean.norm, self.lean.norm_eps)
        )


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b|, a pruned head's -inf logits (the same in both) counting as equal."""
    return (a - b).nan_to_num(0.0).abs().max().item()


def row_exact(step: Step, decoder, context: int) -> str:
    """Largest difference between a width-6 forward's logits and the same tokens' logits from
    one-token and from two-token forwards (0 = bitwise the same)."""
    tokens = torch.arange(2000, 2006)[None]
    whole = step.logits(decoder, context, tokens).clone()
    found = []
    for width in (1, 2):
        parts = [
            step.logits(decoder, context + j, tokens[:, j : j + width]).clone() for j in range(0, 6, width)
        ]
        found.append(f"{width}-token forwards {(whole - torch.cat(parts, 1)).abs().max().item():.2g}")
    return ", ".join(found)


def measure(model, exact: bool, widths: list[int], context: int, repeats: int) -> list[str]:
    step = Step(model, exact, capacity=context + 64)
    compiled = torch.compile(step.decoder, dynamic=True, fullgraph=True)
    lean_cache = kvcache.new_cache(model)
    kvcache.forward(step.lean, lean_cache, torch.arange(1000, 1000 + context)[None], keep=1)
    lines = []
    for width in widths:
        tokens = torch.arange(2000, 2000 + width)[None]
        started = time.perf_counter()
        step.logits(compiled, context, tokens)
        seconds = time.perf_counter() - started

        def lean():
            kvcache.forward(step.lean, lean_cache, tokens, keep=width)
            kvcache.crop(lean_cache, context)

        calls = {
            "lean": lean,
            "eager": lambda: step.logits(step.decoder, context, tokens),
            "compiled": lambda: step.logits(compiled, context, tokens),
        }
        walls = {name: [] for name in calls}
        for _ in range(3):
            [call() for call in calls.values()]
        for _ in range(repeats):
            for name, call in calls.items():
                started = time.perf_counter()
                call()
                walls[name].append(time.perf_counter() - started)
        ms = {name: statistics.median(w) * 1e3 for name, w in walls.items()}
        eager, fast = (step.logits(f, context, tokens)[0, -1] for f in (step.decoder, compiled))
        lines.append(
            f"{width} token(s): lean {ms['lean']:.1f} ms, eager {ms['eager']:.1f} ms, compiled "
            f"{ms['compiled']:.1f} ms (first call, compiling: {seconds:.0f} s); compiled / lean "
            f"{ms['compiled'] / ms['lean']:.2f}; compiled logits against eager: max difference "
            f"{_gap(eager, fast):.2g}, same argmax {bool(eager.argmax() == fast.argmax())}"
        )
    lines.append(f"row-exact, compiled: width 6 against {row_exact(step, compiled, context)}")
    lines.append(f"row-exact, eager: width 6 against {row_exact(step, step.decoder, context)}")
    return lines


def main() -> None:
    parser = step_arguments()
    parser.add_argument("--kernel-threads", type=int, default=1, help="inductor's kernels' threads")
    parser.add_argument("--models", default="target,draft")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # quantized tensors announce their deprecation
    torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config

    inductor_config.cpp.threads = args.kernel_threads
    pair = default_pair()
    lines = [
        f"cpu: {cpu_flags()}",
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, inductor kernel threads "
        f"{args.kernel_threads}, context {args.context}, medians of {args.repeats}",
    ]
    print("\n".join(lines), flush=True)
    with torch.inference_mode():
        for role in args.models.split(","):
            found = measure(
                getattr(pair, role).model,
                role == "target",
                [int(w) for w in args.widths.split(",")],
                args.context,
                args.repeats,
            )
            found = ["", f"{role}:"] + [f"  {line}" for line in found]
            print("\n".join(found), flush=True)
            lines += found
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
