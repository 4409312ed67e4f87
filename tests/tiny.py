"""Tiny random models and a byte-level tokenizer, built from a config with a fixed seed.

Saved to a directory and loaded back through specgen's own loading code, so tests exercise
what users hit without downloading anything.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(extra_token: str | None = None, eos: str = "<|im_end|>"):
    """A 259-token byte-level BPE tokenizer with no merges (every byte is a token)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    specials = SPECIALS + ([extra_token] if extra_token else [])
    for token in specials:
        vocab[token] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer (Llama 2, Mistral, Gemma): a few pieces, `<0xNN>` byte
    tokens for everything else, and a decoder that turns a run of bytes that is not UTF-8 into
    one U+FFFD per byte (valid bytes of the run too)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in [
        "\u2581",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "a",
        "b",
        "c",
        "x",
        "y",
        "z",
        "\u00e9",
        "\u65e5",
    ]:
        vocab.setdefault(piece, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens([AddedToken(t, special=True) for t in ["<unk>", "<s>", "</s>", *SPECIALS[1:]]])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="<|im_end|>", unk_token="<unk>", pad_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_byte_fallback_llama(directory: Path, seed: int, layers: int = 2) -> Path:
    """A tiny Llama with `build_byte_fallback_tokenizer`'s tokenizer, saved."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_byte_fallback_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        bos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_model(
    seed: int,
    *,
    layers: int = 2,
    hidden: int = 64,
    context: int = 256,
    vocab: int = 259,
    init_range: float = 0.3,
    eos_id: int = 258,
    pad_id: int = 256,
):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        initializer_range=init_range,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=pad_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    return model.eval()


def save_tiny(directory: Path, seed: int, tokenizer=None, **kwargs) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    build_model(seed, **kwargs).save_pretrained(directory)
    (tokenizer or build_tokenizer()).save_pretrained(directory)
    return directory


def two_token_law(model, prompt: list[int], sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """A model's exact plain-sampling laws after `prompt`: q0 of the first token [V] and of
    the first two tokens [V, V] (row t: the first token is t), warped as `sampling` says."""
    from specgen.decoding.sampling import warp

    vocab = model.config.vocab_size
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1]
        second = model(torch.tensor([prompt + [t] for t in range(vocab)])).logits[:, -1]  # row t: after t
    q0 = warp(first, sampling).double()
    return q0, q0[:, None] * warp(second, sampling).double()


def decode(engine, prompt: list[int], config, resume=None):
    """One prompt through the engine's loop: (its rounds and replays, its final DecodeState);
    `resume`: the DecodeState of an earlier generation it continues."""
    from specgen.decoding.engine import FRESH  # tiny.py imports no specgen module at its top
    from specgen.decoding.events import ReplayResult, RoundResult

    events, state = [], resume
    for report in engine.generate([prompt], config, resume=FRESH if resume is None else resume):
        state = report.state
        if isinstance(report.event, (RoundResult, ReplayResult)):
            events.append(report.event)
    return events, state


class RowDrafterBase:
    """The RowDrafter calls a scripted test drafter does not need (base.PerRow serves it)."""

    def start(self, prompt_ids, generator=None, capacity=0):
        pass

    def rewind(self, valid):
        pass

    def observe(self, path):
        pass

    def setup_seconds(self):
        return 0.0


def per_row(drafter):
    """One RowDrafter instance as the engine's drafter (a single prompt: every row is it)."""
    from specgen.decoding.drafters.base import PerRow

    return PerRow(lambda: drafter)


def engine_with(pair, config, stop_ids=None, compile: str = "off", **policy):
    """An engine for `config.method` on a (target, draft) pair, its drafter built as run's is;
    `policy`: the engine.Policy fields it is built with."""
    from specgen.decoding.build import make_drafter
    from specgen.decoding.engine import Engine
    from specgen.decoding.policy import Policy
    from specgen.runtime.pair import Pair

    target, draft = pair
    drafter = make_drafter(Pair(target, draft, compile), config)
    stop_ids = target.stop_ids if stop_ids is None else stop_ids
    return Engine(
        target.model,
        target.device,
        stop_ids,
        target.context_length,
        drafter,
        compile=compile,
        policy=Policy(**policy),
    )


def batch_ids(engine, prompts, config, batch_size: int) -> list[list[int]]:
    """Each prompt's whole sequence (prompt + generated) after a batched run, in input order."""
    from specgen.decoding.events import Finished

    finished = {
        r.index: r.state.ids
        for r in engine.generate(prompts, config, batch_size)
        if isinstance(r.event, Finished)
    }
    return [finished[i] for i in range(len(prompts))]


def stop_after_rows(monkeypatch, rows: int):
    """Ctrl-C in the engine's batch once `rows` rows have finished (the engine raises it as
    decoding would; the engine itself is untouched)."""
    from specgen.decoding.engine import Engine
    from specgen.decoding.events import Finished

    real = Engine.generate

    def generate(self, *args, **kwargs):
        count = 0
        for report in real(self, *args, **kwargs):
            yield report
            if isinstance(report.event, Finished):
                count += 1
                if count == rows:
                    raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "generate", generate)


def fed_tokens(model):
    """Tokens per row fed to `model` per forward (its embedding's input widths), and the hook to
    remove."""
    fed: list[int] = []
    return fed, model.get_input_embeddings().register_forward_hook(
        lambda m, args, out: fed.append(args[0].shape[-1])
    )


def assert_cache_agrees(model, cache, ids: list[int]) -> None:
    """A draft cache holds a committed prefix of `ids`, and topping it up to `ids` gives the
    logits of a fresh prefill."""
    from specgen.runtime import kvcache

    held = cache.lengths[0]
    assert held <= len(ids) - 1
    with torch.no_grad():
        cached = kvcache.forward(model, cache, torch.tensor([ids[held:]]))[0, -1]
        fresh = model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(cached, fresh, atol=1e-4, rtol=1e-4)
