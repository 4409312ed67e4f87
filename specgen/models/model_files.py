"""A model directory's JSON files read and checked before anything else reads them.

transformers, safetensors and torch each fail in their own words on a malformed `config.json`
(a RecursionError on JSON nested 100,000 deep, a ZeroDivisionError on `num_attention_heads: 0`,
a KeyError on an unknown rope type, an allocator error on a vocabulary larger than memory), and
none of those words name the file or the field. Every value the code divides by, indexes with or
allocates from is checked here first, and a bad one is one `ModelError` line: the file, the
field, what it holds and what it should hold. No torch: the command line asks before loading.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from specgen.errors import ModelError
from specgen.text import json_value

# sizes the code divides by, allocates from or loops over: each a positive integer where present
# (names differ by family: gpt2's n_embd is the others' hidden_size)
SIZES = (
    "vocab_size",
    "hidden_size",
    "n_embd",
    "num_hidden_layers",
    "n_layer",
    "num_attention_heads",
    "n_head",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "n_inner",
    "max_position_embeddings",
    "n_positions",
    "draft_vocab_size",
)
# counts that are 0 where a family does not use them (experts of a dense model); never negative
COUNTS = ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
# (sliding_window is 0 or null in configs that do not slide: families.windows checks it where a layer slides)
# positive finite numbers (norm epsilons, rope base)
POSITIVE = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "rope_theta")
TOKEN_IDS = ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id")
ROPE_FIELDS = ("rope_scaling", "rope_parameters")
# what transformers' rope code takes besides its ROPE_INIT_FUNCTIONS (read late: it imports torch)
BASE_ROPE = ("default",)
# the aliases families use for the same size
HIDDEN, HEADS, LAYERS, VOCAB = (
    ("hidden_size", "n_embd"),
    ("num_attention_heads", "n_head"),
    ("num_hidden_layers", "n_layer"),
    ("vocab_size",),
)
FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
)


def read_object(file: Path) -> dict:
    """A JSON file that must hold one object; ModelError naming the file otherwise (nested too
    deeply for Python's parser, a huge integer, bytes that are not UTF-8 included)."""
    try:
        value = json_value(file.read_bytes())
    except OSError as exc:
        raise ModelError(f"cannot read {file}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "msg", None) or str(exc).splitlines()[0][:120]
        raise ModelError(f"{file} is not valid JSON ({reason})") from None
    if not isinstance(value, dict):
        raise ModelError(f"{file} holds {_kind(value)}, not a JSON object")
    return value


def check_model_dir(path: str | Path, role: str = "model") -> dict:
    """A model directory's config.json (returned) and generation_config.json read and every field
    the code relies on checked; a ModelError naming the file and the field otherwise."""
    path = Path(path)
    config = read_object(path / "config.json")
    check_config(config, path / "config.json", role)
    generation = path / "generation_config.json"
    if generation.is_file():
        values = read_object(generation)
        vocab = _vocab(config)
        for field in TOKEN_IDS:
            if field in values:
                _token_ids(values[field], generation, field, vocab)
    return config


def check_config(config: dict, file: Path | str, role: str = "model") -> None:
    """Every size, ratio, id and rope setting of a model's (or a head's) config, and of a
    multimodal config's `text_config` / a speculators head's `transformer_layer_config`."""
    for key in ("text_config", "transformer_layer_config"):
        if key in config and config[key] is not None:
            if not isinstance(config[key], dict):
                raise _bad(file, key, config[key], "an object")
            check_config(config[key], file, role)
    for field in SIZES:
        if config.get(field) is not None:
            _positive_int(config[field], file, field)
    for field in COUNTS:
        if config.get(field) is not None:
            _count(config[field], file, field)
    for field in POSITIVE:
        if config.get(field) is not None:
            _positive_number(config[field], file, field)
    hidden, heads = _first(config, HIDDEN), _first(config, HEADS)
    head_dim = config.get("head_dim")
    if hidden is not None and heads is not None and head_dim is None and hidden % heads:
        raise ModelError(
            f"{file}: {_name(config, HIDDEN)} {hidden} is not a multiple of {_name(config, HEADS)} "
            f"{heads} (and no head_dim is given)",
            hint="the heads split the hidden size evenly",
        )
    kv = config.get("num_key_value_heads")
    if heads is not None and kv is not None and heads % kv:
        raise ModelError(
            f"{file}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}",
            hint="each key/value head serves the same number of query heads",
        )
    vocab = _vocab(config)
    for field in TOKEN_IDS:
        if field in config:
            _token_ids(config[field], file, field, vocab, embedding=field == "pad_token_id")
    for field in ROPE_FIELDS:
        if config.get(field) is not None:
            _rope(config[field], file, field)
    types = config.get("layer_types")
    if types is not None and (not isinstance(types, list) or not all(isinstance(t, str) for t in types)):
        raise _bad(file, "layer_types", types, "a list of layer type names")
    if "tie_word_embeddings" in config and not isinstance(config["tie_word_embeddings"], bool):
        raise _bad(file, "tie_word_embeddings", config["tie_word_embeddings"], "true or false")
    _fits_memory(config, file, role)


def diagnose(path: str | Path | None) -> str | None:
    """Which JSON file of a model directory does not parse or holds no object, once a load has
    failed (the loader's own error does not say which); None when each is a JSON object."""
    if not path or not Path(path).is_dir():
        return None
    for name in FILES + tuple(sorted({p.name for p in Path(path).glob("*.json")} - set(FILES))):
        file = Path(path, name)
        if file.is_file():
            try:
                read_object(file)
            except ModelError as exc:
                return str(exc)
    return None


def weight_bytes(config: dict) -> int:
    """A lower bound on what a config's weights hold at one byte per parameter (int8): the
    embedding (twice when untied) and each layer's attention and MLP (every expert's)."""
    config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    hidden, layers, vocab = _first(config, HIDDEN) or 0, _first(config, LAYERS) or 0, _vocab(config) or 0
    heads = _first(config, HEADS) or 1
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    inter = config.get("intermediate_size") or config.get("n_inner") or 4 * hidden
    experts = config.get("num_local_experts") or config.get("num_experts") or 1
    embedding = vocab * hidden * (1 if config.get("tie_word_embeddings", True) else 2)
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    return embedding + layers * (attention + 3 * hidden * inter * experts)


def memory_bytes() -> int | None:
    """This machine's physical memory, or None where it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _fits_memory(config: dict, file, role: str) -> None:
    """A config whose weights alone, at one byte each, exceed this machine's memory: refused
    before an allocator fails somewhere inside torch."""
    need, have = weight_bytes(config), memory_bytes()
    if have is not None and need > have:
        fields = ", ".join(
            f"{n} {config[n]}"
            for n in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")
            if isinstance(config.get(n), int)
        )
        raise ModelError(
            f"{file}: the {role}'s sizes ({fields}) ask for at least {_gb(need)} of weights, more "
            f"than this machine's {_gb(have)} of memory",
            hint="check the config's sizes",
        )


def _vocab(config: dict) -> int | None:
    value = config.get("vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _first(config: dict, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _name(config: dict, names: tuple[str, ...]) -> str:
    return next((n for n in names if n in config), names[0])


def _positive_int(value, file, field: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _bad(file, field, value, "a positive integer")


def _count(value, file, field: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _bad(file, field, value, "an integer of 0 or more")


def _positive_number(value, file, field: str) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise _bad(file, field, value, "a positive number")


def _token_ids(value, file, field: str, vocab: int | None, embedding: bool = False) -> None:
    """null, an id or a list of ids; a padding id (an embedding row) below the vocabulary size."""
    ids = value if isinstance(value, list) else [value]
    for item in ids:
        if item is None and not isinstance(value, list):
            continue
        if not isinstance(item, int) or isinstance(item, bool) or item < 0:
            raise _bad(file, field, value, "a token id (an integer of 0 or more), a list of them, or null")
        if embedding and vocab is not None and item >= vocab:
            raise ModelError(f"{file}: {field} {item} is outside the vocabulary (vocab_size {vocab})")


def _rope(value, file, field: str) -> None:
    """A rope setting: an object naming a known type (Gemma 3's: one such object per layer type)."""
    if not isinstance(value, dict):
        raise _bad(file, field, value, "an object")
    nested = [v for v in value.values() if isinstance(v, dict)]
    for parameters in nested if nested and not ({"rope_type", "type"} & set(value)) else [value]:
        kind = parameters.get("rope_type", parameters.get("type", "default"))
        known = _rope_types()
        if not isinstance(kind, str) or (known is not None and kind not in known):
            raise ModelError(
                f"{file}: {field} has rope type {_quote(kind)}; transformers knows "
                f"{', '.join(sorted(known or ()))}"
            )
        for name in ("factor", "rope_theta"):
            if parameters.get(name) is not None:
                _positive_number(parameters[name], file, f"{field}.{name}")


def _rope_types() -> set[str] | None:
    """The rope types transformers implements; None where its layout differs (it then checks)."""
    try:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # torch: only once a model loads
    except ImportError:
        return None
    return set(BASE_ROPE) | set(ROPE_INIT_FUNCTIONS)


def _bad(file, field: str, value, wanted: str) -> ModelError:
    return ModelError(f"{file}: {field} is {_quote(value)}; it must be {wanted}")


def _quote(value) -> str:
    text = json.dumps(value) if not isinstance(value, (dict, list)) else _kind(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value) -> str:
    return {list: "a list", dict: "an object", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _gb(size: int) -> str:
    return f"{size / 2**30:,.0f} GB" if size >= 2**30 else f"{size / 2**20:,.0f} MB"
