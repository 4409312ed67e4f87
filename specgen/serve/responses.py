"""OpenAI's Responses API (`POST /v1/responses`), served through the chat path.

A Responses request means a chat completion: `instructions` become the system message, `input`
(a string, or message items with text parts) the conversation, `max_output_tokens` the token
budget. `read` checks it and hands the chat body to reading.read_request, so the same checks,
engine rows and `speculative` extension apply: an `Asked` is that chat request and the fields
a Response repeats. `whole` and `events` turn the chat answer and its chunks into a Response
object and the Responses stream events (`response.created` ... `response.completed`, or
`response.incomplete` when the token budget cut the answer, or `response.failed`). An error names
the request's own fields (`input[1].content`, `instructions`), and the answer repeats its
`instructions`, `metadata`, `tool_choice`, `parallel_tool_calls` and `max_output_tokens` as sent.
Nothing is stored: `previous_response_id` is refused (send the conversation in `input`), and
`store` changes nothing. Tools, images, files and reasoning items are refused, not ignored.
No torch here.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass, replace
from typing import AsyncIterator

from specgen.config import GenerationConfig
from specgen.serve import api, fields, reading

# fields passed on to the chat completion, under the name it takes
PASSED = {
    "model": "model",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "max_output_tokens": "max_tokens",
    "stream": "stream",
    "speculative": "speculative",
}
# fields that change nothing here (metadata, tool_choice and parallel_tool_calls are repeated in the answer)
IGNORED = {
    "store",
    "metadata",
    "user",
    "service_tier",
    "parallel_tool_calls",
    "safety_identifier",
    "prompt_cache_key",
    "stream_options",
}
# fields specgen does not implement, accepted only at the value that means "off"
NEUTRAL = {
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "include": (None, []),
    "background": (None, False),
    "truncation": (None, "disabled"),
    "reasoning": (None, {}),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "prompt": (None,),
    "conversation": (None,),
    "text": (None, {}, {"format": {"type": "text"}}),
}
TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(frozen=True)
class Asked:
    """A Responses request: the chat request it means (endpoint "responses"), and the fields its
    Response repeats as sent."""

    chat: api.ApiRequest
    instructions: str | None
    metadata: dict
    tool_choice: object
    parallel_tool_calls: bool
    max_output_tokens: int | None


def read(body: dict, defaults: GenerationConfig, served: set[str]) -> Asked:
    """The request as the chat request it means; an ApiError names the first bad field."""
    chat: dict = {}
    for name, value in body.items():
        if name in PASSED:
            chat[PASSED[name]] = value
        elif name == "previous_response_id":
            if value is not None:
                raise api.ApiError(
                    400,
                    "this server keeps no responses: send the whole conversation in 'input'",
                    name,
                    "unsupported_parameter",
                )
        elif name in NEUTRAL:
            if value not in NEUTRAL[name] and not _neutral_object(name, value):
                raise api.ApiError(
                    400,
                    f"'{name}' is not supported by specgen (only its neutral value)",
                    name,
                    "unsupported_parameter",
                )
        elif name not in IGNORED and name not in ("input", "instructions"):
            raise api.ApiError(
                400, f"unknown parameter '{api.shown(name)}'", api.shown(name), "unsupported_parameter"
            )
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise api.ApiError(400, "'instructions' must be a string", "instructions")
    given = body.get("input")
    first = 1 if instructions else 0  # chat messages[first:] are the input's
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + _input(given)
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}  # the closing event carries the usage
    try:
        request = reading.read_request(chat, "chat", defaults, served)
    except api.ApiError as exc:  # say the Responses API's names
        rename = functools.partial(_renamed, first=first, whole=isinstance(given, str))
        raise api.ApiError(
            exc.status,
            rename(exc.message.replace("'max_tokens'", "'max_output_tokens'")),
            rename({"max_tokens": "max_output_tokens"}.get(exc.param, exc.param)),
            exc.code,
            exc.kind,
        ) from None
    metadata = _metadata(body.get("metadata"))
    parallel_tool_calls = fields.value_or(body, "parallel_tool_calls", True)
    if not isinstance(parallel_tool_calls, bool):
        raise api.ApiError(400, "'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    prompt = replace(request.prompts[0], text_field="input")
    return Asked(
        replace(request, endpoint="responses", prompts=(prompt,), id=f"resp_{uuid.uuid4().hex}"),
        instructions,
        metadata,
        fields.value_or(body, "tool_choice", "auto"),
        parallel_tool_calls,
        body.get("max_output_tokens"),
    )


def _neutral_object(name: str, value) -> bool:
    """`reasoning` with no setting given (`{"effort": null}`) and `text` asking for plain text at
    the default verbosity mean what specgen does anyway."""
    if not isinstance(value, dict):
        return False
    if name == "reasoning":
        return all(v is None for v in value.values())
    if name == "text":
        return (
            set(value) <= {"format", "verbosity"}
            and value.get("format") in (None, {"type": "text"})
            and value.get("verbosity") in (None, "medium")
        )
    return False


def _renamed(text: str | None, first: int, whole: bool) -> str | None:
    """A chat error's `messages[i]` as the request named it: the instructions, or input[i - first]
    (the input itself where it was one string)."""

    def name(hit: re.Match) -> str:
        index = int(hit.group(1))
        if index < first:
            return "instructions"
        return "input" if whole else f"input[{index - first}]{hit.group(2)}"

    if text is None:
        return None
    return re.sub(r"\bmessages\b", "input", re.sub(r"\bmessages\[(\d+)\]((?:\.\w+)*)", name, text))


def _metadata(value) -> dict:
    """The request's `metadata` as OpenAI takes it: up to 16 string pairs (keys up to 64
    characters, values up to 512)."""
    if value is None:
        return {}
    if not (
        isinstance(value, dict)
        and len(value) <= 16
        and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in value.items()
        )
    ):
        raise api.ApiError(
            400,
            "'metadata' must be an object of up to 16 strings (keys up to 64 characters, values up to 512)",
            "metadata",
        )
    return value


def _input(value) -> list[dict]:
    """`input` as chat messages: a string is one user message; a list holds message items whose
    content is a string or text parts."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise api.ApiError(
            400, "'input' must be a non-empty string or list of messages", "input", "missing_parameter"
        )
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise api.ApiError(
                400,
                f"input[{i}]: only message items are supported, not '{api.shown(kind)}'",
                f"input[{i}]",
                "unsupported_parameter",
            )
        content = item.get("content")
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") in TEXT_PARTS and isinstance(p.get("text"), str)
                for p in content
            ):
                raise api.ApiError(
                    400,
                    f"input[{i}]: only text content parts are supported",
                    f"input[{i}].content",
                    "unsupported_parameter",
                )
            content = "".join(p["text"] for p in content)
        out.append({"role": item.get("role"), "content": content})
    return out


# -- answers -----------------------------------------------------------------------------------
def whole(asked: Asked, answer: dict) -> dict:
    """The Response object of a finished chat completion."""
    choice = answer["choices"][0]
    return _response(
        asked,
        choice["message"]["content"],
        choice["finish_reason"],
        answer["usage"],
        answer.get("speculative"),
    )


async def events(asked: Asked, chunks: AsyncIterator) -> AsyncIterator[str]:
    """The Responses stream events (`event:` and `data:` lines) of a streamed chat completion's
    chunks: created, in_progress, the message item and its text part added, a delta per chunk
    with text, then the text, part and item done and `response.completed` (`response.incomplete`
    when the token budget cut it), or an `error` and `response.failed` with the text so far."""
    number = 0
    message = f"msg_{asked.chat.id.removeprefix('resp_')}"

    def event(kind: str, **data) -> str:
        nonlocal number
        number += 1
        body = json.dumps({"type": kind, "sequence_number": number - 1, **data}, ensure_ascii=False)
        return f"event: {kind}\ndata: {body}\n\n"

    started = _response(asked, "", None, None, None, status="in_progress")
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    yield event("response.output_item.added", output_index=0, item=_message(message, None, "in_progress"))
    yield event(
        "response.content_part.added", item_id=message, output_index=0, content_index=0, part=_text_part("")
    )
    text, reason, speculative = [], None, None
    async for item in chunks:
        if item is api.KEEPALIVE:  # while the request waits or prefills
            yield ": keep-alive\n\n"
            continue
        if isinstance(item, api.ApiError):  # the `error` event, then the response failed with what it had
            body = item.body()["error"]
            yield event("error", code=body["code"], message=body["message"], param=body["param"])
            failed = _response(asked, "".join(text), None, None, None, status="failed")
            failed["error"] = {"code": body["code"], "message": body["message"]}
            failed["output"] = [_message(message, "".join(text), "incomplete")]
            yield event("response.failed", response=failed)
            return
        for choice in item["choices"]:
            piece = choice["delta"].get("content")
            extra = (
                {"speculative": item["speculative"]}
                if "speculative" in item and not choice["finish_reason"]
                else {}
            )
            if piece:
                text.append(piece)
                yield event(
                    "response.output_text.delta",
                    item_id=message,
                    output_index=0,
                    content_index=0,
                    delta=piece,
                    logprobs=[],
                    **extra,
                )
            reason = choice["finish_reason"] or reason
        if item.get("speculative") and (reason or not item["choices"]):
            speculative = item["speculative"]
        if item.get("usage"):
            whole_text = "".join(text)
            yield event(
                "response.output_text.done",
                item_id=message,
                output_index=0,
                content_index=0,
                text=whole_text,
                logprobs=[],
            )
            yield event(
                "response.content_part.done",
                item_id=message,
                output_index=0,
                content_index=0,
                part=_text_part(whole_text),
            )
            done = _response(asked, whole_text, reason, item["usage"], speculative)
            yield event("response.output_item.done", output_index=0, item=done["output"][0])
            yield event(f"response.{done['status']}", response=done)  # completed, or incomplete when cut


def _response(
    asked: Asked,
    text: str,
    reason: str | None,
    usage: dict | None,
    speculative: dict | None,
    status: str | None = None,
) -> dict:
    request, sampling = asked.chat, asked.chat.config.sampling
    cut = reason == "length"
    out = {
        "id": request.id,
        "object": "response",
        "created_at": request.created,
        "model": request.model,
        "status": status or ("incomplete" if cut else "completed"),
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": asked.instructions,
        "max_output_tokens": asked.max_output_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "parallel_tool_calls": asked.parallel_tool_calls,
        "tool_choice": asked.tool_choice,
        "tools": [],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": asked.metadata,
        "output": []
        if status
        else [
            _message(f"msg_{request.id.removeprefix('resp_')}", text, "incomplete" if cut else "completed")
        ],
        "usage": None
        if usage is None
        else {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
    }
    if speculative is not None:
        out["speculative"] = speculative
    return out


def _message(item_id: str, text: str | None, status: str) -> dict:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [] if text is None else [_text_part(text)],
    }


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
