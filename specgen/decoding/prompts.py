"""Prompt text to token ids: the chat template applied once, and prompts files read and checked."""

from __future__ import annotations

import json

from specgen.errors import PromptError


def encode_prompt(tokenizer, prompt: str, raw: bool = False, system: str | None = None) -> list[int]:
    """Apply the chat template (unless raw) and tokenize once."""
    if not prompt.strip():
        raise PromptError("the prompt is empty")
    if raw or not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(prompt, add_special_tokens=False) or tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              return_dict=True)["input_ids"])


def read_prompts_file(path) -> list[str]:
    """One prompt per line, or JSONL objects with a `prompt` field; blank lines skipped.

    Anything else is one PromptError naming the file and line: a non-string or empty prompt,
    invalid JSON, bytes that are not UTF-8.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise PromptError(f"cannot read prompts file {path}: {exc.strerror or exc}") from None
    prompts = []
    for number, raw in enumerate(data.splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PromptError(f"{path}:{number}: not valid UTF-8 text (byte 0x{raw[exc.start]:02x})") from None
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            prompts.append(line)
            continue
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
        prompts.append(prompt)
    if not prompts:
        raise PromptError(f"{path} holds no prompts")
    return prompts
