"""EAGLE-3 heads on disk: recognise, load and write the two public layouts.

* **Original** (SafeAILab's EAGLE-3, SpecForge; vLLM `--speculative-config '{"method": "eagle3",
  ...}'`): a one-layer Llama `config.json` with `draft_vocab_size` (architectures
  `LlamaForCausalLMEagle3`, or `LlamaForCausalLM` in EAGLE's own training config), weights
  `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d` in `model.safetensors` or
  `pytorch_model.bin`; the token embedding comes from the target unless `embed_tokens.weight`
  is saved. Aux layers, when named, are in `eagle_config.eagle_aux_hidden_state_layer_ids` in
  SGLang's numbering (the output of layer i), so the layer whose input is read is i + 1.
* **Speculators** (vLLM's `speculators`): `speculators_model_type: "eagle3"`, the layer's
  config in `transformer_layer_config`, `draft_vocab_size`, `norm_before_residual`,
  `eagle_aux_hidden_state_layer_ids` (vLLM's numbering: the input of layer i), weights with
  `layers.0.` where the original has `midlayer.`.

Unset aux layers mean vLLM's default (features.default_layers). A head made for another
target (hidden size, vocabulary, layer ids) is refused with one line (`HeadError`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specgen.errors import ConfigError, ModelError
from specgen.files import atomic_write, write_text
from specgen.models.eagle_head import Eagle3Head, HeadConfig, check_layers, default_layers
from specgen.models.families import text_config
from specgen.models.head_dir import read_config
from specgen.models.model_files import check_config

ORIGINAL, SPECULATORS = "original", "speculators"
FORMATS = (ORIGINAL, SPECULATORS)


class HeadError(ConfigError):
    """A directory that is not a usable EAGLE-3 head for this target."""


def _format(config: dict) -> str:
    return SPECULATORS if config.get("speculators_model_type") == "eagle3" else ORIGINAL


def head_config(config: dict, target_layers: int) -> HeadConfig:
    """The HeadConfig a config.json describes, aux layers resolved for a target of `target_layers`."""
    fmt = _format(config)
    try:  # every size, id and rope setting, the field named (model_files)
        check_config(config, "the head's config.json", "head")
    except ModelError as exc:
        raise HeadError(str(exc), hint=exc.hint) from None
    layer = dict(config.get("transformer_layer_config") or {}) if fmt == SPECULATORS else config
    eagle = config.get("eagle_config")
    if eagle is not None and not isinstance(eagle, dict):
        raise HeadError(
            f"the head's config.json: eagle_config is {type(eagle).__name__}; it must be an object"
        )
    try:
        hidden = int(layer["hidden_size"])
        heads = int(layer["num_attention_heads"])
        kv = int(layer.get("num_key_value_heads") or heads)
        vocab = int(layer["vocab_size"])
        draft_vocab = int(config.get("draft_vocab_size") or layer.get("draft_vocab_size") or vocab)
        inter = int(layer["intermediate_size"])
    except KeyError as exc:
        raise HeadError(f"the head's config.json lacks {exc}") from None
    except (TypeError, ValueError) as exc:
        raise HeadError(f"the head's config.json holds an unusable value: {exc}") from None
    if draft_vocab > vocab:
        raise HeadError(
            f"the head's config.json: draft_vocab_size {draft_vocab} is larger than vocab_size {vocab}",
            hint="a draft vocabulary is a part of the target's",
        )
    if layer.get("head_dim") is None and hidden % heads:
        raise HeadError(
            f"the head's config.json: hidden_size {hidden} is not a multiple of num_attention_heads "
            f"{heads} (and no head_dim is given)"
        )
    if fmt == SPECULATORS:
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        norm_before = bool(config.get("norm_before_residual", True))  # vLLM's reading of a missing field
    else:
        ids = (eagle or {}).get("eagle_aux_hidden_state_layer_ids")
        norm_before = False
    if ids is not None and (
        not isinstance(ids, list)
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
    ):
        raise HeadError(
            f"the head's config.json: eagle_aux_hidden_state_layer_ids is {ids!r:.60}; it must be a "
            "list of layer numbers"
        )
    if ids and fmt == ORIGINAL:
        ids = [i + 1 for i in ids]  # SGLang numbers a layer's output
    layers = tuple(ids) if ids else default_layers(target_layers)
    return HeadConfig(
        hidden_size=hidden,
        heads=heads,
        kv_heads=kv,
        head_dim=int(layer.get("head_dim") or hidden // heads),
        intermediate_size=inter,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        layers=layers,
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(layer.get("rope_theta", 10000.0)),
        rope_scaling=layer.get("rope_scaling"),
        max_position_embeddings=int(layer.get("max_position_embeddings", 32768)),
        norm_before_residual=norm_before,
    )


def _weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    try:
        if files:
            state = {}
            for file in files:
                state.update(load_file(str(file)))
            return state
        if (path / "pytorch_model.bin").is_file():
            return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or corrupt file: safetensors and torch raise their own kinds
        raise HeadError(
            f"the head's weights in {path} cannot be read ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'corrupt'})"
        ) from None
    raise HeadError(f"{path} has no model.safetensors or pytorch_model.bin")


def _rename(key: str) -> str:
    key = key[len("model.") :] if key.startswith("model.") else key
    return "midlayer." + key[len("layers.0.") :] if key.startswith("layers.0.") else key


def load_head(path: str | Path, target_model) -> Eagle3Head:
    """The head in `path`, checked against the target it will draft for; HeadError if it does not fit."""
    path = Path(path)
    config = read_config(path)
    if config is None:
        raise HeadError(f"{path} is not an EAGLE-3 head (no config.json naming one)")
    target = text_config(target_model.config)
    hc = head_config(config, target.num_hidden_layers)
    try:
        check_layers(hc.layers, target.num_hidden_layers)
    except ValueError as exc:
        raise HeadError(f"the head does not fit this target: {exc}") from None
    embedding = target_model.get_input_embeddings()
    target_vocab = embedding.weight.shape[0]
    if hc.hidden_size != target.hidden_size:
        raise HeadError(
            f"the head is for a target of hidden size {hc.hidden_size}; this target's is {target.hidden_size}"
        )
    if hc.vocab_size not in (target_vocab, target.vocab_size):
        raise HeadError(
            f"the head is for a vocabulary of {hc.vocab_size} tokens; this target's has {target_vocab}"
        )
    state = {_rename(k): v for k, v in _weights(path).items()}
    head = Eagle3Head(hc)
    own_embed = state.pop("embed_tokens.weight", None)
    state.setdefault("d2t", torch.zeros(hc.draft_vocab_size, dtype=torch.long))
    state.setdefault(
        "t2d",
        torch.ones(hc.vocab_size, dtype=torch.bool) if hc.draft_vocab_size == hc.vocab_size else head.t2d,
    )
    wanted = head.state_dict()
    missing = sorted(set(wanted) - set(state))
    if missing:
        raise HeadError(
            f"the head's weights lack {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
        )
    for key, tensor in wanted.items():
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise HeadError(
                f"the head's {key} is {tuple(state[key].shape)}, its config says {tuple(tensor.shape)}"
                + (" (a head for another target?)" if key == "fc.weight" else "")
            )
    broken = [k for k in wanted if state[k].is_floating_point() and not bool(torch.isfinite(state[k]).all())]
    if broken:  # a diverged training's: greedy drafting would only propose junk, sampling would fail
        raise HeadError(f"the head's {broken[0]} holds NaN or infinite weights (a training that diverged)")
    head.load_state_dict({k: state[k].to(wanted[k].dtype) for k in wanted})
    targets = head.draft_to_target()
    if int(targets.min()) < 0 or int(targets.max()) >= target_vocab:
        raise HeadError("the head's d2t maps draft ids outside this target's vocabulary")
    if own_embed is not None:
        if tuple(own_embed.shape) != (target_vocab, hc.hidden_size) and own_embed.shape[0] != hc.vocab_size:
            raise HeadError(f"the head's embed_tokens is {tuple(own_embed.shape)}")
        head.use_embedding(torch.nn.Embedding.from_pretrained(own_embed.float(), freeze=True))
    else:
        head.use_embedding(embedding)
    return head.eval()


def save_head(
    head: Eagle3Head,
    path: str | Path,
    fmt: str = ORIGINAL,
    target_name: str = "",
    target_layers: int | None = None,
) -> None:
    """Write `head` in `fmt` (ORIGINAL or SPECULATORS): config.json and model.safetensors."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: choose {', '.join(FORMATS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hc = head.config
    layer = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": hc.hidden_size,
        "num_attention_heads": hc.heads,
        "num_key_value_heads": hc.kv_heads,
        "head_dim": hc.head_dim,
        "intermediate_size": hc.intermediate_size,
        "hidden_act": "silu",
        "vocab_size": hc.vocab_size,
        "draft_vocab_size": hc.draft_vocab_size,
        "rms_norm_eps": hc.rms_norm_eps,
        "rope_theta": hc.rope_theta,
        "rope_scaling": hc.rope_scaling,
        "max_position_embeddings": hc.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    if fmt == ORIGINAL:
        config = dict(layer)
        if target_layers is None or hc.layers != default_layers(target_layers):
            config["eagle_config"] = {
                "eagle_aux_hidden_state_layer_ids": [i - 1 for i in hc.layers],
                "use_aux_hidden_state": True,
            }
    else:
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": {k: v for k, v in layer.items() if k != "architectures"},
            "draft_vocab_size": hc.draft_vocab_size,
            "norm_before_residual": hc.norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": list(hc.layers),
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": 4,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "verifier": {"name_or_path": target_name, "architectures": []},
            },
        }
        state = {
            ("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v
            for k, v in state.items()
        }
    # each file whole or not at all: a head cut short by Ctrl-C or a full disk would load as junk
    atomic_write(path / "model.safetensors", lambda tmp: save_file(state, str(tmp)))
    write_text(path / "config.json", json.dumps(config, indent=1) + "\n")


def describe(head: Eagle3Head) -> str:
    hc = head.config
    return (
        f"EAGLE-3 head: {hc.draft_vocab_size} draft ids, reads target layers {list(hc.layers)}, "
        f"{sum(p.numel() for p in head.parameters()) / 1e6:.0f}M parameters"
    )
