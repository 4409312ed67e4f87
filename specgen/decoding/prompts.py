"""Prompt text to token ids: the chat template applied once, and prompts files read and checked."""

from __future__ import annotations

import json
from dataclasses import dataclass

from jinja2 import TemplateError

from specgen.errors import PromptError, first_line


def encode_prompt(tokenizer, prompt: str, raw: bool = False, system: str | None = None) -> list[int]:
    """Apply the chat template (unless raw) and tokenize once."""
    if not prompt.strip():
        raise PromptError("the prompt is empty")
    if raw or not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(prompt, add_special_tokens=False) or tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]
    return render_chat(tokenizer, messages)


def render_chat(tokenizer, messages: list[dict], generation_prompt: bool = True,
                special_tokens: bool = False) -> list[int]:
    """`messages` through the model's chat template, tokenized (`special_tokens`: with the
    tokenizer's BOS/EOS added around the rendered text, as vLLM's /tokenize may ask). A template
    that fails (a syntax error, its own raise_exception over roles it does not take) is one
    PromptError."""
    try:
        if special_tokens:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
            return tokenizer.encode(text, add_special_tokens=True)
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                  return_dict=True)["input_ids"])
    except (TemplateError, ValueError, TypeError) as exc:
        raise PromptError(f"the model's chat template refused the messages: {first_line(exc) or type(exc).__name__}",
                          hint="--raw sends the prompt without the template") from None


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a prompts file: its id (the JSONL `id` field, else its 1-based line number)."""

    id: str | int
    text: str
    line: int


def read_prompts_file(path) -> list[str]:
    """The prompts of a prompts file, in order (see `read_prompt_records`)."""
    return [record.text for record in read_prompt_records(path)]


def read_prompt_records(path, unique_ids: bool = False) -> list[PromptRecord]:
    """One prompt per line, or JSONL objects with a `prompt` field (and an optional `id`, a string
    or an integer); blank lines skipped. A prompt's id is its `id`, else its line number.

    Anything else is one PromptError naming the file and line: a non-string or empty prompt, an
    id that is neither a string nor an integer, invalid JSON, bytes that are not UTF-8; with
    `unique_ids` (results keyed by id: `run --output`) also an id that an earlier line holds.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise PromptError(f"cannot read prompts file {path}: {exc.strerror or exc}") from None
    records: list[PromptRecord] = []
    seen: dict[str | int, int] = {}
    for number, raw in enumerate(data.splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PromptError(f"{path}:{number}: not valid UTF-8 text (byte 0x{raw[exc.start]:02x})") from None
        if not line.strip():
            continue
        record = _parse_line(line, path, number)
        if unique_ids and record.id in seen:
            raise PromptError(f"{path}:{number}: id {json.dumps(record.id)} is already the id of line "
                              f"{seen[record.id]}", hint="results are kept by id: give every prompt its own")
        seen.setdefault(record.id, number)
        records.append(record)
    if not records:
        raise PromptError(f"{path} holds no prompts")
    return records


def _parse_line(line: str, path, number: int) -> PromptRecord:
    if not line.lstrip().startswith("{"):
        return PromptRecord(number, line, number)
    try:
        record = json.loads(line)
    except ValueError:
        raise PromptError(f"{path}:{number}: not valid JSON") from None
    if not isinstance(record, dict) or "prompt" not in record:
        raise PromptError(f"{path}:{number}: expected a JSON object with a 'prompt' field")
    prompt = record["prompt"]
    if not isinstance(prompt, str):  # null, 3, [..] are not prompts, and str() would hide that
        raise PromptError(f"{path}:{number}: 'prompt' must be a string, got {json.dumps(prompt)[:40]}")
    if not prompt.strip():
        raise PromptError(f"{path}:{number}: the prompt is empty")
    ident = record.get("id", number)
    # True == 1 and 1.0 == 1 as keys: only strings and integers name a prompt unambiguously
    if isinstance(ident, bool) or not isinstance(ident, (str, int)):
        raise PromptError(f"{path}:{number}: 'id' must be a string or an integer, got {json.dumps(ident)[:40]}")
    return PromptRecord(ident, prompt, number)
