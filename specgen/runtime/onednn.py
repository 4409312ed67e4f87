"""oneDNN's int8 linear for the wide products of AMX CPUs: fbgemm's numbers, faster from WIDE rows.

On a CPU with AMX (Intel Sapphire Rapids and newer), oneDNN's int8 linear
(`torch.ops.onednn.qlinear_pointwise`) multiplies 4 to 17 rows 7-26% faster than fbgemm's,
whose kernel `int8.row_linear` uses, and one to three rows up to 11% slower
(benchmarks/int8-kernels.md). So an int8 linear keeps both packings on such a CPU and chooses
per call by the rows it multiplies: one to three (a plain step, a draft step, a small batch)
through fbgemm, WIDE or more (verifies, wider batches, prompts) through oneDNN.

Choosing by width is exact only if both kernels give bitwise the same output for a row, or a
verify would score a token differently from the plain step that scores it alone. They do by
construction where it matters and by check where it does not:
- the input: `int8.row_linear` divides each row by its own peak and quantizes it with one fixed
  scale and zero point. fbgemm's op quantizes inside; for oneDNN the same quantization is done by
  `torch.quantize_per_tensor`, which on x86 calls the same fbgemm routine (`fbgemm::Quantize`),
  so the integers multiplied are the same (rounding ties included), whatever the width;
- the product is in int32, exact in both;
- the epilogue (int32 sum times input scale times the channel's weight scale, in fp32) is
  elementwise in both, but nothing promises that both kernels round it in the same order, and
  oneDNN picks its kernel by shape and width: on toy shapes (a test model's 33 x 17) and few
  rows it takes one that rounds otherwise. So `packing` multiplies random rows through both for
  each weight shape, once per process, at every width oneDNN would serve, and packs for oneDNN
  only the shapes where every output agrees bitwise (all the default pair's do: tests/test_int8.py).
  A CPU without AMX, a torch without the op, or a disagreement on a model-sized weight keeps
  fbgemm, and the first int8 load on a machine says so in one line (once per machine and torch).

`SPECGEN_INT8_WIDE=fbgemm` keeps fbgemm for every width (oneDNN's packing holds the int8
weights a second time: 1.5 GB more for the default 1.5B target).

**Short work keeps fbgemm.** oneDNN's packing and its checks cost about 3.5-4 s of a warm start
of the default pair on a 2-core Xeon with AMX (15 s against 11 s with fbgemm only), and its
faster verifies give back about 3 ms a token there: a `specgen run` of 128 tokens took 3.5 s
less with fbgemm only, one of 512 tokens 2.4 s less, so the two meet near 1300 tokens
(benchmarks/first-run.md). A process that loads for one short answer therefore loads within
`fbgemm_only()` (cli/run.py: a single prompt of up to SHORT_TOKENS new tokens and
SHORT_PROMPT_CHARS characters); chat, serve, bench and prompt files, which keep their weights
for many answers, pack for oneDNN. `SPECGEN_INT8_WIDE=onednn` packs for it whatever the work.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
from typing import Callable, NamedTuple

import torch

from specgen.files import cache_root, write_text
from specgen.status import note

WIDE = 4  # rows from which oneDNN's product is the faster (AMX, 2026-11-28: int8-kernels.md)
ENV = "SPECGEN_INT8_WIDE"
SHORT_TOKENS = 1024  # new tokens of a single answer that cannot repay oneDNN's packing (module doc)
SHORT_PROMPT_CHARS = 8000  # a prompt read about 1.2 s faster per 1000 tokens with oneDNN: about 2000 tokens
_fbgemm_only = False  # set while a load for short work runs (`fbgemm_only`)


class Wide(NamedTuple):
    """One int8 weight (or its row chunks, for a tall one) packed for oneDNN."""

    weights: tuple[torch.Tensor, ...]  # oneDNN-packed int8 weights, one per row chunk
    scales: tuple[torch.Tensor, ...]  # fp32 per output channel
    zeros: tuple[torch.Tensor, ...]  # int64 zero points per output channel (all 0: symmetric)


def packing(
    parts: list[tuple[torch.Tensor, torch.Tensor]],
    products: list[Callable[[torch.Tensor], torch.Tensor]],
    scale: float,
    zero_point: int,
) -> Wide | None:
    """The (int8 rows, scales) chunks of one weight packed for oneDNN, where it serves wide
    products here and gives, for each chunk's shape, bitwise what fbgemm's product of that chunk
    (`products`, scaled rows -> output) gives at every width it would serve; else None."""
    if _fbgemm_only or not usable():
        return None
    wide = pack(parts)
    for (q, _), fbgemm, chunk in zip(parts, products, zip(*wide)):
        if not _agrees(tuple(q.shape), fbgemm, Wide(*([t] for t in chunk)), scale, zero_point):
            return None
    return wide


@contextlib.contextmanager
def fbgemm_only():
    """Int8 weights loaded within it are packed for fbgemm only, for work too short to repay
    oneDNN's packing (see the module doc); unless `SPECGEN_INT8_WIDE=onednn` asks for oneDNN.
    Exact either way: oneDNN serves only where it gives fbgemm's numbers."""
    global _fbgemm_only
    before = _fbgemm_only
    _fbgemm_only = os.environ.get(ENV, "").strip().lower() != "onednn"
    try:
        yield
    finally:
        _fbgemm_only = before


def short_work(new_tokens: int, prompt: str) -> bool:
    """Whether one answer of `new_tokens` to `prompt` is too short to repay oneDNN's packing."""
    return new_tokens <= SHORT_TOKENS and len(prompt) <= SHORT_PROMPT_CHARS


CHECKED_ROWS = (*range(WIDE, 18), 24, 33, 64)  # verifies of k = 3 to 16, batches, prompts
_checked: dict[tuple[int, int], bool] = {}  # per weight shape [N, K]: oneDNN gives fbgemm's numbers
_lock = threading.Lock()


def _agrees(shape: tuple[int, int], fbgemm, wide: Wide, scale: float, zero_point: int) -> bool:
    """Whether oneDNN's product of a weight of `shape` equals fbgemm's bitwise on random rows at
    every width of CHECKED_ROWS (once per shape and process: oneDNN picks its kernel by shape and
    width, and on small shapes and few rows it takes one that rounds otherwise). A disagreement
    on a model-sized weight is said once per machine."""
    with _lock:
        if shape in _checked:
            return _checked[shape]
        x = torch.randn(max(CHECKED_ROWS), shape[1], generator=torch.Generator().manual_seed(0))
        scaled = x / x.abs().amax(-1, keepdim=True)
        good = all(
            torch.equal(fbgemm(scaled[:rows]), product(scaled[:rows], scale, zero_point, wide))
            for rows in CHECKED_ROWS
        )
        _checked[shape] = good
    if not good and shape[0] * shape[1] >= 512 * 512:
        say_once(f"oneDNN's int8 linear does not give fbgemm's numbers for {shape[0]}x{shape[1]} here")
    return good


def pack(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> Wide:
    """(int8 rows, scales) chunks packed for oneDNN."""
    return Wide(
        tuple(torch.ops.onednn.qlinear_prepack(q, None) for q, _ in parts),
        tuple(s.float() for _, s in parts),
        tuple(torch.zeros(len(s), dtype=torch.int64) for _, s in parts),
    )


def joined(parts: list[Wide]) -> Wide:
    """The row chunks of one weight, packed one task each, as one Wide."""
    return Wide(*(tuple(t for chunks in field for t in chunks) for field in zip(*parts)))


def product(scaled: torch.Tensor, scale: float, zero_point: int, wide: Wide) -> torch.Tensor:
    """What fbgemm's `linear_with_input_q_dq_qweight_dq_output_fp32(scaled, scale, zero_point,
    packed)` gives, bitwise: `scaled` quantized by fbgemm's routine, multiplied by oneDNN."""
    quantized = torch.quantize_per_tensor(scaled, scale, zero_point, torch.quint8).int_repr()
    outs = [
        torch.ops.onednn.qlinear_pointwise(
            quantized, scale, zero_point, w, s, z, None, 1.0, 0, torch.float32, "none", [], ""
        )
        for w, s, z in zip(*wide)
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs, -1)


@functools.cache
def usable() -> bool:
    """Whether oneDNN may serve wide products in this process (where it agrees with fbgemm);
    where not, the first int8 load of a machine says why, once."""
    why = unusable()
    if why is not None:
        say_once(why)
    return why is None


def unusable() -> str | None:
    """Why oneDNN cannot serve wide products here (None: it can, where it agrees with fbgemm)."""
    if os.environ.get(ENV, "").strip().lower() == "fbgemm":
        return f"{ENV}=fbgemm"
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if not (check and check()):
        return "this CPU has no AMX"
    if not all(_has(name) for name in ("qlinear_pointwise", "qlinear_prepack")):
        return f"torch {torch.__version__} lacks oneDNN's int8 linear"
    return None


def _has(name: str) -> bool:
    try:
        return getattr(torch.ops.onednn, name) is not None
    except (AttributeError, RuntimeError):
        return False


def say_once(why: str) -> None:
    """One line on the first int8 load of a machine (and torch) whose wide products stay
    fbgemm's; none where the user chose so."""
    if why.startswith(ENV):
        return
    marker = cache_root() / "int8" / "wide-kernel.json"
    record = {"torch": torch.__version__, "kernel": "fbgemm", "why": why}
    try:
        if json.loads(marker.read_text()) == record:
            return
    except (OSError, ValueError):
        pass
    note(f"int8: every product uses fbgemm's kernel ({why}; on AMX CPUs oneDNN's serves verifies)")
    try:
        write_text(marker, json.dumps(record) + "\n")
    except OSError:
        pass
