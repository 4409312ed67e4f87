"""Text between two tokenizers: what a draft of another family reads and what its draft means
to the target. No model and no state but memos: `drafters/text.py` keeps the rows.

Two directions, each through text, never through ids:

* target ids -> draft ids (`draft_ids`): the committed text, split at the target's special
  tokens. Text runs are decoded and encoded with the draft's tokenizer. A target special token
  is never fed to the draft as its literal text (`<|im_start|>` spelled out in bytes would be
  noise to another family): it becomes the draft's token of the same name when the draft has
  one (ChatML families share `<|im_start|>` / `<|im_end|>`), else it is dropped, so the draft
  reads the conversation as plain text ("user\\nhi\\nassistant\\n"). The draft's own start
  tokens (a BOS its tokenizer adds) lead its context.
* draft ids -> target ids (`proposal`): the drafted ids are decoded in context, an incomplete
  trailing character is dropped (a byte-level token may end mid UTF-8 sequence), and the text
  is re-encoded with the target's tokenizer together with the committed tail (`seam` .. end).
  The proposal is what follows the longest prefix of that re-encoding equal to the committed
  tail, so it always starts right after the last committed target token. When the re-encoding
  would change committed tokens (a merge across the seam: committed "wör" + drafted "ld" is
  one token "wörld"), the drafted text is encoded on its own: the target committed the split
  already, so its continuation is the rest of the word. A draft special token ends the draft;
  when the target has a special of the same name (its end of turn), the proposal ends with it.

The target verifies the result as point masses, so nothing here can change what is emitted:
a poor conversion costs acceptance, never exactness.
"""

from __future__ import annotations

import enum

from specgen.text import common_prefix, special_ids

CONTEXT = 4  # tokens decoded before a slice, so that its first token reads as in context
MAX_TAIL = 16  # target tokens re-encoded each round at most before a cut is forced
REPLACEMENT = "\ufffd"  # what a decoder gives for bytes that do not (yet) form a character
WORD_MARKS = ("\u0120", "\u010a", "\u0109", "\u2581", " ", "\n", "\t")  # byte-level and SentencePiece spaces


class Seam(enum.Enum):
    """How a round's drafted text met the committed target tokens."""

    EXTENDS = "extends"  # the re-encoding kept every committed token: the tokens after them
    RESPLIT = "resplit"  # it would have merged across the seam: the drafted text encoded alone
    NONE = "none"  # nothing usable (no text, or a partial character the draft did not complete)


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def text_of(tokenizer, ids: list[int], start: int, end: int) -> str:
    """The text ids[start:end] add after ids[:start]: decoded with a few tokens before it and
    those tokens' text cut off (a SentencePiece token's leading space survives)."""
    if start >= end:
        return ""
    before = max(0, start - CONTEXT)
    head = decode(tokenizer, ids[before:start])
    full = decode(tokenizer, ids[before:end])
    return full[len(head) :] if full.startswith(head) else decode(tokenizer, ids[start:end])


def complete(text: str) -> str:
    """The text without a trailing incomplete character."""
    return text.rstrip(REPLACEMENT)


class Bridge:
    """The conversions between one target tokenizer and one draft tokenizer."""

    def __init__(self, target_tokenizer, draft_tokenizer):
        self.target, self.draft = target_tokenizer, draft_tokenizer
        self.target_specials = special_ids(target_tokenizer)
        self.draft_specials = special_ids(draft_tokenizer)
        draft_by_name = {content: i for i, content in self.draft_specials.items()}
        target_by_name = {content: i for i, content in self.target_specials.items()}
        # a special token of one side becomes the other side's token of the same name, or nothing
        self.special_to_draft = {
            i: draft_by_name[c] for i, c in self.target_specials.items() if c in draft_by_name
        }
        self.special_to_target = {
            i: target_by_name[c] for i, c in self.draft_specials.items() if c in target_by_name
        }
        plain = draft_tokenizer.encode("a", add_special_tokens=False)
        full = draft_tokenizer.encode("a")
        self.lead = full[: full.index(plain[0])] if plain and plain[0] in full else []  # the draft's BOS
        start = draft_tokenizer.bos_token_id
        start = draft_tokenizer.eos_token_id if start is None else start
        self.filler = self.lead or [start if start is not None else 0]  # a context with no text at all
        self._word_starts: dict[int, bool] = {}

    # -- target -> draft -------------------------------------------------------------------------
    def draft_ids(self, ids: list[int], start: int, end: int) -> list[int]:
        """Target ids[start:end] as draft ids (module docstring); a trailing incomplete
        character is left out (the next round sees it whole)."""
        return self._convert(ids, start, end, hold=False)[0]

    def tail(self, ids: list[int], start: int) -> tuple[list[int], str]:
        """The tail ids[start:] as draft ids, and the trailing spaces held back from them: a
        word's space belongs to the word in BPE vocabularies (" again"), so a draft reading a
        lone space token would guess badly; it reads the text without them, and its proposal
        must begin with them (`proposal` takes them off again)."""
        return self._convert(ids, start, len(ids), hold=True)

    def _convert(self, ids: list[int], start: int, end: int, hold: bool) -> tuple[list[int], str]:
        out: list[int] = []
        held = ""
        run = start
        for i in range(start, end + 1):
            if i < end and ids[i] not in self.target_specials:
                continue
            text = text_of(self.target, ids, run, i)
            if i == end:
                text = complete(text)
                if hold:
                    kept = text.rstrip(" ")
                    text, held = kept, text[len(kept) :]
            if text:
                out.extend(self.draft.encode(text, add_special_tokens=False))
            if i < end and ids[i] in self.special_to_draft:
                out.append(self.special_to_draft[ids[i]])
            run = i + 1
        return out, held

    def cut(self, ids: list[int], start: int) -> int:
        """Where the re-encoded tail begins this round, at or after `start`: right after the last
        special token, else at the last token that starts a word (both tokenizers split words
        alike there), else (a long run without spaces, such as Chinese) about MAX_TAIL / 2
        tokens from the end at a whole character. Never before `start`; the tail holds no
        special token."""
        end = len(ids)
        for j in range(end - 1, max(start, end - MAX_TAIL) - 1, -1):
            if ids[j] in self.target_specials:
                return j + 1
            if j > start and self._word_start(ids[j]):
                return j
        if end - start <= MAX_TAIL:
            return start
        for p in range(end - MAX_TAIL // 2, end - MAX_TAIL, -1):
            if not decode(self.target, ids[max(start, p - CONTEXT) : p]).endswith(REPLACEMENT):
                return p
        return start

    def _word_start(self, token: int) -> bool:
        known = self._word_starts.get(token)
        if known is None:
            piece = self.target.convert_ids_to_tokens(token) or ""
            known = piece.startswith(WORD_MARKS) or decode(self.target, [token])[:1].isspace()
            self._word_starts[token] = known
        return known

    # -- draft -> target -------------------------------------------------------------------------
    def proposal(
        self, committed: list[int], seam: int, context: list[int], drafted: list[int], k: int, held: str = ""
    ) -> tuple[list[int], Seam]:
        """At most k target ids that continue `committed` with the text `drafted` continues the
        draft's `context` with; `seam`: where the committed tail (re-encoded with it) begins;
        `held`: committed trailing spaces the draft did not read (`tail`), which its text must
        begin with."""
        closing = None
        for n, token in enumerate(drafted):
            if token in self.draft_specials:
                closing = self.special_to_target.get(token)
                drafted = drafted[:n]
                break
        whole = context + drafted
        draft_text = complete(text_of(self.draft, whole, len(context), len(whole)))
        if not draft_text.startswith(held):
            return [], Seam.NONE
        draft_text = draft_text[len(held) :]
        if not draft_text:
            return ([closing], Seam.EXTENDS) if closing is not None and k > 0 else ([], Seam.NONE)
        raw_tail = text_of(self.target, committed, seam, len(committed))
        tail_text = complete(raw_tail)
        tail = committed[seam:]
        encoded = self.target.encode(tail_text + draft_text, add_special_tokens=False)
        matched = common_prefix(encoded, tail)
        if matched == len(tail):
            out, how = encoded[matched:], Seam.EXTENDS
        elif tail_text == raw_tail:
            out, how = self.target.encode(draft_text, add_special_tokens=False), Seam.RESPLIT
        else:  # the committed text ends mid character and the draft did not complete it
            return [], Seam.NONE
        if closing is not None:
            out.append(closing)
        return out[:k], how if out else Seam.NONE
