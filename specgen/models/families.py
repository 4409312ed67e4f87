"""Which model families run exactly through specgen's cache, and how their layers attend.

specgen calls every model through its own forward with an explicit mask (kvcache.py), so what a
family's own code would build for itself must be built here: each layer's sliding window (a
Mistral, a Gemma 2's alternating local and global layers, a Qwen2 whose top layers slide) and a
mask in the format its attention reads. `windows` says that for a config, once.

Families checked against transformers' own `generate` (tests/test_families.py: tiny random
models of each, windows shorter than the prompt, every method and path) are `CHECKED`. A model
of another type is proved on a tiny random model of its own architecture first (`probe`), or
refused in one line: never run to give other text.
"""

from __future__ import annotations

from specgen.errors import ModelError

FULL, SLIDING = "full_attention", "sliding_attention"

# model types whose every path the family matrix checks (docs/how-it-works.md: "Model families")
CHECKED = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "gemma",
        "gemma2",
        "gemma3_text",
        "phi3",
        "olmo2",
        "granite",
        "starcoder2",
        "smollm3",
        "gpt_neox",
        "gpt2",
        "gpt_oss",
    }
)


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def windows(config) -> dict[str, int | None]:
    """How `config`'s layers read the cache: each layer type's sliding window (None: the whole
    past), as the model's own code would apply them; or a ModelError naming what specgen cannot
    run exactly.

    transformers 5 names each layer's kind in `layer_types` (Gemma 2/3, Qwen2/3, SmolLM3,
    gpt-oss); a config without them (Mistral, Mixtral, Phi-3, Starcoder2, Qwen3-MoE) slides every
    layer when `sliding_window` is set, as those models' forwards do."""
    config = text_config(config)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        kinds = {FULL: None} if window is None else {SLIDING: window}
    else:
        unknown = sorted(set(types) - {FULL, SLIDING})
        if unknown:
            raise ModelError(
                f"layers of type {', '.join(unknown)} ({getattr(config, 'model_type', '?')}) are "
                "not supported: specgen runs full and sliding-window attention only"
            )
        kinds = {kind: (window if kind == SLIDING else None) for kind in dict.fromkeys(types)}
    for kind, size in kinds.items():
        if kind == SLIDING and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ModelError(
                f"the config's sliding_window is {size!r}; a sliding-window layer needs a "
                "window of at least 1 token"
            )
    return kinds


# rope types whose frequencies depend on the longest position of each forward (transformers'
# `dynamic_rope_update`): past the threshold a token's rotation depends on what it was batched
# with, so a verify, a batch or a chunked prefill would rotate it otherwise than plain decoding
SEQUENCE_DEPENDENT_ROPE = ("dynamic", "longrope")


def rope_types(config) -> set[str]:
    """Every rope type a config names (Gemma 3 has one per layer type)."""
    config = text_config(config)
    found = set()
    for source in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if not isinstance(source, dict):
            continue
        parameters = [source] + [v for v in source.values() if isinstance(v, dict)]
        found.update(
            str(p.get("rope_type") or p.get("type"))
            for p in parameters
            if p.get("rope_type") or p.get("type")
        )
    return found


def exact_context(config) -> tuple[int, str] | None:
    """(the most tokens every path computes exactly, why) when a model's rope switches its
    frequencies at some length (Phi-3's and Phi-4-mini's longrope at 4096, dynamic NTK); None
    when any length is exact."""
    config = text_config(config)
    kinds = rope_types(config) & set(SEQUENCE_DEPENDENT_ROPE)
    if not kinds:
        return None
    parameters = getattr(config, "rope_parameters", None) or {}
    limit = (
        getattr(config, "original_max_position_embeddings", None)
        or (parameters.get("original_max_position_embeddings") if isinstance(parameters, dict) else None)
        or getattr(config, "max_position_embeddings", None)
    )
    if not isinstance(limit, int) or limit < 2:
        return None
    kind = sorted(kinds)[0]
    return limit, (
        f"its {kind} rope switches frequencies past {limit} tokens by the longest position of "
        "each forward, so a verify or a batch would rotate a token otherwise than plain decoding"
    )
