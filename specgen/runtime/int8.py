"""Int8 linears for the CPU that give every row the same result alone or in a batch.

Why not torch's `quantize_dynamic`: its x86 kernel quantizes the activations with ONE scale
for the whole input matrix, so the logits of a token depend on which other tokens share its
forward. A k+1-token verify would then score a token differently from a plain one-token step,
and greedy speculative decoding would no longer reproduce plain decoding of the same model.

`RowInt8Linear` computes y = x W^T + b with
- W quantized once, per output channel, to int8 (symmetric, scale = max|W_row| / 127);
- each input row x_i divided by its own max |x_i| (so every row spans [-1, 1]), then quantized
  with one FIXED scale and zero point (7 bits, the range the x86 u8*s8 kernels take without
  saturating), multiplied in int32 by fbgemm (exact integer arithmetic), dequantized, and
  multiplied back by max |x_i|.
The fixed input scale makes the integer product of a row depend on that row only, and the
epilogue is elementwise, so a row's output is bitwise the same at any batch width (tested).
Relative error against fp32 is about 2%, the same as torch's dynamic kernel, at about its
speed (benchmarks/code-choices.md).

Whole models are converted by runtime/int8_model.py (`quantize_model`), which packs every
weight with this module's `pack`, `row_chunks` and `wide_packing`.
"""

from __future__ import annotations

import functools
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from specgen.runtime import onednn

FORMAT_VERSION = 1
_ZERO_POINT = 64
_INPUT_SCALE = 1.0 / 63.0  # x / max|x| in [-1, 1] -> round(x * 63) + 64 in [1, 127]: 7 bits


OPS = ("linear_prepack", "linear_unpack", "linear_with_input_q_dq_qweight_dq_output_fp32")


def available() -> bool:
    """Whether this torch has fbgemm's x86 kernels and the quantized ops they are reached by
    (deprecated in torch 2.13; a torch without them loads 16- or 32-bit weights instead:
    benchmarks/int8-kernels.md)."""
    engines = torch.backends.quantized.supported_engines
    return ("x86" in engines or "fbgemm" in engines) and all(has_op(name) for name in OPS)


def has_op(name: str) -> bool:
    try:
        getattr(torch.ops.quantized, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _engine() -> None:
    engines = torch.backends.quantized.supported_engines
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        torch.backends.quantized.engine = "x86" if "x86" in engines else "fbgemm"


QUANTIZE_ROWS = 8192  # rows quantized at a time: fp32 temporaries of a block, not of the whole weight


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], fp32 scales [N]), symmetric per output channel. Row blocks
    (each row's scale is its own, so the result is the same): a 16-bit output layer of 151936
    rows made three fp32 temporaries of 0.93 GB each at once."""
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], QUANTIZE_ROWS):
        block = weight[start : start + QUANTIZE_ROWS].detach().to(torch.float32, copy=True)
        block_scales = block.abs().amax(dim=1).clamp_(min=1e-12).div_(127.0)
        # in place on the block's own copy: half the time of fresh temporaries, the same numbers
        q[start : start + QUANTIZE_ROWS] = block.div_(block_scales[:, None]).round_().clamp_(-127, 127)
        scales[start : start + QUANTIZE_ROWS] = block_scales
    return q, scales


def pack(qweight: torch.Tensor, scales: torch.Tensor):
    _engine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors announce their deprecation
        qtensor = torch._make_per_channel_quantized_tensor(
            qweight, scales.double(), torch.zeros(len(scales), dtype=torch.long), 0
        )
        return torch.ops.quantized.linear_prepack(qtensor, None)


# fbgemm packs a tall weight several times slower per weight than one of 20K rows or fewer (the
# 1.5B target's 151936-row output layer), and one weight is packed by one thread; so weights
# taller than CHUNK_ABOVE rows are packed as row chunks of
# CHUNK_ROWS, in parallel. The forward multiplies the chunks one after the other into one
# output (each output channel's product is its own: bitwise the same, tested) at the same speed.
CHUNK_ABOVE = 32768
CHUNK_ROWS = 20480


def _pack_all(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> list:
    """fbgemm packs one weight on one thread: pack (int8 rows, scales) pairs on every thread."""
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        return list(pool.map(lambda part: pack(*part), parts))


def linear_of(weight: torch.Tensor, bias: torch.Tensor | None = None) -> "RowInt8Linear":
    """A RowInt8Linear for one [N, K] weight, a tall one packed as row chunks in parallel."""
    return linears_of([weight], [bias])[0]


def linears_of(
    weights: list[torch.Tensor], biases: list[torch.Tensor | None], wide: bool = True
) -> list["RowInt8Linear"]:
    """RowInt8Linears for several weights, their row chunks all packed at once in parallel.
    `wide=False` packs them for fbgemm only: every width through fbgemm (the same numbers), with
    no second packing to pay for where wide products are rare (a draft head's vocabulary
    blocks, packed when its text first needs them)."""
    quantized = [quantize_weight(weight) for weight in weights]
    chunked = [row_chunks(q, scales) for q, scales in quantized]
    packed = iter(_pack_all([chunk for chunks in chunked for chunk in chunks]))
    linears = []
    for (q, scales), chunks, bias in zip(quantized, chunked, biases):
        parts = [next(packed) for _ in chunks]
        one = parts[0] if len(parts) == 1 else tuple(parts)
        linears.append(RowInt8Linear(q, scales, bias, one, wide_packing(chunks, parts) if wide else None))
    return linears


def row_chunks(q: torch.Tensor, scales: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(int8 rows, scales) as fbgemm should pack them: whole, or as row chunks when tall."""
    if len(q) <= CHUNK_ABOVE:
        return [(q, scales)]
    return [(q[i : i + CHUNK_ROWS], scales[i : i + CHUNK_ROWS]) for i in range(0, len(q), CHUNK_ROWS)]


def row_linear(
    x: torch.Tensor, packed, bias: torch.Tensor | None, wide: onednn.Wide | None = None
) -> torch.Tensor:
    """y = x W^T + b with each row of `x` quantized on its own (see the module docstring).
    `packed`: one fbgemm weight, or a tuple of row chunks of one; `wide`: the same weight packed
    for oneDNN, which multiplies onednn.WIDE rows or more (AMX CPUs; bitwise fbgemm's output).

    Six dispatches on the hot path and no reshapes: fbgemm's op takes the input's leading
    dimensions as they are."""
    dtype = x.dtype
    rows = x if dtype == torch.float32 else x.float()
    peak = torch.amax(torch.abs(rows), -1, True).clamp_(min=1e-30)  # 5x cheaper than vector_norm(inf)
    scaled = rows / peak
    if wide is not None and scaled.numel() >= onednn.WIDE * scaled.shape[-1]:
        out = onednn.product(scaled, _INPUT_SCALE, _ZERO_POINT, wide)
    elif isinstance(packed, tuple):
        out = torch.cat([_int8_product(scaled, _INPUT_SCALE, _ZERO_POINT, p) for p in packed], -1)
    else:
        out = _int8_product(scaled, _INPUT_SCALE, _ZERO_POINT, packed)
    out = torch.addcmul(bias, out, peak) if bias is not None else out.mul_(peak)
    return out if dtype == torch.float32 else out.to(dtype)


def _int8_product(x, scale, zero_point, packed):
    """fbgemm: quantize x with (scale, zero_point), int32 product with the packed int8 weight,
    dequantize to fp32 with the weight's per-channel scales."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, scale, zero_point, packed)


def wide_packing(parts: list[tuple[torch.Tensor, torch.Tensor]], packed: list) -> onednn.Wide | None:
    """Row chunks packed for oneDNN too, where it serves their wide products with the numbers of
    their fbgemm packing `packed` (else None: fbgemm serves every width)."""
    products = [
        functools.partial(_int8_product, scale=_INPUT_SCALE, zero_point=_ZERO_POINT, packed=p) for p in packed
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors announce their deprecation
        return onednn.packing(parts, products, _INPUT_SCALE, _ZERO_POINT)


def _unpacked(packed) -> torch.Tensor:
    """The dequantized weight of one packed weight or of its row chunks."""
    chunks = packed if isinstance(packed, tuple) else (packed,)
    return torch.cat([torch.ops.quantized.linear_unpack(p)[0].dequantize() for p in chunks])


def has_wide(model: nn.Module) -> bool:
    """Whether any int8 linear of `model` is packed for oneDNN's wide products too (a verify's
    cost differs with it: the draft-length cache keys on it)."""
    for module in model.modules():
        if type(module) is RowInt8Linear and module._wide is not None:
            return True
        if isinstance(module, RowInt8Part) and module._fused.wide is not None:
            return True
    return False


class RowInt8Linear(nn.Module):
    """A drop-in nn.Linear replacement: int8 weights, per-row exact activation quantization."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        packed=None,
        wide: onednn.Wide | None = None,
    ):
        """`packed` (with `wide`, oneDNN's packing where it serves wide products): the weight
        already packed; else it is packed here."""
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        if packed is None:
            packed = pack(qweight, scales)
            wide = wide_packing([(qweight, scales)], [packed])
        self._packed, self._wide = packed, wide
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def packed(
        cls, packed, shape: tuple[int, int], bias: torch.Tensor | None, wide: onednn.Wide | None = None
    ) -> "RowInt8Linear":
        """One around an already packed weight (or its row chunks) of `shape` [N, K]."""
        linear = cls.__new__(cls)
        nn.Module.__init__(linear)
        linear.out_features, linear.in_features = shape
        linear._packed, linear._wide = packed, wide
        linear.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        return linear

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (for inspection and tests; the forward never builds it)."""
        return _unpacked(self._packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_linear(x, self._packed, self.bias, self._wide)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row"


class Fused:
    """Sibling linears that read the same input (q/k/v, gate/up) as ONE int8 product.

    A decoder layer calls q_proj(x), k_proj(x), v_proj(x) one after the other; the first call
    computes all three (one row quantization, one fbgemm call over the concatenated weights)
    and the others take their columns. Each output channel's integer product and epilogue are
    those of the separate linear, so the parts are bitwise what the separate linears give
    (tested). One product instead of three halves the cost of q/k/v at one row
    (benchmarks/code-choices.md)."""

    def __init__(self, packed, bias: torch.Tensor | None, sizes: list[int], wide: onednn.Wide | None = None):
        self.packed, self.bias, self.sizes, self.wide = packed, bias, sizes, wide
        self._input = self._parts = None
        self._served: set[int] = set()

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if x is not self._input or index in self._served:  # a new input (or the same part asked twice)
            self._input, self._served = x, set()
            self._parts = row_linear(x, self.packed, self.bias, self.wide).split(self.sizes, -1)
        part = self._parts[index]
        self._served.add(index)
        if len(self._served) == len(self.sizes):  # every sibling served: hold no tensors
            self._input = self._parts = None
        return part


class RowInt8Part(RowInt8Linear):
    """One linear of a `Fused` group; looks like the RowInt8Linear it replaces."""

    def __init__(self, fused: Fused, index: int, in_features: int):
        nn.Module.__init__(self)
        self._fused, self._index = fused, index
        self.in_features, self.out_features = in_features, fused.sizes[index]
        start = sum(fused.sizes[:index])
        self.bias = (
            None
            if fused.bias is None
            else nn.Parameter(fused.bias[start : start + self.out_features], requires_grad=False)
        )

    @property
    def weight(self) -> torch.Tensor:
        start = sum(self._fused.sizes[: self._index])
        return _unpacked(self._fused.packed)[start : start + self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused.part(x, self._index)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fused part {self._index} of {len(self._fused.sizes)}"
