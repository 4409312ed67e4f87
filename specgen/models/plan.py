"""A pair planned before anything is read: each model's argument resolved (resolve.py), checked,
and placed (its dtype, its device map, where its input ids go).

The loading path is straight, each layer called in turn with what the last one returned:
models/ plans (here), the runtime decides each model's form (runtime/forms.py: a GGUF source on
the CPU's int8 path reads its int8 store, built first when missing), models/ reads what the plan
names (load.py), and the runtime puts the weights in the formats they run in (runtime/pair.py).
Nothing here reads weights or converts a GGUF (a multi-GPU split map excepted: it reads the
target's config, converting a GGUF to have one).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoConfig

from specgen.errors import ModelError, first_line
from specgen.models import model_files
from specgen.models import placement as placement_mod
from specgen.models.head_dir import is_head
from specgen.models.resolve import Resolved, resolve


@dataclass(frozen=True)
class Planned:
    """One model to read: its argument, resolved (a GGUF source not yet converted; None for an
    EAGLE-3 head), in `dtype`, its input ids on `device`, spread by accelerate's `device_map`
    (None: loaded whole on the CPU). Nothing of it has been read yet."""

    arg: str
    role: str  # target, draft or model: the one-line errors name it
    resolved: Resolved | None
    dtype: torch.dtype
    device: torch.device
    device_map: dict | None = None
    # read from an int8 store (runtime/int8_store.py): the only weight files read, which hold every
    # tensor but the linears' weights (those stay on the meta device, and the runtime supplies them:
    # their files are its to check and read); () for any other model
    shards: tuple[str, ...] = ()

    @property
    def without_linears(self) -> bool:
        return bool(self.shards)

    def reading(self, directory: str | Path, shards) -> "Planned":
        """This model read from `directory` (config, tokenizer), its weights from `shards` only,
        its linears' weights kept apart (its int8 store's `rest` shards)."""
        if not shards:
            raise ValueError("a model read without its linears needs the files of its other tensors")
        resolved = replace(self.resolved, path=str(directory))
        return replace(self, resolved=resolved, shards=tuple(str(shard) for shard in shards))


@dataclass(frozen=True)
class PairPlan:
    target: Planned
    draft: Planned | None  # None: no draft (plain, lookup)


def plan_pair(
    target: str,
    draft: str | None,
    *,
    device: str = "auto",
    draft_device: str | None = None,
    dtype: str = "auto",
    quiet: bool = False,
) -> PairPlan:
    """Target (and draft) resolved and placed (accelerate's device maps), nothing read (`quiet`:
    no progress from the conversion a multi-GPU split map needs)."""
    cuda_count, budgets = _gpus()
    kind, gpus, draft_dev = placement_mod.plan(device, draft_device, cuda_count, budgets)
    first = torch.device(f"cuda:{gpus[0]}") if gpus else torch.device("cpu")
    torch_dtype = placement_mod.resolve_dtype(dtype, first)
    if kind == "split":
        target_map = _split_map(target, torch_dtype, gpus, budgets, quiet)
        target_dev = placement_mod.first_device(target_map)
    else:
        target_map = {"": str(first)} if gpus else None
        target_dev = first
    planned = plan_model(
        target, dtype=torch_dtype, device_map=target_map, input_device=target_dev, role="target"
    )
    return PairPlan(planned, None if draft is None else _plan_draft_on(draft, draft_dev, dtype))


def plan_draft(
    draft: str, *, device: str = "auto", draft_device: str | None = None, dtype: str = "auto"
) -> Planned:
    """Only the draft, placed as plan_pair would place it (chat's /method and /load)."""
    cuda_count, budgets = _gpus()
    _, _, draft_dev = placement_mod.plan(device, draft_device, cuda_count, budgets)
    return _plan_draft_on(draft, draft_dev, dtype)


def _plan_draft_on(draft: str, draft_dev: torch.device, dtype: str) -> Planned:
    if is_head(draft):  # its weights in float32 (it shares the target's embedding)
        return Planned(draft, "draft", None, torch.float32, draft_dev)
    return plan_model(
        draft,
        dtype=placement_mod.resolve_dtype(dtype, draft_dev),
        device_map={"": str(draft_dev)} if draft_dev.type == "cuda" else None,
        input_device=draft_dev,
        role="draft",
    )


def plan_model(
    arg: str, *, dtype: torch.dtype, device_map, input_device: torch.device, role: str = "model"
) -> Planned:
    """One model's argument resolved (a GGUF source left unconverted) and checked; any failure is
    a one-line ModelError naming `role` (target or draft)."""
    try:
        resolved = resolve(arg, dtype, convert=False)
    except ModelError as exc:  # say which of the two it is
        raise ModelError(f"the {role} model: {exc}", hint=exc.hint) from None
    if resolved.source == "dir":  # before anything else reads its JSON: one line naming the file and field
        try:
            model_files.check_model_dir(resolved.path, role)
        except ModelError as exc:
            raise ModelError(f"the {role} model: {exc}", hint=exc.hint) from None
    if resolved.source == "dir" and resolved.path and is_head(resolved.path):
        raise ModelError(
            f"'{arg}' is an EAGLE-3 head, not a model: it drafts for its target",
            hint="give it as --draft, with the model it was trained for as --target",
        )
    return Planned(arg, role, resolved, dtype, input_device, device_map)


def _gpus() -> tuple[int, dict[int, int] | None]:
    """CUDA device count, and free memory per GPU when there are several."""
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    budgets = {i: torch.cuda.mem_get_info(i)[0] for i in range(cuda_count)} if cuda_count > 1 else None
    return cuda_count, budgets


def _split_map(target: str, dtype: torch.dtype, gpus: list[int], budgets, quiet: bool = False) -> dict:
    resolved = resolve(target, dtype, quiet=quiet)
    try:
        config = AutoConfig.from_pretrained(resolved.path, trust_remote_code=False)
    except ValueError as exc:
        if "custom code" in str(exc):
            raise foreign_code("target", target) from None
        why = first_line(exc) or type(exc).__name__
        raise ModelError(f"cannot read the target model's config '{target}': {why}") from None
    max_memory = {g: int(budgets[g] * 0.85) for g in gpus}
    return placement_mod.split_device_map(config, dtype, max_memory)


def foreign_code(role: str, arg: str) -> ModelError:
    """A model whose architecture exists only as Python code shipped with it (`auto_map`).
    Every load passes trust_remote_code=False: specgen never runs a model's own code, and
    transformers then never asks on stdin (where a scripted chat's lines would answer)."""
    return ModelError(
        f"the {role} model '{arg}' needs its own Python code to load (an auto_map to custom "
        "code); specgen never runs code that comes with a model",
        hint="use a model whose architecture transformers supports natively",
    )
