"""Reading a prompt: an argument, a file or stdin, as UTF-8 text of at most MAX_PROMPT_BYTES;
a bad byte or a lone surrogate is one line naming where it came from. No tensors here."""

from __future__ import annotations

import sys
from pathlib import Path

from specgen.errors import PromptError

# the most prompt text read from a file or stdin: more than any model's context holds (a
# million tokens at 32 bytes each), so `--file /dev/zero` ends with a line, not out of memory;
# a prompt longer than the target's context is refused once it is tokenized
MAX_PROMPT_BYTES = 32 << 20


def read_bounded(stream, where: str) -> bytes:
    data = stream.read(MAX_PROMPT_BYTES + 1)
    if len(data) > MAX_PROMPT_BYTES:
        raise PromptError(
            f"{where} holds more than {MAX_PROMPT_BYTES >> 20} MiB: more text than any model's "
            "context takes; shorten it"
        )
    return data


def read_prompt(prompt: str | None, file: Path | None) -> str:
    if prompt is not None and file is not None:
        raise PromptError("give the prompt as an argument or with --file, not both")
    if file is not None:
        try:
            with open(file, "rb") as stream:
                data = read_bounded(stream, f"prompt file {file}")
        except OSError as exc:
            raise PromptError(f"cannot read prompt file {file}: {exc.strerror or exc}") from None
        return decode_text(data, f"prompt file {file}")
    if prompt == "-":
        return read_stdin()
    if prompt is None:
        raise PromptError("no prompt given; pass PROMPT, '-' for stdin, or --file F")
    return check_text(prompt, "the prompt")


def decode_text(data: bytes, where: str) -> str:
    """UTF-8 bytes -> text, or one PromptError naming `where` and the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptError(
            f"{where} is not valid UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})"
        ) from None


def check_text(text: str, where: str) -> str:
    """Text that came through surrogateescape (argv, a C-locale stdin) can hold undecodable bytes as
    lone surrogates; tokenizers choke on them, so they are refused here with one line."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PromptError(
            f"{where} is not valid UTF-8 text (an undecodable byte at character {exc.start})"
        ) from None
    return text


def read_stdin() -> str:
    """All of stdin as UTF-8 text (decoded here, so a bad byte is one clear error line). A
    terminal's reader is told how to end it: a blank screen gave no sign of waiting."""
    if sys.stdin.isatty():
        sys.stderr.write("reading the prompt from the terminal; end it with Ctrl-D on a line of its own\n")
        sys.stderr.flush()
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is not None:
        return decode_text(read_bounded(buffer, "stdin"), "stdin")
    try:
        text = sys.stdin.read(MAX_PROMPT_BYTES + 1)
        if len(text) > MAX_PROMPT_BYTES:
            raise PromptError(f"stdin holds more than {MAX_PROMPT_BYTES >> 20} MiB; shorten it")
    except UnicodeDecodeError as exc:
        raise PromptError(f"stdin is not valid UTF-8 text ({exc.reason})") from None
    return check_text(text, "stdin")
