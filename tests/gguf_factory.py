"""Tiny, valid GGUF files for tests: a random llama/qwen2 model and a real byte-level BPE tokenizer.

The file goes through the same loading code users hit
(`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` and `AutoTokenizer.from_pretrained(...)`),
so nothing is downloaded and nothing is mocked. Everything is deterministic: the tokenizer depends only
on `vocab`, the weights only on `seed` and the shape arguments. Two files with the same `vocab` and
different seeds therefore share a tokenizer and form a draft/target pair.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants

# Text the BPE merges are learned from; English words plus a little code, so tokens look familiar.
_CORPUS = (
    "the quick brown fox jumps over the lazy dog. the dog sleeps in the sun and the fox runs home. "
    "speculative decoding lets a small draft model propose tokens that the target model verifies. "
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n"
    "hello world, this is a tiny model. it writes text one token at a time, and then it stops. "
    "there are many words in this sentence, and they are here to teach the tokenizer some merges. "
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TOKEN_NORMAL, _TOKEN_CONTROL = 1, 3  # llama.cpp's token types


@lru_cache(maxsize=1)
def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255, the spelling a byte-level BPE vocabulary uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    table = dict(zip(printable, codes))
    return [chr(table[byte]) for byte in range(256)]


@lru_cache(maxsize=8)
def build_tokenizer(vocab: int) -> tuple[list[str], list[str]]:
    """`(tokens, merges)`: 256 byte tokens, BPE merges learned from `_CORPUS` (about 220 at most, then
    unused filler tokens), and the special tokens last."""
    n_merges = vocab - 256 - len(SPECIAL_TOKENS)
    if n_merges < 0:
        raise ValueError(f"vocab must be at least {256 + len(SPECIAL_TOKENS)}, got {vocab}")
    alphabet = _byte_alphabet()
    # GPT-2 style: words keep their leading space, which the byte alphabet spells as 'Ġ'.
    words = Counter(tuple(alphabet[b] for b in (" " + w).encode()) for w in _CORPUS.split(" ") if w)
    tokens, merges = list(alphabet), []
    while len(merges) < n_merges:
        pairs: Counter = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break  # the corpus is used up; the rest is filled with tokens no text ever produces
        # most frequent pair; ties broken by the pair itself so the result never depends on dict order
        (left, right), _ = max(pairs.items(), key=lambda item: (item[1], item[0]))
        merges.append(f"{left} {right}")
        tokens.append(left + right)
        words = Counter({_merge_word(word, left, right): count for word, count in words.items()})
    tokens += [f"<|unused_{i}|>" for i in range(vocab - len(SPECIAL_TOKENS) - len(tokens))]
    return tokens + list(SPECIAL_TOKENS), merges


def _merge_word(word: tuple[str, ...], left: str, right: str) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == left and word[i + 1] == right:
            out.append(left + right)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def write_tiny_gguf(
    path: str | Path,
    *,
    arch: str = "llama",
    seed: int = 0,
    vocab: int = 320,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    context: int = 512,
    tied: bool = False,
    quantized_tables: bool = False,
) -> Path:
    """Write a random `arch` ("llama" or "qwen2") model with F32 tensors to `path`; return the path.

    With the defaults the file is about 0.4 MB and loads in well under a second. `tied`: no
    output layer of its own (it is the input embedding's), as in Qwen2.5's small models.
    `quantized_tables`: the vocabulary tables (token_embd, output) in Q8_0, as real files have
    them in a quantized type (`hidden` must then be a multiple of 32).
    """
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"arch must be 'llama' or 'qwen2', got {arch!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, merges = build_tokenizer(vocab)
    writer = GGUFWriter(str(path), arch)
    _add_hparams(writer, arch, vocab, hidden, layers, heads, kv_heads, ffn, context)
    _add_tokenizer(writer, arch, tokens, merges)
    rng = np.random.default_rng(seed)
    for name, tensor in _tensors(rng, arch, vocab, hidden, layers, heads, kv_heads, ffn):
        if tied and name == "output.weight":
            continue
        if quantized_tables and name in ("token_embd.weight", "output.weight"):
            writer.add_tensor(
                name, quants.quantize(tensor, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0
            )
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_hparams(writer, arch, vocab, hidden, layers, heads, kv_heads, ffn, context) -> None:
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    writer.add_file_type(0)  # ALL_F32


def _add_tokenizer(writer, arch, tokens, merges) -> None:
    writer.add_tokenizer_model("gpt2")
    # selects the split regex transformers puts in front of the byte-level BPE
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "llama-bpe")
    writer.add_token_list(tokens)
    types = [_TOKEN_CONTROL if t in SPECIAL_TOKENS else _TOKEN_NORMAL for t in tokens]
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _tensors(rng, arch, vocab, hidden, layers, heads, kv_heads, ffn):
    """`(gguf_name, array)` pairs; arrays are in torch order ([out, in]), as GGUFWriter expects."""
    head_dim = hidden // heads

    def weight(*shape, scale=0.02):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm():
        return np.ones(hidden, dtype=np.float32)

    # a larger embedding scale makes the logits peaky enough for greedy decoding to vary by prompt
    yield "token_embd.weight", weight(vocab, hidden, scale=0.5)
    for i in range(layers):
        blk = f"blk.{i}"
        yield f"{blk}.attn_norm.weight", norm()
        yield f"{blk}.attn_q.weight", weight(heads * head_dim, hidden)
        yield f"{blk}.attn_k.weight", weight(kv_heads * head_dim, hidden)
        yield f"{blk}.attn_v.weight", weight(kv_heads * head_dim, hidden)
        if arch == "qwen2":  # Qwen2 has biases on q, k and v
            yield f"{blk}.attn_q.bias", weight(heads * head_dim)
            yield f"{blk}.attn_k.bias", weight(kv_heads * head_dim)
            yield f"{blk}.attn_v.bias", weight(kv_heads * head_dim)
        yield f"{blk}.attn_output.weight", weight(hidden, heads * head_dim)
        yield f"{blk}.ffn_norm.weight", norm()
        yield f"{blk}.ffn_gate.weight", weight(ffn, hidden)
        yield f"{blk}.ffn_up.weight", weight(ffn, hidden)
        yield f"{blk}.ffn_down.weight", weight(hidden, ffn)
    yield "output_norm.weight", norm()
    yield "output.weight", weight(vocab, hidden, scale=0.5)
