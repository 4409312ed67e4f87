"""What an int8 model keeps besides its int8 linears: its other weights in fp32, and fp32
activations (runtime/int8.py replaces the linears; this is the rest of the model)."""

from __future__ import annotations

import torch
from torch import nn


class Fp32Embedding(nn.Embedding):
    """An input embedding that keeps its table in the dtype it was loaded in and returns fp32
    rows: the int8 model's activations are fp32, and widening a 16-bit value is exact, so this
    is bitwise what an fp32 table gives, at half the memory (0.47 GB for the 1.5B target)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids).float()


def rest_in_fp32(model: nn.Module) -> None:
    """Every parameter and buffer left after the linears became int8 (norms, biases, rotary
    tables) in fp32; an input embedding keeps its table and returns fp32 rows (its class is
    swapped, so hooks on it, such as a pruned head's, stay)."""
    for module in model.modules():
        if type(module) is nn.Embedding and module.weight.dtype in (torch.bfloat16, torch.float16):
            module.__class__ = Fp32Embedding
            continue
        if isinstance(module, Fp32Embedding):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_floating_point() and param.dtype != torch.float32:
                setattr(module, name, nn.Parameter(param.detach().float(), requires_grad=False))
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_floating_point() and buffer.dtype != torch.float32:
                module._buffers[name] = buffer.float()


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a model's activations run in: fp32 behind an Fp32Embedding, else its weights'."""
    if isinstance(model.get_input_embeddings(), Fp32Embedding):
        return torch.float32
    return next(model.parameters()).dtype
