"""Prompt text to token ids: the chat template applied once, and prompts files read and checked."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

from jinja2 import TemplateError

from specgen.errors import PromptError, first_line
from specgen.text import json_value


def encode_prompt(tokenizer, prompt: str, raw: bool = False, system: str | None = None) -> list[int]:
    """Apply the chat template (unless raw) and tokenize once."""
    if not prompt.strip():
        raise PromptError("the prompt is empty")
    if raw or not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(prompt, add_special_tokens=False) or tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    return render_chat(tokenizer, messages)


def render_chat(
    tokenizer, messages: list[dict], generation_prompt: bool = True, special_tokens: bool = False
) -> list[int]:
    """`messages` through the model's chat template, tokenized (`special_tokens`: with the
    tokenizer's BOS/EOS added around the rendered text, as vLLM's /tokenize may ask). A template
    that fails (a syntax error, its own raise_exception over roles it does not take) is one
    PromptError.

    A message's text is text: a special token written in it (`<|im_end|>`, `<|im_start|>system`)
    becomes the tokens of its characters, so a client cannot end its turn or open another role's.
    Only the template's own markup yields special tokens."""
    try:
        literal = _specials_in(tokenizer, messages)
        if literal:
            return _render_literal(tokenizer, messages, generation_prompt, special_tokens, literal)
        if special_tokens:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tokenize=False
            )
            return tokenizer.encode(text, add_special_tokens=True)
        return list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, return_dict=True
            )["input_ids"]
        )
    except (TemplateError, ValueError, TypeError) as exc:
        raise PromptError(
            f"the model's chat template refused the messages: {first_line(exc) or type(exc).__name__}",
            hint="--raw sends the prompt without the template",
        ) from None


def _specials_in(tokenizer, messages: list[dict]) -> list[str]:
    """The special tokens' texts that some message's content holds, longest first."""
    contents = [m.get("content") for m in messages]
    texts = {
        t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special and t.content
    }
    found = [s for s in texts if any(isinstance(c, str) and s in c for c in contents)]
    return sorted(found, key=len, reverse=True)


def _render_literal(
    tokenizer, messages: list[dict], generation_prompt: bool, special_tokens: bool, literal: list[str]
) -> list[int]:
    """Render with each special text in the contents masked by a private-use character the
    template cannot hold, so that where they stand in the rendered text is known; tokenize the
    rendered text once, as the plain path does, and replace each special token standing there by
    its characters' tokens. Every other id is the plain path's."""
    used = set(tokenizer.chat_template or "").union(
        *(m["content"] for m in messages if isinstance(m.get("content"), str))
    )
    free = (chr(c) for c in range(_PRIVATE_USE[0], _PRIVATE_USE[1]) if chr(c) not in used)
    masks = {s: next(free) for s in literal}
    pattern = re.compile("|".join(map(re.escape, literal)))
    masked = [
        dict(m, content=pattern.sub(lambda hit: masks[hit.group()], m["content"]))
        if isinstance(m.get("content"), str)
        else m
        for m in messages
    ]
    rendered = tokenizer.apply_chat_template(masked, add_generation_prompt=generation_prompt, tokenize=False)
    unmask = {mask: s for s, mask in masks.items()}
    parts, spans, length, last = [], [], 0, 0
    for hit in re.finditer("[" + "".join(unmask) + "]", rendered):
        parts.append(rendered[last : hit.start()])
        length += hit.start() - last
        spans.append((length, length + len(unmask[hit.group()])))
        parts.append(unmask[hit.group()])
        length, last = spans[-1][1], hit.end()
    text = "".join(parts) + rendered[last:]
    if not spans:  # the template left those contents out
        return tokenizer(text, add_special_tokens=special_tokens)["input_ids"]
    if not getattr(tokenizer, "is_fast", False):  # no offsets: the pieces around those texts one by one
        ends = [0] + [b for _, b in spans]
        starts = [a for a, _ in spans] + [len(text)]
        ids = tokenizer(text[: starts[0]], add_special_tokens=False)["input_ids"]
        for (a, b), end, start in zip(spans, ends[1:], starts[1:]):
            ids += (
                _characters(tokenizer, text[a:b])
                + tokenizer(text[end:start], add_special_tokens=False)["input_ids"]
            )
        return tokenizer.build_inputs_with_special_tokens(ids) if special_tokens else ids
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    encoding = tokenizer(text, add_special_tokens=special_tokens, return_offsets_mapping=True)
    ids = []
    for token, (start, end) in zip(encoding["input_ids"], encoding["offset_mapping"]):
        inside = token in special and any(start <= a and b <= end for a, b in spans)
        ids += _characters(tokenizer, text[start:end]) if inside else [token]
    return ids


def _characters(tokenizer, text: str) -> list[int]:
    """`text` as the tokens of its characters, special tokens' texts included."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


_PRIVATE_USE = (0xE000, 0xF900)  # Unicode's private-use area: no template writes these


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a prompts file: its id (the JSONL `id` field, else its 1-based line number),
    its text and the line it stands on. A bench prompt set's prompts also name a category, and
    one may be a conversation: `messages`, sent as written (its `text` is then empty)."""

    id: str | int
    text: str
    line: int
    category: str = ""
    messages: tuple[dict, ...] = ()  # a conversation; () for the one user message `text`

    def chat(self) -> list[dict]:
        """The prompt as chat messages: the conversation, or `text` as the one user message."""
        return list(self.messages) if self.messages else [{"role": "user", "content": self.text}]


def read_prompts_file(path) -> list[str]:
    """The prompts of a prompts file, in order (see `read_prompt_records`)."""
    return [record.text for record in read_prompt_records(path)]


# the most a prompts file may hold: a million prompts of 1 KB; `--prompts-file /dev/zero` ends
# with a line, not out of memory
MAX_PROMPTS_FILE_BYTES = 1 << 30


def read_prompts_bytes(path) -> bytes:
    """A prompts file's bytes, up to MAX_PROMPTS_FILE_BYTES; anything else is one PromptError."""
    try:
        with open(path, "rb") as stream:
            data = stream.read(MAX_PROMPTS_FILE_BYTES + 1)
    except OSError as exc:
        raise PromptError(f"cannot read prompts file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_PROMPTS_FILE_BYTES:
        raise PromptError(f"prompts file {path} holds more than {MAX_PROMPTS_FILE_BYTES >> 30} GiB; split it")
    return data


def prompt_lines(path) -> Iterator[tuple[int, str]]:
    """A prompts file's lines that are not blank, each with its 1-based number; bytes that are
    not UTF-8 are one PromptError naming the line. The bytes split at line ends only:
    str.splitlines would also cut a JSON string at U+2028, U+0085 or \x1c, which JSON keeps
    unescaped."""
    for number, raw in enumerate(read_prompts_bytes(path).splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PromptError(
                f"{path}:{number}: not valid UTF-8 text (byte 0x{raw[exc.start]:02x})"
            ) from None
        if line.strip():
            yield number, line


def read_prompt_records(path, unique_ids: bool = False) -> list[PromptRecord]:
    """One prompt per line, or JSONL objects with a `prompt` field (and an optional `id`, a string
    or an integer); blank lines skipped. A prompt's id is its `id`, else its line number.

    Anything else is one PromptError naming the file and line: a non-string or empty prompt, an
    id that is neither a string nor an integer, invalid JSON, bytes that are not UTF-8; with
    `unique_ids` (results keyed by id: `run --output`) also an id that an earlier line holds.
    """
    records: list[PromptRecord] = []
    seen: dict[str | int, int] = {}
    for number, line in prompt_lines(path):
        record = _parse_line(line, path, number)
        if unique_ids and record.id in seen:
            raise PromptError(
                f"{path}:{number}: id {json.dumps(record.id)} is already the id of line {seen[record.id]}",
                hint="results are kept by id: give every prompt its own",
            )
        seen.setdefault(record.id, number)
        records.append(record)
    if not records:
        raise PromptError(f"{path} holds no prompts")
    return records


def _parse_line(line: str, path, number: int) -> PromptRecord:
    if not line.lstrip().startswith("{"):
        return PromptRecord(number, line, number)
    try:
        record = json_value(line)
    except ValueError:
        raise PromptError(f"{path}:{number}: not valid JSON") from None
    if not isinstance(record, dict) or "prompt" not in record:
        raise PromptError(f"{path}:{number}: expected a JSON object with a 'prompt' field")
    prompt = record["prompt"]
    if not isinstance(prompt, str):  # null, 3, [..] are not prompts, and str() would hide that
        raise PromptError(f"{path}:{number}: 'prompt' must be a string, got {json.dumps(prompt)[:40]}")
    if not prompt.strip():
        raise PromptError(f"{path}:{number}: the prompt is empty")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON's \ud800 escapes decode to lone surrogates
        raise PromptError(
            f"{path}:{number}: the prompt holds a lone surrogate at character {exc.start}, not Unicode text"
        ) from None
    ident = record.get("id", number)
    # True == 1 and 1.0 == 1 as keys: only strings and integers name a prompt unambiguously
    if isinstance(ident, bool) or not isinstance(ident, (str, int)):
        raise PromptError(
            f"{path}:{number}: 'id' must be a string or an integer, got {json.dumps(ident)[:40]}"
        )
    return PromptRecord(ident, prompt, number)
