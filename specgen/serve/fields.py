"""One request field's value checked, as the wire format takes it: booleans, integers and
numbers in their ranges, Unicode text, stop strings and stop token ids, chat messages and a
completion's prompts. Each refusal is an ApiError that names the field (as `label`, where the
field sits inside another) and quotes what came, escaped and cut short. Whole requests are read
in reading.py and responses.py. No torch here.
"""

from __future__ import annotations

import json

from specgen.serve.api import MAX_PROMPTS, MAX_STOPS, ApiError


def value_or(body: dict, name: str, default):
    """body[name], or `default` where it is absent or null."""
    value = body.get(name)
    return default if value is None else value


def boolean(body: dict, name: str, label: str | None = None) -> bool:
    """body[name] as a JSON boolean (absent or null: false). A string such as "false" is refused
    rather than read as true."""
    value = body.get(name, False)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"'{label or name}' must be true or false", label or name)
    return bool(value)


def integer(value, name: str, low: int, high: int | None = None) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ApiError(400, f"'{name}' must be an integer {bound}, got {json.dumps(value)[:40]}", name)
    return value


def number(value, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ApiError(
            400, f"'{name}' must be a number in {low:g}..{high:g}, got {json.dumps(value)[:40]}", name
        )
    return float(value)


def unicode(text: str, name: str) -> str:
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


def stops(value) -> tuple[str, ...]:
    """`stop`: a string or a list of them (null: none)."""
    if value is None:
        return ()
    given = [value] if isinstance(value, str) else value
    if (
        not isinstance(given, list)
        or not all(isinstance(s, str) and s for s in given)
        or len(given) > MAX_STOPS
    ):
        raise ApiError(
            400, f"'stop' must be a string or a list of up to {MAX_STOPS} non-empty strings", "stop"
        )
    return tuple(unicode(stop, "stop") for stop in given)


def stop_ids(value) -> frozenset[int]:
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


def messages(value) -> list[dict]:
    """A chat's `messages`: system, developer (read as system), user and assistant turns of text."""
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
        unicode(content, f"messages[{i}].content")
        role = "system" if message["role"] == "developer" else message["role"]
        out.append({"role": role, "content": content})
    return out


def prompt(value) -> str:
    """One text prompt (/tokenize's)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if not isinstance(value, str) or not value:
        raise ApiError(400, "'prompt' must be a non-empty string", "prompt", "missing_parameter")
    return unicode(value, "prompt")


def prompts(value) -> list[str | tuple[int, ...]]:
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
            out.append(unicode(item, "prompt"))
        elif isinstance(item, list) and item and all(type(t) is int and 0 <= t < 2**31 for t in item):
            out.append(tuple(item))
        else:
            raise ApiError(400, message, "prompt")
    return out
