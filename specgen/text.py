"""Token sequences: incremental detokenization (a few tokens decoded per new token) and
prefix comparison of id lists."""

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
