"""Tiny random models of every model family specgen checks, built from a config with a fixed seed.

Each family keeps what makes it itself (sliding windows shorter than the test prompts, Gemma 2's
softcaps and alternating layers, Gemma 3's local and global rope, llama3 rope scaling, MoE
routing, gpt-oss's attention sinks, SmolLM3's no-rope layers, GPT-2's learned positions) at
shapes small enough that a generation takes milliseconds. The vocabulary is tiny.py's 259-token
byte tokenizer, so any two families can be target and draft of one pair.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny import build_tokenizer

WINDOW = 8  # every sliding window: shorter than each test prompt
VOCAB, EOS, PAD = 259, 258, 256


def _common(**extra) -> dict:
    return (
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            initializer_range=0.2,
            eos_token_id=EOS,
            pad_token_id=PAD,
            bos_token_id=None,
            tie_word_embeddings=False,
        )
        | extra
    )


def _moe(**extra) -> dict:
    return _common(**extra)


def configs() -> dict:
    """family name -> a function making its config (fresh each time: configs are mutable)."""
    import transformers as T

    window = dict(sliding_window=WINDOW)
    return {
        "llama3": lambda: T.LlamaConfig(
            **_common(
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
                tie_word_embeddings=True,
            )
        ),
        "mistral": lambda: T.MistralConfig(**_common(**window)),
        "mixtral": lambda: T.MixtralConfig(**_moe(num_local_experts=4, num_experts_per_tok=2, **window)),
        "qwen2": lambda: T.Qwen2Config(**_common()),
        "qwen2-sliding": lambda: T.Qwen2Config(
            **_common(num_hidden_layers=3, use_sliding_window=True, max_window_layers=1, **window)
        ),
        "qwen2-moe": lambda: T.Qwen2MoeConfig(
            **_moe(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
            )
        ),
        "qwen3": lambda: T.Qwen3Config(**_common(head_dim=16)),
        "qwen3-moe": lambda: T.Qwen3MoeConfig(
            **_moe(
                head_dim=16,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                use_sliding_window=True,
                **window,
            )
        ),
        "gemma": lambda: T.GemmaConfig(**_common(head_dim=16)),
        "gemma2": lambda: T.Gemma2Config(
            **_common(
                head_dim=16,
                num_hidden_layers=3,
                attn_logit_softcapping=5.0,
                final_logit_softcapping=3.0,
                query_pre_attn_scalar=16,
                **window,
            )
        ),
        "gemma3": lambda: T.Gemma3TextConfig(
            **_common(
                head_dim=16,
                num_hidden_layers=3,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                query_pre_attn_scalar=16,
                **window,
            )
        ),
        "phi3": lambda: T.Phi3Config(**_common(**window)),
        "phi4": lambda: T.Phi3Config(**_common(tie_word_embeddings=True, partial_rotary_factor=0.75)),
        "olmo2": lambda: T.Olmo2Config(**_common()),
        "granite": lambda: T.GraniteConfig(
            **_common(
                embedding_multiplier=4.0,
                logits_scaling=2.0,
                residual_multiplier=0.5,
                attention_multiplier=0.2,
            )
        ),
        "starcoder2": lambda: T.Starcoder2Config(**_common(**window)),
        "smollm3": lambda: T.SmolLM3Config(**_common(num_hidden_layers=4, no_rope_layer_interval=2)),
        "gpt-neox": lambda: T.GPTNeoXConfig(
            **{k: v for k, v in _common().items() if k != "num_key_value_heads"}, rotary_pct=0.5
        ),
        "gpt2": lambda: T.GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=512,
            initializer_range=0.2,
            eos_token_id=EOS,
            pad_token_id=PAD,
            bos_token_id=EOS,
        ),
        "gpt-oss": lambda: T.GptOssConfig(
            **_moe(
                head_dim=16,
                num_local_experts=4,
                num_experts_per_tok=2,
                layer_types=["sliding_attention", "full_attention"],
                **window,
            )
        ),
    }


FAMILIES = tuple(configs())


def build(family: str, seed: int, layers: int | None = None):
    """A tiny random model of `family` (fp32, eval mode)."""
    from transformers import AutoModelForCausalLM

    config = configs()[family]()
    if layers is not None:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = config.layer_types[:layers]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    return model.eval()


def save(directory: Path, model) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return directory


def near_copy(model, seed: int, noise: float):
    """A draft that agrees with `model` often but not always: its weights plus Gaussian noise
    (so rounds accept some tokens, reject others, and sometimes all)."""
    import copy

    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(
                torch.randn(parameter.shape, generator=generator) * noise * parameter.std().nan_to_num(0)
            )
    return draft
