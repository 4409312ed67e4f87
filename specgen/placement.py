"""Where models go: parse --device, choose dtypes, and plan accelerate device maps.

The planning functions take plain numbers (device count, per-device memory budgets), so the
multi-GPU decision is testable on a machine without a GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from specgen.errors import ConfigError

_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class Placement:
    """target_map: a device map for accelerate (or a single device); the others are devices."""

    target_map: str | dict
    target_device: torch.device  # where input ids go (the embedding's device)
    draft_device: torch.device


def parse_device(value: str, option: str = "--device") -> str:
    value = value.strip().lower()
    if not _DEVICE.match(value):
        raise ConfigError(f"unknown device '{value}' for {option}; use auto, cpu, cuda or cuda:N")
    return value


def resolve_dtype(value: str, device: torch.device) -> torch.dtype:
    """'auto' -> bf16 on CPU and on CUDA that supports it, else fp16 on CUDA."""
    value = value.strip().lower()
    if value != "auto":
        if value not in _DTYPES:
            raise ConfigError(f"unknown dtype '{value}'; use auto, bfloat16, float16 or float32")
        return _DTYPES[value]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32


def cpu_supports_bf16() -> bool:
    """bf16 matmuls run (natively or through oneDNN's conversions) on this CPU."""
    try:
        a = torch.ones(4, 4, dtype=torch.bfloat16)
        return bool((a @ a)[0, 0] == 4)
    except RuntimeError:
        return False


def plan(device: str, draft_device: str | None, cuda_count: int,
         budgets: dict[int, int] | None = None) -> tuple[str, list[int], torch.device]:
    """Decide the placement kind without touching weights.

    Returns (kind, gpu ids for the target, draft device): kind is 'cpu', 'single' (one GPU)
    or 'split' (the target spread over several GPUs with a device map).
    """
    device = parse_device(device)
    if device == "auto":
        device = "cuda" if cuda_count > 0 else "cpu"
    if device.startswith("cuda") and cuda_count == 0:
        raise ConfigError(f"--device {device} asked for CUDA, but no CUDA device is available")
    if device == "cpu":
        gpus: list[int] = []
    elif device == "cuda":
        gpus = list(range(cuda_count))
    else:
        index = int(device.split(":")[1])
        if index >= cuda_count:
            raise ConfigError(f"--device {device} does not exist; this machine has {cuda_count} "
                              f"CUDA device(s)")
        gpus = [index]
    kind = "cpu" if not gpus else ("single" if len(gpus) == 1 else "split")
    if draft_device is not None:
        draft = parse_device(draft_device, "--draft-device")
        if draft == "auto":
            draft_device = None
        elif draft.startswith("cuda") and (cuda_count == 0 or (
                ":" in draft and int(draft.split(":")[1]) >= cuda_count)):
            raise ConfigError(f"--draft-device {draft} is not available on this machine")
        else:
            return kind, gpus, torch.device(draft if draft != "cuda" else "cuda:0")
    if not gpus:
        return kind, gpus, torch.device("cpu")
    if len(gpus) == 1 or not budgets:
        return kind, gpus, torch.device(f"cuda:{gpus[-1]}")
    # Several GPUs: the draft goes where the most memory is free (ties: the last GPU).
    best = max(gpus, key=lambda g: (budgets.get(g, 0), g))
    return kind, gpus, torch.device(f"cuda:{best}")


def split_device_map(config, dtype: torch.dtype, max_memory: dict) -> dict:
    """A device map for `config`'s model across the budgets in max_memory (no weights loaded)."""
    from accelerate import infer_auto_device_map, init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return infer_auto_device_map(model, max_memory=max_memory, dtype=dtype,
                                 no_split_module_classes=model._no_split_modules or [])


def first_device(device_map: dict) -> torch.device:
    """The device of the input embedding (where input ids must go)."""
    for name, where in device_map.items():
        if "embed" in name or name in ("", "model"):
            return _as_device(where)
    return _as_device(next(iter(device_map.values())))


def _as_device(where) -> torch.device:
    return torch.device(f"cuda:{where}") if isinstance(where, int) else torch.device(where)
