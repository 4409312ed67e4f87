"""What native code around the ops would save a CPU step: the same ops called from C++, and one
hand-written kernel for the int8 products' per-row input scaling.

    python benchmarks/native_overhead.py [--context 200] [--repeats 15] [--out FILE]

`cpu-speed.md` found about a fifth of a step outside its int8 products and named a native
extension (no Python between the ops, fused pointwise parts) as what would cut it. This
measures, in one process, on the default pair as `specgen` loads it:

* `ops per step`: the torch calls a one-token step of each model makes from Python (counted with
  a TorchFunctionMode: one per call the lean forward makes, whatever it dispatches below; the
  mode sees property reads such as `x.shape` too, which are counted apart: they dispatch nothing);
* `per call`: for the kinds of call a step makes most (a residual add, a rotary multiply, a
  concatenation, a transpose, a slot write, the scaling's row maximum, an RMSNorm), the time of
  one call from Python against the same ATen call in a C++ loop (torch's cpp_extension,
  compiled here at -O2): what the Python binding and argument parsing cost;
* `scaling`: the int8 products' per-row input scaling (abs, row maximum, clamp, divide) as
  torch's four calls against one hand-written C++ kernel called from Python, bitwise the same
  (the maximum is exact and the division elementwise), at the widths a step scales;
* what each would save a step at most: calls x the median saving, against the step's own time.

Needs a C++ compiler (the extension is built on first use, about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from specgen.config import Method, ModelSettings
from specgen.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specgen.runtime import kvcache
from specgen.runtime.lean import call_for
from specgen.runtime.pair import load

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_profile import cpu_flags  # noqa: E402  (the machine line every profile prints)
from outside_products import median_ms  # noqa: E402  (3 warm-ups, then the median)

CALLS = 20000  # calls per timing of one kind

SOURCE = r"""
#include <torch/extension.h>
#include <cmath>

// n calls of one ATen op on the given tensors: what a step's call costs without Python
double loop(const std::string &kind, at::Tensor a, at::Tensor b, at::Tensor w, int64_t n) {
  at::Tensor out;
  auto slots = at::zeros({1}, at::kLong);
  auto started = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    if (kind == "add") out = at::add(a, b);
    else if (kind == "mul") out = at::mul(a, b);
    else if (kind == "cat") out = at::cat({a, b}, -1);
    else if (kind == "transpose") out = a.view({1, 1, -1, 64}).transpose(1, 2);
    else if (kind == "index_copy") w.view({1, -1}).index_copy_(0, slots, a.view({1, -1}));
    else if (kind == "amax") out = at::amax(at::abs(a), {-1}, true);
    else if (kind == "rms_norm") out = at::rms_norm(a, {a.size(-1)}, w, 1e-6);
  }
  std::chrono::duration<double> took = std::chrono::steady_clock::now() - started;
  return took.count();
}

// the int8 products' per-row input scaling in one pass: peak = max(max |x|, 1e-30), x / peak
std::vector<at::Tensor> scale(at::Tensor x) {
  auto rows = x.numel() / x.size(-1), width = x.size(-1);
  auto out = at::empty_like(x);
  auto shape = x.sizes().vec();
  shape.back() = 1;
  auto peak = at::empty(shape, x.options());
  const float *in = x.data_ptr<float>();
  float *o = out.data_ptr<float>(), *p = peak.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float *row = in + r * width;
    float m = 0.f;
    for (int64_t i = 0; i < width; ++i) m = std::fmax(m, std::fabs(row[i]));
    m = std::fmax(m, 1e-30f);
    p[r] = m;
    for (int64_t i = 0; i < width; ++i) o[r * width + i] = row[i] / m;
  }
  return {out, peak};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("loop", &loop);
  m.def("scale", &scale);
}
"""


class Count(TorchFunctionMode):
    """The torch calls made from Python while active, by name."""

    def __init__(self):
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


def step_of(model, exact: bool, context: int):
    call = call_for(model, exact)
    cache = kvcache.new_cache(model)
    kvcache.forward(call, cache, torch.arange(1000, 1000 + context)[None], keep=1)
    token = torch.tensor([[2000]])

    def step():
        kvcache.forward(call, cache, token, keep=1)
        kvcache.crop(cache, context)

    return step


def python_call(kind: str, a, b, w):
    slots = torch.zeros(1, dtype=torch.long)
    return {
        "add": lambda: torch.add(a, b),
        "mul": lambda: a * b,
        "cat": lambda: torch.cat((a, b), -1),
        "transpose": lambda: a.view(1, 1, -1, 64).transpose(1, 2),
        "index_copy": lambda: w.view(1, -1).index_copy_(0, slots, a.view(1, -1)),
        "amax": lambda: torch.amax(torch.abs(a), -1, True),
        "rms_norm": lambda: torch.nn.functional.rms_norm(a, (a.shape[-1],), w, 1e-6),
    }[kind]


def per_call(native, hidden: int) -> dict[str, tuple[float, float]]:
    """kind -> (µs a call from Python, µs from C++), medians of five timings of CALLS calls."""
    a, b, w = torch.randn(1, hidden), torch.randn(1, hidden), torch.randn(hidden)
    out = {}
    for kind in ("add", "mul", "cat", "transpose", "index_copy", "amax", "rms_norm"):
        call = python_call(kind, a, b, w)
        py, cc = [], []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(CALLS):
                call()
            py.append((time.perf_counter() - started) / CALLS * 1e6)
            cc.append(native.loop(kind, a, b, w, CALLS) / CALLS * 1e6)
        out[kind] = (statistics.median(py), statistics.median(cc))
    return out


def scaling(native, width: int) -> tuple[float, float, bool]:
    """(µs of torch's four calls, µs of the one kernel, bitwise the same) on one row of `width`."""
    x = torch.randn(1, width)

    def torch_scale():
        peak = torch.amax(torch.abs(x), -1, True).clamp_(min=1e-30)
        return x / peak, peak

    same = all(torch.equal(p, q) for p, q in zip(torch_scale(), native.scale(x)))
    py, cc = [], []
    for _ in range(5):
        for calls, call in ((py, torch_scale), (cc, lambda: native.scale(x))):
            started = time.perf_counter()
            for _ in range(CALLS):
                call()
            calls.append((time.perf_counter() - started) / CALLS * 1e6)
    return statistics.median(py), statistics.median(cc), same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from torch.utils.cpp_extension import load_inline

    torch.set_grad_enabled(False)
    started = time.perf_counter()
    native = load_inline("specgen_native_overhead", cpp_sources=SOURCE, extra_cflags=["-O2"])
    lines = [
        f"machine: {cpu_flags()}; torch {torch.__version__}, {torch.get_num_threads()} threads",
        f"extension built or loaded in {time.perf_counter() - started:.0f} s",
    ]
    print(*lines, sep="\n", flush=True)
    settings = ModelSettings(DEFAULT_TARGET, DEFAULT_DRAFT, draft_quant="auto", target_quant="auto")
    pair = load(settings, Method.CHAIN, quiet=True)
    for name, model, exact in (("target", pair.target.model, True), ("draft", pair.draft.model, False)):
        model.requires_grad_(False)
        step = step_of(model, exact, args.context)
        step()
        with Count() as counted:
            step()
        # a property read (x.shape, x.dtype) is a call only under the mode: outside it no dispatch
        calls = sum(n for name, n in counted.calls.items() if name != "__get__")
        wall = median_ms(step, args.repeats)
        hidden = model.config.hidden_size
        timings = per_call(native, hidden)
        savings = sorted(py - cc for py, cc in timings.values())
        saved = calls * statistics.median(savings) / 1e3
        reads = counted.calls["__get__"]
        out = [
            "",
            f"{name}: one-token step over {args.context} cached tokens, {wall:.1f} ms (median of "
            f"{args.repeats}); {calls} torch calls from Python (and {reads} property reads)",
            "  most frequent: " + ", ".join(f"{k} {v}" for k, v in counted.calls.most_common(12)),
            f"  per call at hidden size {hidden} (µs, from Python -> from C++):",
        ]
        out += [f"    {kind:<11} {py:6.2f} -> {cc:6.2f}" for kind, (py, cc) in timings.items()]
        out.append(
            f"  a C++ loop over the same calls would save about {saved:.1f} ms a step "
            f"({100 * saved / wall:.1f}%; median saving {statistics.median(savings):.2f} µs a call, "
            f"range {savings[0]:.2f}-{savings[-1]:.2f})"
        )
        print(*out, sep="\n", flush=True)
        lines += out
    out = ["", "the int8 products' input scaling, one row (µs: torch's four calls -> one C++ kernel):"]
    for width in (896, 1536, 4864, 8960):
        py, cc, same = scaling(native, width)
        out.append(f"  width {width:>5}: {py:6.2f} -> {cc:6.2f}  bitwise the same: {same}")
    print(*out, sep="\n", flush=True)
    lines += out
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
