"""A request's prompt as token ids, for the server: chat messages through the chat template,
completions raw, token ids checked against the vocabulary; a text far past the context (or a
conversation of more messages than the context has tokens) refused before all of it is tokenized.

Prompts are tokenized on a thread of their own, never on the event loop: a 4 MB prompt takes
seconds to tokenize (2.7 s for the default pair's tokenizer on a 2-core Zen 4), and every other
client's stream would stop for that long. One thread, so a flood of long prompts takes one core
at most and the tokenizer is never entered twice at once from here.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from specgen.decoding.prompts import render_chat
from specgen.errors import SpecgenError
from specgen.serve import api

# a prompt of more characters than this per context token is counted a piece at a time first
CHARS_PER_TOKEN = 8
PIECE_CHARS = 1 << 15
CUT_SLACK = 4


def encoder(tokenizer, context: int):
    """`await encode(prompt)`: a prompt's ids, tokenized on the one tokenizing thread, off the event loop."""
    tokenizing = ThreadPoolExecutor(1, thread_name_prefix="specgen-tokenize")

    async def encode_off_loop(prompt: api.Prompt) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(
            tokenizing, encode, tokenizer, prompt, context
        )

    return encode_off_loop


def encode(tokenizer, prompt: api.Prompt, context: int) -> list[int]:
    """The prompt's token ids: chat messages through the chat template, completions raw (with the
    tokenizer's special tokens only when asked, or when the text alone gives none). A text far
    longer than the context is refused once a count of its pieces passes it (`beyond`), not
    after tokenizing all of it."""
    if isinstance(prompt.text, tuple):  # token ids: checked against the vocabulary, used as sent
        vocab = len(tokenizer)
        bad = next((t for t in prompt.text if t >= vocab), None)
        if bad is not None:
            raise api.ApiError(
                400, f"token id {bad} is not in the model's vocabulary ({vocab} tokens)", "prompt"
            )
        return list(prompt.text)
    if (
        prompt.kind == "chat" and len(prompt.messages) > context
    ):  # every message takes a token at least (its role)
        raise api.ApiError(
            400,
            f"the conversation has {len(prompt.messages)} messages, each a token at least, but "
            f"the context holds {context} tokens; shorten it",
            prompt.text_field,
            "context_length_exceeded",
        )
    texts = [prompt.text] if prompt.kind == "completion" else [m["content"] for m in prompt.messages]
    counted = beyond(tokenizer, texts, context)
    if counted:
        raise api.ApiError(
            400,
            f"the prompt has more than {counted} tokens but the context holds {context}; shorten it",
            prompt.text_field,
            "context_length_exceeded",
        )
    try:
        if prompt.kind == "completion":
            if prompt.special_tokens is not None:
                return tokenizer.encode(prompt.text, add_special_tokens=prompt.special_tokens)
            return tokenizer.encode(prompt.text, add_special_tokens=False) or tokenizer.encode(prompt.text)
        if not getattr(tokenizer, "chat_template", None):
            raise api.ApiError(400, "this model has no chat template; use /v1/completions", prompt.text_field)
        return render_chat(tokenizer, prompt.messages, prompt.generation_prompt, bool(prompt.special_tokens))
    except SpecgenError as exc:  # a template that refuses the conversation (e.g. its roles)
        raise api.ApiError(400, str(exc), prompt.text_field) from None
    except (ValueError, TypeError) as exc:  # a completion's text the tokenizer will not take
        raise api.ApiError(400, f"the tokenizer refused the prompt: {exc}", "prompt") from None


def beyond(tokenizer, texts: list[str], context: int) -> int:
    """0 when `texts` may fit `context` tokens; else a count of their tokens past it, reached by
    tokenizing pieces of PIECE_CHARS (cut before a space) and stopping there. Texts of fewer than
    CHARS_PER_TOKEN characters per context token are not counted (tokenizing them whole costs no
    more than a prompt that fits). Each cut may split one word's tokens differently from the whole
    text's, so the count must pass the context by CUT_SLACK tokens per cut."""
    if sum(map(len, texts)) <= CHARS_PER_TOKEN * context:
        return 0
    count = cuts = 0
    for text in texts:
        start = 0
        while start < len(text):
            end = len(text) if len(text) - start <= PIECE_CHARS else start + PIECE_CHARS
            if end < len(text):
                space = text.rfind(" ", start + PIECE_CHARS // 2, end)
                end, cuts = (space if space > start else end), cuts + 1
            count += len(tokenizer.encode(text[start:end], add_special_tokens=False))
            if count > context + CUT_SLACK * cuts:
                return count - CUT_SLACK * cuts
            start = end
    return 0
