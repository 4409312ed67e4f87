"""The OpenAI wire format's requests as the server holds them once read, and its errors.

A `chat/completions`, `completions` or `responses` body, read and checked (reading.py), is an
`ApiRequest`: what the client asked, nothing more (its prompts, sampling and token budget, the
`speculative` drafting, stop strings, stream options, logprobs). The text it gives to decode is
a `Prompt` each: a chat's messages, or each prompt of a completion's batch (/tokenize's body is
one Prompt too). What goes wrong is an `ApiError`, answered with OpenAI's error object. Where a
request waits and runs, a row per choice, is the scheduler's (scheduler.Ticket); its answers are
built in answers.py.

No torch here: the HTTP layer parses, the engine thread (scheduler.py) decodes.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from specgen.config import GenerationConfig

KEEPALIVE = object()  # a stream's item while nothing else comes: an SSE comment on the wire
MAX_BODY_BYTES = 4 << 20  # a request body past this is refused (413)
MAX_STOPS = 64  # OpenAI allows 4; lm-eval sends more (vLLM sets no limit)
MAX_CHOICES = 16  # `n`: choices per request, each a row of the batch
MAX_PROMPTS = 64  # prompts in one completions request (a batch)


class ApiError(Exception):
    """An error answered in OpenAI's format."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Prompt:
    """What a request gives to tokenize, and how: a chat's messages (through the chat template)
    or a completion's text (raw, no template) or token ids."""

    messages: list[dict] | None  # chat: role/content pairs
    text: str | tuple[int, ...] | None  # completion: raw text, or token ids
    text_field: str  # the request field that holds it, as an error names it: messages, prompt or input
    # how it is tokenized: /tokenize may say otherwise (vLLM's add_generation_prompt, add_special_tokens)
    generation_prompt: bool = True  # chat: end with the assistant's turn opening
    special_tokens: bool | None = None  # the tokenizer's BOS/EOS around the text (None: as decoding takes it)

    @property
    def kind(self) -> str:
        """ "chat" (messages) or "completion" (text or token ids)."""
        return "chat" if self.messages is not None else "completion"


@dataclass(frozen=True)
class ApiRequest:
    """One request of /v1/chat/completions, /v1/completions or /v1/responses, checked: what to
    decode (each of its prompts `n` times: a row per choice), how, and how to answer."""

    endpoint: str  # the route that asked: "chat", "completion" or "responses" (a chat answered as a Response)
    prompts: tuple[Prompt, ...]  # a chat's messages (one Prompt); a completion's prompts (a batch)
    config: GenerationConfig  # the drafting, and the request's own sampling and token budget
    model: str = ""
    n: int = 1  # choices asked for per prompt: a row each
    stops: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    live: bool = False  # each chunk carries its round's draft pieces and statistics
    ignore_eos: bool = False  # vLLM's: decode past the model's end-of-sequence tokens
    stop_ids: frozenset[int] = frozenset()  # vLLM's stop_token_ids
    include_stop: bool = False  # vLLM's include_stop_str_in_output: the stop string stays in the answer
    echo_prompt: bool = False  # a completion's `echo`: the answer starts with its prompt (and its logprobs)
    max_zero: bool = False  # max_tokens 0 (with echo): one token is decoded and left out of the answer
    # vLLM's prompt_logprobs: the choice carries them, with N alternatives per prompt token (None: not asked)
    prompt_logprobs: int | None = None
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def kind(self) -> str:
        """The answer's shape: "completion", or "chat" (a Response is built from a chat answer)."""
        return "completion" if self.endpoint == "completion" else "chat"

    @property
    def rows(self) -> int:
        """The rows it takes: its choices over all its prompts."""
        return self.n * len(self.prompts)


def shown(text, limit: int = 60) -> str:
    """A client's text as an error message or the log may quote it: control characters
    escaped (no forged log lines), at most `limit` characters."""
    text = str(text)
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return shown + ("..." if len(text) > limit else "")
