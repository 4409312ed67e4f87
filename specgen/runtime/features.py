"""The target's hidden states an EAGLE-3 head reads, kept as the target runs.

An EAGLE-3 head drafts from the target's own features: the residual stream entering three of
its layers (low, middle, high), side by side. A cache made with `taps` (kvcache.SlotCache)
keeps them at the slots of every forward (slots.FeatureBuffer); this module makes a model's
forward hand them over:

* the lean CPU forward (runtime/lean.py) captures them in its layer loop;
* any other forward (transformers' own, a compiled one) through forward pre-hooks on the
  decoder layers, installed once by `install(model)`; they look at the cache the layer is
  given and do nothing when it keeps no features.

Layer ids mean what vLLM's mean: id i is the stream entering layer i (transformers'
`output_hidden_states[i]`); id L (the layer count) is the last layer's output, before the
final norm. models/eagle_head.default_layers is vLLM's choice when a head names none.
"""

from __future__ import annotations

import torch

from specgen.models.compat import CACHE_ARG


def decoder_layers(model) -> list[torch.nn.Module]:
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError("the target has no decoder layers to read features from")
    return list(layers)


def install(model) -> None:
    """Pre-hooks on every decoder layer (and a hook after the last) that give the cache a layer
    is called with the hidden states entering it; idempotent."""
    if getattr(model, "_specgen_feature_hooks", False):
        return
    layers = decoder_layers(model)

    def entering(index: int):
        def hook(module, args, kwargs):
            cache = kwargs.get(CACHE_ARG)
            if getattr(cache, "taps", None):
                cache.capture(index, args[0] if args else kwargs["hidden_states"])

        return hook

    def leaving(module, args, kwargs, output):
        cache = kwargs.get(CACHE_ARG)
        if getattr(cache, "taps", None):
            cache.capture(len(layers), output[0] if isinstance(output, tuple) else output)

    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(entering(index), with_kwargs=True)
    layers[-1].register_forward_hook(leaving, with_kwargs=True)
    model._specgen_feature_hooks = True
