"""Token sequences: incremental detokenization (a few tokens decoded per new token), a token's
exact bytes, and prefix comparison of id lists."""

from __future__ import annotations

import codecs
import json
import re
import sys


class TextStream:
    """Turns a growing list of token ids into text deltas.

    Byte-level tokenizers can split one character over several tokens; a delta is released
    only once the decoded window no longer ends in a replacement character, and it is
    attributed to the token that completed it.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # end of the part already released as text
        self._released = [0]  # every length at which all text so far had been released
        self._pieces: list[str] = []  # the text released at each of those lengths but the first
        self._bytes: TokenBytes | None = None  # made when first needed (most text never needs it)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        after = decode(self.ids[self._prefix :], skip_special_tokens=True)
        new = after[len(before) :] if after.startswith(before) else None
        if new is not None and "\ufffd" not in new and self._read == len(self.ids) - 1:
            if new:  # the common case: this token's text, in the context of the ones before it
                self._prefix = self._read
            self._read = len(self.ids)  # (a special or empty token: nothing to show)
            return self._release(new)
        # tokens held back, a U+FFFD in the new text (a character not complete yet, bytes that
        # form none), or a decode that rewrote text already released (a byte-fallback decoder
        # turns a whole run of bytes into U+FFFD for one stray byte): the held tokens' own bytes
        # decide, so the text never depends on where the decode window starts
        text, waiting = _utf8(self._held_bytes())
        if waiting:
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return self._release(text)

    def _held_bytes(self) -> bytes:
        if self._read == len(self.ids):  # nothing held (the end of most rows): no TokenBytes to make
            return b""
        if self._bytes is None:
            self._bytes = TokenBytes(self.tokenizer)
        token_bytes = self._bytes
        return b"".join(token_bytes(t) for t in self.ids[self._read :] if t not in token_bytes.specials)

    def _release(self, piece: str) -> str:
        self._released.append(self._read)
        self._pieces.append(piece)
        return piece

    def rest(self) -> str:
        """The text of what is held back: tokens that complete no character yet (a character cut
        short at the end), or bytes that never will (a byte-fallback tokenizer's stray byte,
        after which its decoder turns every later byte of the run into U+FFFD). Made from the
        tokens' own bytes, U+FFFD where they form no character, so `text()` keeps every byte
        that is one."""
        return self._held_bytes().decode("utf-8", "replace")

    def flush(self) -> str:
        """Release what is held back, as `rest` says (the generation has ended)."""
        rest = self.rest()
        self._prefix = self._read = len(self.ids)
        if self._released[-1] != self._read:
            self._release(rest)
        return rest

    def text(self) -> str:
        """Everything released, then what is held back: the generation's text (what a renderer
        showed, token by token, once the end flushed the stream)."""
        return "".join(self._pieces) + self.rest()

    def truncate(self, length: int) -> None:
        """Forget the ids from `length` on (a deterministic-mode rollback). Reading resumes at the
        last point where everything before it had been released: a token that completed no
        character gave its text to a later token, and if that one is cut, its text comes again
        with the next one."""
        del self.ids[length:]
        while self._released[-1] > length:
            self._released.pop()
            self._pieces.pop()
        self._read = self._released[-1]
        self._prefix = min(self._prefix, max(self._read - 6, 0))

    def token_text(self, token_id: int) -> str:
        """A single token's text out of context (for showing rejected draft tokens)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=True)


def _utf8(data: bytes) -> tuple[str, bool]:
    """(the text of `data`, U+FFFD for bytes that form no character; whether it ends in part of
    a character that more bytes may complete)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text = decoder.decode(data)
    return text, bool(decoder.getstate()[0])


def text_of(tokenizer, ids: list[int], stream: TextStream | None = None) -> str:
    """A generation's text: the tokenizer's decode, unless that holds U+FFFD, where the text a
    stream makes of the same ids (`stream`, which holds exactly `ids`, or a new one) keeps
    bytes the decode replaced. Every path (a renderer's stream, a row of a batch, the server)
    so gives one text for one list of ids."""
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    if "\ufffd" not in whole:
        return whole
    if stream is None:
        stream = TextStream(tokenizer)
        for token in ids:
            stream.push(token)
    return stream.text()


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix, by C-speed slice comparisons (binary search)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1  # a[:lo] == b[:lo] and a[:hi+1] != b[:hi+1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte token


def is_byte_level(tokenizer) -> bool:
    """Whether the tokenizer writes its pieces in byte-level BPE's printable stand-ins for bytes."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte (what byte-level BPE vocabularies are written in),
    inverted: character -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def special_ids(tokenizer) -> dict[int, str]:
    """A tokenizer's special tokens, id -> text: its special ids (end of text, padding) and the
    added tokens marked special (a chat template's turn markers): what
    decode(skip_special_tokens=True) skips."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {i: token.content for i, token in added.items() if getattr(token, "special", False)}
    for i in getattr(tokenizer, "all_special_ids", ()):
        found.setdefault(i, tokenizer.convert_ids_to_tokens(i))
    return found


class TokenBytes:
    """A token's exact bytes, also for a token that holds part of a UTF-8 character (which has
    no text of its own: what OpenAI's `logprobs.bytes` is for). Byte-level BPE vocabularies
    (GPT-2, Qwen, Llama 3, SmolLM) spell bytes with printable stand-ins; SentencePiece ones have
    `<0xNN>` byte tokens and `▁` for a space; anything else (a special token, another scheme) is
    the token's decoded text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = is_byte_level(tokenizer)
        self.alphabet = _byte_level_alphabet() if self.byte_level else {}
        self.specials = frozenset(special_ids(tokenizer))
        self._known: dict[int, bytes] = {}  # a token's bytes never change

    def __call__(self, token_id: int) -> bytes:
        known = self._known.get(token_id)
        if known is None:
            known = self._known[token_id] = self._bytes(token_id)
        return known

    def _bytes(self, token_id: int) -> bytes:
        piece = None if token_id in self.specials else self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self.byte_level and all(ch in self.alphabet for ch in piece):
                return bytes(self.alphabet[ch] for ch in piece)
            found = BYTE_TOKEN.fullmatch(piece)
            if found:
                return bytes([int(found.group(1), 16)])
            if not self.byte_level and "\u2581" in piece:
                return piece.replace("\u2581", " ").encode("utf-8")
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


def json_value(text: str | bytes):
    """`json.loads`, except that a document nested too deeply for Python's parser (which
    recurses once per level: "[[[[...]]]]") is a JSONDecodeError like any other bad JSON, not a
    RecursionError, and nor is an integer too long for Python to convert (a ValueError of its
    own): local files (caches, prompt files, saves, results) are read with it."""
    document = text if isinstance(text, str) else ""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", document, 0) from None
    except (json.JSONDecodeError, UnicodeDecodeError):  # bytes that are not UTF-8 say so themselves
        raise
    except ValueError:  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise json.JSONDecodeError(
            f"a number of more than {sys.get_int_max_str_digits()} digits", document, 0
        ) from None
