"""Token ids to text, incrementally: each new token costs a decode of a few tokens only."""

from __future__ import annotations


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

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        after = decode(self.ids[self._prefix:], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before):]
        if not after.endswith("\ufffd"):
            self._read = len(self.ids)  # a special or empty token: nothing to show
        return ""

    def truncate(self, length: int) -> None:
        """Forget the ids from `length` on (a deterministic-mode rollback)."""
        del self.ids[length:]
        self._read = min(self._read, length)
        self._prefix = min(self._prefix, max(self._read - 6, 0))

    def token_text(self, token_id: int) -> str:
        """A single token's text out of context (for showing rejected draft tokens)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=True)
