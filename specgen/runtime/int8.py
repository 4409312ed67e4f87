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

`quantize_model` takes already-quantized weights when it is given them (runtime/quant.py
caches them on disk); fbgemm's packing, whose layout cannot be saved, is redone at every load.
"""

from __future__ import annotations

import functools
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
from torch import nn

from specgen.memory import release_freed
from specgen.runtime import onednn
from specgen.runtime.fp32 import rest_in_fp32

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


def _pack(qweight: torch.Tensor, scales: torch.Tensor):
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
        return list(pool.map(lambda part: _pack(*part), parts))


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
    chunked = [_chunks(q, scales) for q, scales in quantized]
    packed = iter(_pack_all([chunk for chunks in chunked for chunk in chunks]))
    linears = []
    for (q, scales), chunks, bias in zip(quantized, chunked, biases):
        parts = [next(packed) for _ in chunks]
        one = parts[0] if len(parts) == 1 else tuple(parts)
        linears.append(RowInt8Linear(q, scales, bias, one, _wide(chunks, parts) if wide else None))
    return linears


def _chunks(q: torch.Tensor, scales: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
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


def _wide(parts: list[tuple[torch.Tensor, torch.Tensor]], packed: list) -> onednn.Wide | None:
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
            packed = _pack(qweight, scales)
            wide = _wide([(qweight, scales)], [packed])
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


class _Fused:
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
    """One linear of a `_Fused` group; looks like the RowInt8Linear it replaces."""

    def __init__(self, fused: _Fused, index: int, in_features: int):
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


# the sibling linears of the decoder layers of Llama-style models (Qwen2, Llama, Mistral, ...)
FUSABLE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fusable_groups(model: nn.Module) -> list[tuple[str, ...]]:
    """Full names of sibling nn.Linears that read the same input, by the names above; all with
    the same input width and all with or all without a bias."""
    groups = []
    for prefix, module in model.named_modules():
        for names in FUSABLE:
            children = [getattr(module, n, None) for n in names]
            if not all(type(c) is nn.Linear for c in children):
                continue
            if len({c.in_features for c in children}) == 1 and len({c.bias is None for c in children}) == 1:
                groups.append(tuple(f"{prefix}.{n}" if prefix else n for n in names))
    return groups


def linear_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


Weights = dict  # linear name -> (int8 weight [N, K], fp32 scales [N])


def quantize_model(
    model: nn.Module,
    cached: Callable[[dict[str, tuple]], Weights | None] = lambda shapes: None,
    store: Callable[[Weights], None] = lambda weights: None,
    fuse: bool = True,
) -> nn.Module:
    """Replace every nn.Linear of `model` (on the CPU) by a RowInt8Linear (sibling linears that
    read the same input fused into one product unless `fuse` is False); the rest runs in fp32.
    Weights come from `cached(shapes)` when it has them, else are quantized and handed to
    `store`. Returns the model (changed in place).

    The linears' full-precision weights are never converted as a whole: read one at a time
    when quantizing, not read at all when the cache has them (a memory-mapped checkpoint then
    never pages them in), and only what is left (embeddings, norms) becomes fp32 at the end.
    Converting the whole model first held an fp32 copy of every weight: 8 GB at the peak of a
    warm start of the default pair."""
    names = linear_names(model)
    shapes = {name: tuple(model.get_submodule(name).weight.shape) for name in names}
    weights = cached(shapes)
    if weights is None:
        weights = {name: quantize_weight(model.get_submodule(name).weight) for name in names}
        store(weights)
    groups = fusable_groups(model) if fuse else []
    grouped = {name for group in groups for name in group}
    jobs = [(name,) for name in names if name not in grouped] + groups
    tasks = []
    for job in jobs:  # each task owns its int8 rows: they are freed as soon as they are packed
        parts = [weights.pop(n) for n in job]
        if len(job) == 1 and not isinstance(parts[0], Deferred):  # a tall weight: row chunks, views of it
            tasks += [_PackTask(job, i, [part]) for i, part in enumerate(_chunks(*parts[0]))]
        else:  # per output channel, so concatenating is exact (done in the worker, one group at a time)
            tasks.append(_PackTask(job, 0, parts))
    tasks.sort(key=lambda task: -task.size)
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:  # fbgemm packs a weight on one thread
        done = list(pool.map(_PackTask.pack, tasks))
    packed, wides = {}, {}
    order = {job: i for i, job in enumerate(jobs)}
    for task, (results, wide) in sorted(
        zip(tasks, done), key=lambda item: (order[item[0].job], item[0].index)
    ):
        packed.setdefault(task.job, []).extend(results)
        wides.setdefault(task.job, []).append(wide)
    packed = {job: parts[0] if len(parts) == 1 else tuple(parts) for job, parts in packed.items()}
    wides = {job: None if None in parts else onednn.joined(parts) for job, parts in wides.items()}

    def replace(name, module):
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, module)

    for job in jobs:
        old = [model.get_submodule(n) for n in job]
        if len(job) == 1:
            replace(job[0], RowInt8Linear.packed(packed[job], shapes[job[0]], old[0].bias, wides[job]))
            continue
        bias = None if old[0].bias is None else torch.cat([m.bias.detach().float() for m in old])
        fused = _Fused(packed[job], bias, [m.out_features for m in old], wides[job])
        for index, (name, module) in enumerate(zip(job, old)):
            replace(name, RowInt8Part(fused, index, module.in_features))
    rest_in_fp32(model)
    release_freed()  # the int8 copies freed as they were packed (and on a first load, the quantizing)
    return model


class Deferred:
    """Int8 rows (weight, scales) read only when their packing task runs: a `cached` that
    streams them (the int8 store) holds in memory just the rows being packed."""

    def __init__(self, load: Callable[[], tuple[torch.Tensor, torch.Tensor]], numel: int):
        self.load, self.numel = load, numel


class _PackTask:
    """The int8 rows of one packing job (a linear, a row chunk of a tall one, or a fused group
    to concatenate), released when packed so the int8 copy and the packed one barely overlap."""

    def __init__(self, job: tuple[str, ...], index: int, parts: list):
        self.job, self.index, self._parts = job, index, parts
        self.size = sum(p.numel if isinstance(p, Deferred) else p[0].numel() for p in parts)

    def pack(self) -> tuple[list, onednn.Wide | None]:
        """The packed weight, or its row chunks when tall, and oneDNN's packing of them where it
        serves wide products. Then the freed int8 rows go back to
        the system: glibc keeps a freed block below its mmap threshold (which grows to 32 MB) in
        the arena that allocated it while the packed copies come from the packing threads'
        arenas, so without this the int8 copies stayed resident until packing ended."""
        parts = [p.load() if isinstance(p, Deferred) else p for p in self._parts]
        self._parts = None
        q, scales = (
            parts[0]
            if len(parts) == 1
            else (torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]))
        )
        del parts
        chunks = _chunks(q, scales)
        packed = [_pack(*part) for part in chunks]
        wide = _wide(chunks, packed)
        del q, scales, chunks
        release_freed()
        return packed, wide
