"""The OpenAI wire format of requests: read and checked (answers are built in answers.py).

`chat/completions` and `completions` bodies become a `Job` (prompt, decoding settings, stop
strings, stream options) or an `ApiError` with OpenAI's error object. What a request may not
set is refused with a 400 rather than ignored: any field that would change decoding that
specgen does not implement (penalties, logit bias, tools, ...). `n` choices become n Jobs
(`choices`), a row each, and their answers one (`answers.merged`). Fields
that change nothing (`user`, `metadata`, ...) are accepted. The extension field `speculative`
chooses the drafting (method, draft tokens, ...; the server's defaults otherwise) and asks for
each round's accepted and rejected draft tokens in the stream (`live`). `logprobs` (and chat's
`top_logprobs`) ask for each answered token's log-probability under the target.

No torch here: the HTTP layer parses, the engine thread (scheduler.py) decodes.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Callable

from specgen.config import (
    MAX_LOGPROBS,
    SEED_MAX,
    GenerationConfig,
    Method,
    SamplingConfig,
    Schedule,
    parse_branching,
)
from specgen.errors import ConfigError

KEEPALIVE = object()  # a stream's item while nothing else comes: an SSE comment on the wire
MAX_BODY_BYTES = 4 << 20  # a request body past this is refused (413)
MAX_STOPS = 64  # OpenAI allows 4; lm-eval sends more (vLLM sets no limit)
MAX_CHOICES = 16  # `n`: choices per request, each a row of the batch
MAX_PROMPTS = 64  # prompts in one completions request (a batch)
# fields that change nothing about decoding
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options"}
# fields specgen does not implement, accepted only at the value that means "off"
NEUTRAL = {
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    # vLLM's sampling extensions that load generators (guidellm) and eval tools send
    "repetition_penalty": (1, 1.0, None),
    "skip_special_tokens": (True, None),
    "spaces_between_special_tokens": (True, None),
    "min_p": (0, 0.0, None),
    "best_of": (1, None),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
}
# the command-line options that GenerationConfig's checks name, as a request's fields
OPTION_FIELDS = {
    "--draft-tokens": "speculative.draft_tokens",
    "--draft-confidence": "speculative.draft_confidence",
    "--verify-window": "speculative.verify_window",
    "--branching": "speculative.branching",
    "--beam-width": "speculative.beam_width",
    "--depth": "speculative.depth",
    "--max-new-tokens": "max_tokens",
    "--temperature": "temperature",
    "--top-p": "top_p",
    "--top-k": "top_k",
    "--seed": "seed",
    "--logprobs": "logprobs",
}
# vLLM's extensions with a meaning here: ignore_eos (decode past EOS), stop_token_ids (more ids
# that end the answer), include_stop_str_in_output, min_tokens (only where nothing could end the
# answer sooner: it would otherwise change what is sampled)
EXTENSIONS = {"ignore_eos", "stop_token_ids", "include_stop_str_in_output", "min_tokens", "prompt_logprobs"}
SPECULATIVE_KEYS = {
    "method",
    "draft_tokens",
    "draft_confidence",
    "draft_schedule",
    "branching",
    "beam_width",
    "depth",
    "deterministic",
    "verify_window",
    "live",
}


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


@dataclass(eq=False)
class Job:
    """One request (a choice of it: `choices`), checked: what to decode and how to answer; inside
    the server also its prompt's ids, where its answers go and its place in the queue. Two Jobs
    are the same only if they are one object (the queue finds a Job by identity)."""

    kind: str  # "chat" or "completion"
    messages: list[dict] | None  # chat: role/content pairs, rendered with the chat template
    prompt: str | tuple[int, ...] | None  # completion: raw text (no template), or token ids
    config: GenerationConfig  # the drafting, and the request's own sampling and token budget
    stops: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    live: bool = False  # each chunk carries its round's draft pieces and statistics
    model: str = ""
    n: int = 1  # choices asked for: a row each (`choices` makes a Job per choice)
    choice: int = 0  # which choice this Job decodes
    endpoint: str = ""  # the route that asked, where it is not `kind`'s own ("responses": a chat Job)
    ignore_eos: bool = False  # vLLM's: decode past the model's end-of-sequence tokens
    stop_ids: frozenset[int] = frozenset()  # vLLM's stop_token_ids
    include_stop: bool = False  # vLLM's include_stop_str_in_output: the stop string stays in the answer
    echo_prompt: bool = False  # a completion's `echo`: the answer starts with its prompt (and its logprobs)
    max_zero: bool = False  # max_tokens 0 (with echo): one token is decoded and left out of the answer
    prompt_top: int = 0  # vLLM's prompt_logprobs: N alternatives per prompt token (with prompt_logprobs)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field was given: the choice carries them
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))
    echo: dict = field(default_factory=dict)  # request fields a Response repeats as sent (responses.py)
    more: tuple = ()  # a completion's further prompts (a batch): choices of their own, after this one's
    # how the prompt is tokenized: /tokenize may say otherwise (vLLM's add_generation_prompt,
    # add_special_tokens)
    generation_prompt: bool = True  # chat: end with the assistant's turn opening
    special_tokens: bool | None = None  # the tokenizer's BOS/EOS around the text (None: as decoding takes it)
    ids: list[int] = field(default_factory=list)  # queued (scheduler.py): the prompt's ids
    post: Callable[[object], None] = lambda item: (
        None
    )  # hands a chunk, answer, ApiError or None (the end) to HTTP
    index: int = 0  # its serial number in the queue (its row's index in the engine's events)
    cancelled: bool = False  # the client went away, or a stop string ended the answer
    submitted: float = 0.0  # time.monotonic() when it was queued

    @property
    def text_field(self) -> str:
        """The request field that holds the text to decode, as this endpoint names it."""
        return (
            "input" if self.endpoint == "responses" else "prompt" if self.kind == "completion" else "messages"
        )


def parse_body(raw: bytes) -> dict:
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(
            413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large"
        )
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        if "digits" in str(exc):  # Python's bound on an integer's digits (CVE-2020-10735), not JSON's
            raise ApiError(
                400, "a number in the request body has too many digits", code="invalid_json"
            ) from None
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # "[[[[...]]]]": Python's parser recurses once per level
        raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def read_job(body: dict, kind: str, defaults: GenerationConfig, served: set[str]) -> Job:
    """The request as a Job, every field checked; an ApiError names the first bad one."""
    text_key = "messages" if kind == "chat" else "prompt"
    known = (
        {
            "model",
            text_key,
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "stop",
            "stream",
            "n",
            "speculative",
            "logprobs",
        }
        | IGNORED
        | EXTENSIONS
    )
    if kind != "chat":
        known.add("echo")
    elif body.get("echo") not in (None, False):
        raise ApiError(400, "'echo' is a completions field", "echo", "unsupported_parameter")
    echo = _boolean(body, "echo")
    max_zero = echo and body.get("max_tokens") == 0 and body.get("max_completion_tokens") is None
    if max_zero:
        body = dict(body, max_tokens=1)
    if kind == "chat":
        known.add("top_logprobs")
    for name, value in body.items():
        if name in known:
            continue
        if name in NEUTRAL:
            if value not in NEUTRAL[name]:
                raise ApiError(
                    400,
                    f"'{name}' is not supported by specgen (only its neutral value)",
                    name,
                    "unsupported_parameter",
                )
            continue
        raise ApiError(400, f"unknown parameter '{shown(name)}'", shown(name), "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required", "model", "missing_parameter")
    if model not in served:
        raise ApiError(
            404,
            f"the model '{shown(model)}' does not exist on this server; GET /v1/models lists it",
            "model",
            "model_not_found",
        )
    n = 1 if body.get("n") is None else _integer(body["n"], "n", 1, MAX_CHOICES)
    messages = prompt = None
    if kind == "chat":
        messages = _messages(body.get("messages"))
    else:
        prompt, *more = _prompts(body.get("prompt"))
    stream = _boolean(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    include_usage = _boolean(options, "include_usage", "stream_options.include_usage")
    config, live = _config(body, defaults, _logprobs(body, kind))
    own = (body.get("speculative") or {}).get("draft_tokens") is not None
    config = replace(config, floor=not own)
    stops = _stops(body.get("stop"))
    ignore_eos = _boolean(body, "ignore_eos")
    stop_ids = _stop_ids(body.get("stop_token_ids"))
    minimum = _integer(value_or(body, "min_tokens", 0), "min_tokens", 0)
    if minimum > 1 and not (ignore_eos and not stops and not stop_ids):
        raise ApiError(
            400,
            "'min_tokens' is supported only with 'ignore_eos': true and no stop strings or "
            "stop_token_ids (it would change what is sampled)",
            "min_tokens",
            "unsupported_parameter",
        )
    if minimum > config.max_new_tokens:
        raise ApiError(
            400, f"'min_tokens' ({minimum}) is more than 'max_tokens' ({config.max_new_tokens})", "min_tokens"
        )
    include = _boolean(body, "include_stop_str_in_output")
    asked = body.get("prompt_logprobs")
    prompt_top = 0 if asked is None else _integer(asked, "prompt_logprobs", 0, MAX_LOGPROBS)
    if asked is not None and stream:
        raise ApiError(
            400,
            "'prompt_logprobs' is answered only in a request that does not stream",
            "prompt_logprobs",
            "unsupported_parameter",
        )
    return Job(
        kind,
        messages,
        prompt,
        config,
        stops,
        stream,
        include_usage,
        live,
        model,
        n=n,
        ignore_eos=ignore_eos,
        stop_ids=stop_ids,
        include_stop=include,
        more=tuple(more) if kind != "chat" else (),
        echo_prompt=echo,
        max_zero=max_zero,
        prompt_top=prompt_top,
        prompt_logprobs=asked is not None,
    )


def _stop_ids(value) -> frozenset[int]:
    """vLLM's stop_token_ids: a list of token ids (null: none)."""
    if value is None:
        return frozenset()
    if (
        not isinstance(value, list)
        or len(value) > 64
        or not all(type(v) is int and 0 <= v < 2**31 for v in value)
    ):
        raise ApiError(400, "'stop_token_ids' must be a list of at most 64 token ids", "stop_token_ids")
    return frozenset(value)


def choices(job: Job) -> list[Job]:
    """A Job per choice of a request: each prompt (a completion may send a batch) `n` times,
    each its own row, indexed as OpenAI does (prompt p's choice c is p * n + c); with a `seed`,
    choice c samples with seed + c (as a prompt set's prompt i does; past SEED_MAX it wraps to
    0), so the choices differ and a rerun gives them again. Greedy choices are all the same answer."""
    seed = job.config.sampling.seed
    prompts = (job.prompt, *job.more)
    if job.n == 1 and len(prompts) == 1:
        return [job]
    return [
        replace(
            job,
            prompt=prompt,
            more=(),
            choice=p * job.n + i,
            config=replace(
                job.config,
                sampling=replace(
                    job.config.sampling, seed=None if seed is None else (seed + i) % (SEED_MAX + 1)
                ),
            ),
        )
        for p, prompt in enumerate(prompts)
        for i in range(job.n)
    ]


def rows(job: Job) -> int:
    """The rows a request takes: its choices over all its prompts."""
    return job.n * (1 + len(job.more))


def read_detokenize(body: dict, vocab: int) -> list[int]:
    """POST /detokenize (vLLM's shape): `tokens`, ids of the model's vocabulary; `model` optional."""
    for name in body:
        if name not in ("model", "tokens"):
            raise ApiError(400, f"unknown parameter '{shown(name)}'", shown(name), "unsupported_parameter")
    tokens = body.get("tokens")
    if (
        not isinstance(tokens, list)
        or len(tokens) > MAX_BODY_BYTES // 2
        or not all(type(t) is int and 0 <= t < vocab for t in tokens)
    ):
        raise ApiError(400, f"'tokens' must be a list of token ids below {vocab}", "tokens")
    return tokens


def read_tokenize(body: dict, defaults: GenerationConfig) -> Job:
    """POST /tokenize (vLLM's shape) as the Job whose prompt to count: `messages` (through the
    chat template, with the generation prompt unless `add_generation_prompt` is false) or
    `prompt` (raw); `add_special_tokens` as vLLM takes it; `model` optional."""
    for name in body:
        if name not in ("model", "messages", "prompt", "add_generation_prompt", "add_special_tokens"):
            raise ApiError(400, f"unknown parameter '{shown(name)}'", shown(name), "unsupported_parameter")
    if ("messages" in body) == ("prompt" in body):
        raise ApiError(400, "give 'messages' or 'prompt'", "messages", "missing_parameter")
    generation = (
        _boolean(body, "add_generation_prompt") if body.get("add_generation_prompt") is not None else True
    )
    special = _boolean(body, "add_special_tokens") if body.get("add_special_tokens") is not None else None
    if "messages" in body:
        return Job(
            "chat",
            _messages(body["messages"]),
            None,
            defaults,
            generation_prompt=generation,
            special_tokens=special,
        )
    if "add_generation_prompt" in body:
        raise ApiError(400, "'add_generation_prompt' applies to 'messages' only", "add_generation_prompt")
    return Job("completion", None, _prompt(body["prompt"]), defaults, special_tokens=special)


def _logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives per token the answer reports with each token's log-probability
    (None: no logprobs): chat's `logprobs` (true/false) and `top_logprobs`, the legacy
    completions' `logprobs` (a number of alternatives)."""
    if kind == "chat":
        top = body.get("top_logprobs")
        if not _boolean(body, "logprobs"):
            if top not in (None, 0):
                raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return None
        return 0 if top is None else _integer(top, "top_logprobs", 0, MAX_LOGPROBS)
    value = body.get("logprobs")
    return None if value is None or value is False else _integer(value, "logprobs", 0, MAX_LOGPROBS)


def _config(body: dict, defaults: GenerationConfig, logprobs: int | None) -> tuple[GenerationConfig, bool]:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    limit = body.get(key)
    max_new = defaults.max_new_tokens if limit is None else _integer(limit, key, 1)
    # null is the default, as OpenAI's API and SDKs (which send an unset option as null) mean it
    # any finite temperature, as `specgen run` (which sends its own here) and vLLM take it; OpenAI stops at 2
    temperature = _number(value_or(body, "temperature", 1.0), "temperature", 0.0, float("inf"))
    top_p = _number(value_or(body, "top_p", 1.0), "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise ApiError(400, "'top_p' must be in (0, 1]", "top_p")
    top_k = max(_integer(value_or(body, "top_k", 0), "top_k", -1), 0)  # -1 is off too, as vLLM takes it
    seed = body.get("seed")
    seed = None if seed is None else _integer(seed, "seed", 0, SEED_MAX)
    speculative = {} if body.get("speculative") is None else body["speculative"]
    if not isinstance(speculative, dict):
        raise ApiError(400, "'speculative' must be an object", "speculative")
    for name in speculative:
        if name not in SPECULATIVE_KEYS:
            raise ApiError(
                400,
                f"unknown field 'speculative.{shown(name)}'; known: {', '.join(sorted(SPECULATIVE_KEYS))}",
                f"speculative.{shown(name)}",
                "unsupported_parameter",
            )
    speculative = {
        name: value for name, value in speculative.items() if value is not None
    }  # null: the default
    try:
        config = replace(
            defaults,
            max_new_tokens=max_new,
            sampling=SamplingConfig(temperature, top_k, top_p, seed, logprobs),
            **_drafting(speculative),
        )
    except ConfigError as exc:  # the checks name the command-line options: say the request's fields
        message, param = str(exc), "speculative"
        for option, field_name in OPTION_FIELDS.items():
            if option in message:
                message, param = message.replace(option, f"'{field_name}'"), field_name
        raise ApiError(400, message.replace("--", ""), param) from None
    return config, _boolean(speculative, "live", "speculative.live")


def value_or(body: dict, name: str, default):
    """body[name], or `default` where it is absent or null."""
    value = body.get(name)
    return default if value is None else value


def _drafting(speculative: dict) -> dict:
    out = {}
    if "method" in speculative:
        if not isinstance(speculative["method"], str):
            raise ApiError(
                400,
                f"'speculative.method' must be a string: {', '.join(m.value for m in Method)}",
                "speculative.method",
            )
        try:
            out["method"] = Method.parse(shown(speculative["method"]))
        except ConfigError as exc:
            raise ApiError(400, str(exc), "speculative.method") from None
    for name in ("draft_tokens", "beam_width", "depth", "verify_window"):
        if name in speculative:
            out[name] = _integer(speculative[name], f"speculative.{name}", 1)
    if "draft_confidence" in speculative:
        out["draft_confidence"] = _number(
            speculative["draft_confidence"], "speculative.draft_confidence", 0.0, 1.0
        )
    if "draft_schedule" in speculative:
        try:
            out["schedule"] = Schedule(str(speculative["draft_schedule"]))
        except ValueError:
            raise ApiError(
                400,
                "speculative.draft_schedule must be fixed, additive or expected-gain",
                "speculative.draft_schedule",
            ) from None
    if "branching" in speculative:
        value = speculative["branching"]
        if not (isinstance(value, str) or isinstance(value, list) and all(type(f) is int for f in value)):
            raise ApiError(
                400,
                "'speculative.branching' must be a list of integers like [2, 2, 1] or a string "
                'like "2,2,1"',
                "speculative.branching",
            )
        out["branching"] = parse_branching(
            ",".join(map(str, value)) if isinstance(value, list) else str(value)
        )
    if "deterministic" in speculative:
        out["deterministic"] = _boolean(speculative, "deterministic", "speculative.deterministic")
    if "draft_tokens" in out and "draft_confidence" not in out:
        out["draft_confidence"] = (
            0.0  # a k of its own comes without the device's stop, as in `specgen run -k`
        )
    return out


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'messages' must be a non-empty list", "messages", "missing_parameter")
    out = []
    for i, message in enumerate(value):
        role = message.get("role") if isinstance(message, dict) else None
        if role in ("tool", "function"):
            raise ApiError(
                400,
                f"messages[{i}]: role '{role}' is not supported (this server calls no tools)",
                f"messages[{i}].role",
                "unsupported_parameter",
            )
        if role not in ("system", "developer", "user", "assistant"):
            raise ApiError(
                400,
                f"messages[{i}] needs a role: system, developer, user or assistant",
                f"messages[{i}].role",
            )
        name = next((n for n in ("tool_calls", "function_call") if message.get(n) not in (None, [])), None)
        if name is not None:
            raise ApiError(
                400,
                f"messages[{i}].{name}: this server calls no tools",
                f"messages[{i}].{name}",
                "unsupported_parameter",
            )
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise ApiError(
                    400, f"messages[{i}]: only text content parts are supported", f"messages[{i}].content"
                )
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be text", f"messages[{i}].content")
        _unicode(content, f"messages[{i}].content")
        role = "system" if message["role"] == "developer" else message["role"]
        out.append({"role": role, "content": content})
    return out


def _prompt(value) -> str:
    """One text prompt (/tokenize's)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if not isinstance(value, str) or not value:
        raise ApiError(400, "'prompt' must be a non-empty string", "prompt", "missing_parameter")
    return _unicode(value, "prompt")


def _prompts(value) -> list[str | tuple[int, ...]]:
    """A completion's prompts as OpenAI's API takes them: a string, a list of strings, a list of
    token ids, or a list of lists of token ids."""
    message = (
        "'prompt' must be a non-empty string, a list of strings, a list of token ids or a list of lists "
        f"of token ids (at most {MAX_PROMPTS} prompts)"
    )
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ApiError(400, message, "prompt", "missing_parameter")
    if all(type(v) is int for v in value):
        value = [value]
    if len(value) > MAX_PROMPTS:
        raise ApiError(400, message, "prompt")
    out: list[str | tuple[int, ...]] = []
    for item in value:
        if isinstance(item, str) and item:
            out.append(_unicode(item, "prompt"))
        elif isinstance(item, list) and item and all(type(t) is int and 0 <= t < 2**31 for t in item):
            out.append(tuple(item))
        else:
            raise ApiError(400, message, "prompt")
    return out


def _unicode(text: str, name: str) -> str:
    """`text`, if it is Unicode text: JSON's \\ud800 escapes decode to lone surrogates, which no
    tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(
            400,
            f"'{name}' is not valid Unicode text: it holds a lone surrogate "
            f"(\\u{ord(text[exc.start]):04x}) at character {exc.start}",
            name,
        ) from None
    return text


def _stops(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or not all(isinstance(s, str) and s for s in stops)
        or len(stops) > MAX_STOPS
    ):
        raise ApiError(
            400, f"'stop' must be a string or a list of up to {MAX_STOPS} non-empty strings", "stop"
        )
    return [_unicode(stop, "stop") for stop in stops]


def _boolean(body: dict, name: str, label: str | None = None) -> bool:
    """body[name] as a JSON boolean (absent or null: false). A string such as "false" is refused
    rather than read as true."""
    value = body.get(name, False)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"'{label or name}' must be true or false", label or name)
    return bool(value)


def _integer(value, name: str, low: int, high: int | None = None) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ApiError(400, f"'{name}' must be an integer {bound}, got {json.dumps(value)[:40]}", name)
    return value


def shown(text, limit: int = 60) -> str:
    """A client's text as an error message or the log may quote it: control characters
    escaped (no forged log lines), at most `limit` characters."""
    text = str(text)
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return shown + ("..." if len(text) > limit else "")


def _number(value, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ApiError(
            400, f"'{name}' must be a number in {low:g}..{high:g}, got {json.dumps(value)[:40]}", name
        )
    return float(value)
