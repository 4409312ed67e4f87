"""Is a loaded model exact through specgen's cache? Each load proves it on a tiny random model of
its own architecture, or refuses it in one line.

The family matrix (tests/test_families.py) checks every family in `families.CHECKED` against
transformers' own `generate` on every path. A model of another type (a new architecture, a
fork), or a checked one under a newer transformers, could attend, rotate or route in a way the
slot cache does not reproduce; rather than give other text silently, `require_exact` builds
the same architecture at toy size (its config
with small dimensions and, if it slides, a window shorter than the probe), runs a prefill,
single steps, a verify-sized chain, a tree and two batched rows of different lengths through
the slot cache, and compares every logit with one full forward of the model without a cache.
It takes 20-100 ms on the CPU, whatever the real model's size. ALiBi models (Bloom, MPT), encoders and
recurrent or linear-attention layers are refused this way or by `families.windows`.
"""

from __future__ import annotations

import copy
import warnings

import torch
from transformers import AutoModelForCausalLM

from specgen.errors import ModelError
from specgen.models import families
from specgen.runtime import kvcache
from specgen.runtime.lean import call_for
from specgen.status import note

PROBE_LENGTH = 24
TOLERANCE = 1e-4  # fp32 logits of the same positions, computed in other shapes
SMALL = {  # config attributes set to toy sizes (those a config has)
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "n_embd": 64,
    "n_head": 4,
    "n_inner": 96,
    "vocab_size": 128,
}
WINDOW = 6


def require_exact(model, name: str, role: str) -> None:
    """Refuse `model` (one ModelError line) unless specgen computes it exactly: a checked
    family, or an architecture the probe proves. Says once when a rope caps the context."""
    config = families.text_config(model.config)
    model_type = getattr(config, "model_type", None)
    try:
        families.windows(config)
    except ModelError as exc:
        raise ModelError(f"the {role} model {name}: {exc}") from None
    why = probe(config)  # a checked family too: a newer transformers may have changed its code
    if why is not None:
        checked = "" if model_type in families.CHECKED else ", a type specgen's tests have not checked,"
        raise ModelError(
            f"the {role} model {name} (type {model_type!r}{checked}) would not be exact through "
            f"specgen's cache: a toy model of its architecture failed the probe: {why}",
            hint="specgen refuses a model it cannot run exactly rather than give other text",
        )
    exact = families.exact_context(config)
    if exact is not None and exact[0] < int(getattr(config, "max_position_embeddings", 0) or 0):
        note(f"specgen: {role} {name} runs up to {exact[0]} tokens: {exact[1]}")


def toy_config(config):
    """`config` at toy size: every dimension small, two layers (both kinds where they differ),
    a window shorter than the probe."""
    toy = copy.deepcopy(config)
    for key, value in SMALL.items():
        if getattr(toy, key, None) is not None:
            setattr(toy, key, value)
    if getattr(toy, "num_key_value_heads", None) is not None and getattr(toy, "multi_query", False):
        toy.num_key_value_heads = 1
    types = getattr(toy, "layer_types", None)
    if types:
        kinds = list(dict.fromkeys(types))
        toy.layer_types = (kinds * 2)[: max(2, len(kinds))]
        toy.num_hidden_layers = len(toy.layer_types)
    elif getattr(toy, "num_hidden_layers", None) is not None:
        toy.num_hidden_layers = 2
    elif getattr(toy, "n_layer", None) is not None:
        toy.n_layer = 2
    if getattr(toy, "sliding_window", None) is not None:
        toy.sliding_window = WINDOW
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(toy, key, None) is not None:
            setattr(toy, key, 0)
    return toy


@torch.inference_mode()
def probe(config) -> str | None:
    """None when a toy model of `config`'s architecture gives, through the slot cache, the
    logits of one full forward without a cache; else what differed (or why it could not run)."""
    try:
        with warnings.catch_warnings(), torch.random.fork_rng():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(toy_config(config), dtype=torch.float32).eval()
    except Exception as exc:  # noqa: BLE001 (whatever an unknown architecture raises)
        return (
            f"a toy model of it could not be built ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
        )
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(1, vocab, (2, PROBE_LENGTH), generator=torch.Generator().manual_seed(0))
    try:
        full = model(ids, use_cache=False).logits.float()
        got = _through_cache(model, ids)
    except Exception as exc:  # noqa: BLE001
        return f"it failed through specgen's cache ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    for label, (row, start, logits) in got.items():
        error = (logits - full[row, start : start + logits.shape[0]]).abs().max().item()
        if not error <= TOLERANCE:
            return f"its {label} logits differ from a full forward's by {error:.2g}"
    return None


def _through_cache(model, ids: torch.Tensor) -> dict:
    """Logits of `ids` fed through slot caches in the shapes decoding uses: label ->
    (row of ids, first position, logits [n, V])."""
    call = call_for(model)
    out = {}
    cache = kvcache.SlotCache(model.config, rows=1)
    out["prefill"] = (0, 0, kvcache.forward(call, cache, ids[:1, :12])[0])
    for step in range(12, 15):
        out[f"step {step}"] = (0, step, kvcache.forward(call, cache, ids[:1, step : step + 1])[0])
    out["verify"] = (0, 15, kvcache.forward(call, cache, ids[:1, 15:20])[0])
    # a tree beside the path: its off-path node sees only its root, and leaves no trace
    base = cache.lengths[0]
    tokens = torch.cat([ids[0, 20:22], ids[0, 5:6], ids[0, 22:24]])[None]
    tree = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]],
        dtype=torch.bool,
    )
    depth = torch.tensor([0, 1, 1, 2, 3])
    logits = kvcache.forward(call, cache, tokens, tree=tree, depth=depth)[0]
    out["tree"] = (0, 20, logits[[0, 1, 3, 4]])
    kvcache.keep_positions(cache, base, torch.tensor([0, 1, 3, 4]))
    batch = kvcache.SlotCache(model.config, rows=2)
    kvcache.forward(call, batch, ids[:1, :7], rows=slice(0, 1))
    kvcache.forward(call, batch, ids[1:, :16], rows=slice(1, 2))
    both = kvcache.forward(call, batch, torch.stack([ids[0, 7:10], ids[1, 16:19]]))
    out["batched row 1"], out["batched row 2"] = (0, 7, both[0]), (1, 16, both[1])
    return out
