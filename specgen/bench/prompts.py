"""Bench prompt sets: `prompts/*.jsonl` by name, a file, or `all`; each line checked, and
every prompt encoded once with the chat template."""

from __future__ import annotations

import json
import os
from pathlib import Path

from specgen.decoding.prompts import PromptRecord, encode_prompt, prompt_lines, render_chat
from specgen.errors import ConfigError, PromptError
from specgen.text import json_value

QUICK = "quick"
ALL = "all"


def prompt_dirs() -> list[Path]:
    """Where prompt sets live: inside the installed package (a wheel ships `prompts/` as
    `specgen/prompts/`), the repository's `prompts/` beside the package (a checkout, an editable
    install), then ./prompts."""
    package = Path(__file__).resolve().parents[1]
    checkout = package.parent / "prompts" if (package.parent / "pyproject.toml").is_file() else None
    candidates = [package / "prompts", checkout, Path.cwd() / "prompts"]
    found: list[Path] = []
    for directory in candidates:
        if (
            directory is not None
            and directory.is_dir()
            and directory.resolve() not in [d.resolve() for d in found]
        ):
            found.append(directory)
    return found


def prompt_set_names(dirs: list[Path] | None = None) -> list[str]:
    dirs = prompt_dirs() if dirs is None else dirs
    return sorted({p.stem for d in dirs for p in d.glob("*.jsonl")})


def load_prompts(spec: str, limit: int | None = None, dirs: list[Path] | None = None) -> list[PromptRecord]:
    """`spec` is a set name (a file stem under prompts/), `all`, or a path to a JSONL file.

    `limit` keeps the first N prompts of each file (so `all --limit 2` keeps every category).
    """
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    dirs = prompt_dirs() if dirs is None else dirs
    prompts: list[PromptRecord] = []
    for path in _prompt_files(spec.strip(), dirs):
        prompts.extend(read_prompt_file(path)[:limit])
    seen: set[str] = set()
    for item in prompts:
        if item.id in seen:
            raise PromptError(f"prompt id '{item.id}' appears twice in --prompts {spec}")
        seen.add(item.id)
    if not prompts:
        raise PromptError(f"--prompts {spec} holds no prompts")
    return prompts


def prompt_files(spec: str, dirs: list[Path] | None = None) -> list[Path]:
    """The files `--prompts spec` reads (see `load_prompts`)."""
    return _prompt_files(spec.strip(), prompt_dirs() if dirs is None else dirs)


def _prompt_files(spec: str, dirs: list[Path]) -> list[Path]:
    if spec == ALL:
        for directory in dirs:
            files = sorted(p for p in directory.glob("*.jsonl") if p.stem != QUICK)
            if files:
                return files
        raise PromptError(
            "no prompt sets found for --prompts all (looked for prompts/*.jsonl "
            "next to the package and in the current directory)"
        )
    is_name = spec and "/" not in spec and os.sep not in spec and not spec.endswith(".jsonl")
    if is_name:
        for directory in dirs:
            if (directory / f"{spec}.jsonl").is_file():
                return [directory / f"{spec}.jsonl"]
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    names = ", ".join(prompt_set_names(dirs) + [ALL]) or ALL
    raise PromptError(f"unknown prompt set '{spec}': not a file, and not one of: {names}")


def read_prompt_file(path: Path) -> list[PromptRecord]:
    """Parse and check one JSONL prompt file; any problem is one line naming file:line."""
    prompts = []
    for number, line in prompt_lines(path):
        where = f"{path}:{number}"
        try:
            obj = json_value(line)
        except json.JSONDecodeError as exc:
            raise PromptError(f"{where}: not valid JSON ({exc.msg})") from None
        prompts.append(_prompt_from(obj, where, number))
    return prompts


def _prompt_from(obj, where: str, number: int) -> PromptRecord:
    if not isinstance(obj, dict):
        raise PromptError(f"{where}: each line must be a JSON object")
    for key in ("id", "category"):
        if not isinstance(obj.get(key), str) or not obj[key].strip():
            raise PromptError(f"{where}: missing or empty string field '{key}'")
        if not obj[key].isprintable():  # printed in tables and progress lines: no terminal escapes
            raise PromptError(f"{where}: '{key}' holds a control character")
    if obj["category"] == ALL:
        raise PromptError(
            f"{where}: the category '{ALL}' is the summary of every category; name it otherwise"
        )
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        raise PromptError(f"{where}: needs exactly one of 'prompt' or 'messages'")
    texts = [prompt] if messages is None else [m.get("content") for m in messages if isinstance(m, dict)]
    for text in (t for t in texts if isinstance(t, str)):  # JSON's \ud800 escapes decode to lone surrogates
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PromptError(
                f"{where}: the text is not valid Unicode (a lone surrogate at character {exc.start})"
            ) from None
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptError(f"{where}: 'prompt' must be a non-empty string")
        return PromptRecord(obj["id"], prompt, number, obj["category"])
    ok = (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )
    if not ok:
        raise PromptError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    return PromptRecord(obj["id"], "", number, obj["category"], messages=tuple(dict(m) for m in messages))


def encode_all(tokenizer, items: list[PromptRecord], context: int) -> list[list[int]]:
    """Every prompt's token ids, each checked against the target's context (with room for a
    token) before anything is measured, in every bench mode."""
    encoded = []
    for item in items:
        ids = encode(tokenizer, item)
        if len(ids) >= context - 1:
            raise PromptError(f"prompt {item.id} has {len(ids)} tokens; the target's context holds {context}")
        encoded.append(ids)
    return encoded


def encode(tokenizer, item: PromptRecord) -> list[int]:
    """Token ids of one prompt, through the chat template with the generation prompt added."""
    if not item.messages:
        return encode_prompt(tokenizer, item.text)
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError(
            f"prompt {item.id} is a conversation but the target's tokenizer has no chat template"
        )
    return render_chat(tokenizer, list(item.messages))
