"""Whole models to row-exact int8 (runtime/int8.py's linears): every nn.Linear of a model
replaced, sibling linears that read the same input (q/k/v, gate/up) fused into one product, and
the packing of every weight spread over the machine's threads.

`quantize_model` takes already-quantized weights when it is given them (runtime/quant.py caches
them on disk, runtime/int8_store.py streams them as `Deferred` rows); fbgemm's packing, whose
layout cannot be saved, is redone at every load.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
from torch import nn

from specgen.memory import release_freed
from specgen.runtime import int8, onednn
from specgen.runtime.fp32 import rest_in_fp32

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
        weights = {name: int8.quantize_weight(model.get_submodule(name).weight) for name in names}
        store(weights)
    groups = fusable_groups(model) if fuse else []
    grouped = {name for group in groups for name in group}
    jobs = [(name,) for name in names if name not in grouped] + groups
    tasks = []
    for job in jobs:  # each task owns its int8 rows: they are freed as soon as they are packed
        parts = [weights.pop(n) for n in job]
        if len(job) == 1 and not isinstance(parts[0], Deferred):  # a tall weight: row chunks, views of it
            tasks += [_PackTask(job, i, [part]) for i, part in enumerate(int8.row_chunks(*parts[0]))]
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
            replace(job[0], int8.RowInt8Linear.packed(packed[job], shapes[job[0]], old[0].bias, wides[job]))
            continue
        bias = None if old[0].bias is None else torch.cat([m.bias.detach().float() for m in old])
        fused = int8.Fused(packed[job], bias, [m.out_features for m in old], wides[job])
        for index, (name, module) in enumerate(zip(job, old)):
            replace(name, int8.RowInt8Part(fused, index, module.in_features))
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
        chunks = int8.row_chunks(q, scales)
        packed = [int8.pack(*part) for part in chunks]
        wide = int8.wide_packing(chunks, packed)
        del q, scales, chunks
        release_freed()
        return packed, wide
