"""Request bodies read and checked: `chat/completions` and `completions` into an ApiRequest,
/tokenize's into the Prompt to count, /detokenize's into token ids, each field checked
(fields.py) or an ApiError with OpenAI's error object that names the first bad one.

What a request may not set is refused with a 400 rather than ignored: any field that would
change decoding that specgen does not implement (penalties, logit bias, tools, ...). Fields that
change nothing (`user`, `metadata`, ...) are accepted. The extension field `speculative` chooses
the drafting (method, draft tokens, ...; the server's defaults otherwise) and asks for each
round's accepted and rejected draft tokens in the stream (`live`). `logprobs` (and chat's
`top_logprobs`) ask for each answered token's log-probability under the target. `n` asks for
choices: a row each (scheduler.tickets), their answers one (answers.merged).

The checks are written out rather than declared (as pydantic models): each names the field and
the value the way the tests and clients rely on, in the order a request is read. No torch here.
"""

from __future__ import annotations

import json
from dataclasses import replace

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
from specgen.serve import fields
from specgen.serve.api import MAX_BODY_BYTES, MAX_CHOICES, ApiError, ApiRequest, Prompt, shown

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


def read_request(body: dict, kind: str, defaults: GenerationConfig, served: set[str]) -> ApiRequest:
    """A chat ("chat") or completions ("completion") body as an ApiRequest, every field checked;
    an ApiError names the first bad one."""
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
    echo = fields.boolean(body, "echo")
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
    n = 1 if body.get("n") is None else fields.integer(body["n"], "n", 1, MAX_CHOICES)
    if kind == "chat":
        prompts = (Prompt(fields.messages(body.get("messages")), None, "messages"),)
    else:
        prompts = tuple(Prompt(None, text, "prompt") for text in fields.prompts(body.get("prompt")))
    stream = fields.boolean(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    include_usage = fields.boolean(options, "include_usage", "stream_options.include_usage")
    config, live = _config(body, defaults, _logprobs(body, kind))
    own = (body.get("speculative") or {}).get("draft_tokens") is not None
    config = replace(config, floor=not own)
    stops = fields.stops(body.get("stop"))
    ignore_eos = fields.boolean(body, "ignore_eos")
    stop_ids = fields.stop_ids(body.get("stop_token_ids"))
    minimum = fields.integer(fields.value_or(body, "min_tokens", 0), "min_tokens", 0)
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
    include = fields.boolean(body, "include_stop_str_in_output")
    asked = body.get("prompt_logprobs")
    prompt_logprobs = None if asked is None else fields.integer(asked, "prompt_logprobs", 0, MAX_LOGPROBS)
    if prompt_logprobs is not None and stream:
        raise ApiError(
            400,
            "'prompt_logprobs' is answered only in a request that does not stream",
            "prompt_logprobs",
            "unsupported_parameter",
        )
    return ApiRequest(
        kind,
        prompts,
        config,
        model,
        n,
        stops,
        stream,
        include_usage,
        live,
        ignore_eos=ignore_eos,
        stop_ids=stop_ids,
        include_stop=include,
        echo_prompt=echo,
        max_zero=max_zero,
        prompt_logprobs=prompt_logprobs,
    )


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


def read_tokenize(body: dict) -> Prompt:
    """POST /tokenize (vLLM's shape) as the Prompt to count: `messages` (through the chat
    template, with the generation prompt unless `add_generation_prompt` is false) or `prompt`
    (raw); `add_special_tokens` as vLLM takes it; `model` optional."""
    for name in body:
        if name not in ("model", "messages", "prompt", "add_generation_prompt", "add_special_tokens"):
            raise ApiError(400, f"unknown parameter '{shown(name)}'", shown(name), "unsupported_parameter")
    if ("messages" in body) == ("prompt" in body):
        raise ApiError(400, "give 'messages' or 'prompt'", "messages", "missing_parameter")
    generation = (
        fields.boolean(body, "add_generation_prompt")
        if body.get("add_generation_prompt") is not None
        else True
    )
    special = (
        fields.boolean(body, "add_special_tokens") if body.get("add_special_tokens") is not None else None
    )
    if "messages" in body:
        return Prompt(fields.messages(body["messages"]), None, "messages", generation, special)
    if "add_generation_prompt" in body:
        raise ApiError(400, "'add_generation_prompt' applies to 'messages' only", "add_generation_prompt")
    return Prompt(None, fields.prompt(body["prompt"]), "prompt", special_tokens=special)


def _logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives per token the answer reports with each token's log-probability
    (None: no logprobs): chat's `logprobs` (true/false) and `top_logprobs`, the legacy
    completions' `logprobs` (a number of alternatives)."""
    if kind == "chat":
        top = body.get("top_logprobs")
        if not fields.boolean(body, "logprobs"):
            if top not in (None, 0):
                raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return None
        return 0 if top is None else fields.integer(top, "top_logprobs", 0, MAX_LOGPROBS)
    value = body.get("logprobs")
    return None if value is None or value is False else fields.integer(value, "logprobs", 0, MAX_LOGPROBS)


def _config(body: dict, defaults: GenerationConfig, logprobs: int | None) -> tuple[GenerationConfig, bool]:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    limit = body.get(key)
    max_new = defaults.max_new_tokens if limit is None else fields.integer(limit, key, 1)
    # null is the default, as OpenAI's API and SDKs (which send an unset option as null) mean it
    # any finite temperature, as `specgen run` (which sends its own here) and vLLM take it; OpenAI stops at 2
    temperature = fields.number(fields.value_or(body, "temperature", 1.0), "temperature", 0.0, float("inf"))
    top_p = fields.number(fields.value_or(body, "top_p", 1.0), "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise ApiError(400, "'top_p' must be in (0, 1]", "top_p")
    # -1 is off too, as vLLM takes it
    top_k = max(fields.integer(fields.value_or(body, "top_k", 0), "top_k", -1), 0)
    seed = body.get("seed")
    seed = None if seed is None else fields.integer(seed, "seed", 0, SEED_MAX)
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
    # null: the default
    speculative = {name: value for name, value in speculative.items() if value is not None}
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
    return config, fields.boolean(speculative, "live", "speculative.live")


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
            out[name] = fields.integer(speculative[name], f"speculative.{name}", 1)
    if "draft_confidence" in speculative:
        out["draft_confidence"] = fields.number(
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
        out["deterministic"] = fields.boolean(speculative, "deterministic", "speculative.deterministic")
    if "draft_tokens" in out and "draft_confidence" not in out:
        out["draft_confidence"] = (
            0.0  # a k of its own comes without the device's stop, as in `specgen run -k`
        )
    return out
