"""How a draft's token ids relate to its target's: the same tokenizer (one object shared when both
are built from the same files), another tokenizer that drafts through text, or an EAGLE-3 head."""

from __future__ import annotations

import enum
import hashlib
import json
from pathlib import Path

from specgen.errors import ModelError, first_line
from specgen.text import json_value

TEXT_DRAFTING = "draft tokenizer differs: text-level drafting"
ROUND_TRIP = "Hello, world! 12 + 30 = 42.\n"  # text any tokenizer a draft may use must decode back


class Vocabulary(enum.Enum):
    """How a draft's token ids relate to its target's (decided once, at load).

    SHARED: the same tokenizer; the draft proposes target ids directly (the fast path).
    TEXT: another tokenizer; drafts go through text (decoding/drafters/text.py).
    HEAD: an EAGLE-3 head (models/eagle_head.py): no model of its own, it reads the target's
    features and maps its draft vocabulary to target ids."""

    SHARED = "shared"
    TEXT = "text"
    HEAD = "head"


TOKENIZER_KEYS = (
    "eos_token",
    "bos_token",
    "pad_token",
    "unk_token",
    "added_tokens_decoder",
    "additional_special_tokens",
    "extra_special_tokens",
)


def tokenizer_fingerprint(path: str | None) -> str | None:
    """A digest of what defines a local model's tokenizer for decoding (tokenizer.json and the
    special tokens of tokenizer_config.json); None when it cannot be read that way (then the
    tokenizer is loaded and compared as usual)."""
    if path is None:
        return None
    try:
        digest = hashlib.sha256(Path(path, "tokenizer.json").read_bytes())
        config = json_value(Path(path, "tokenizer_config.json").read_bytes())
        digest.update(json.dumps({k: config.get(k) for k in TOKENIZER_KEYS}, sort_keys=True).encode())
    except (OSError, ValueError, AttributeError):  # AttributeError: a config that is not an object
        return None
    return digest.hexdigest()


def compare_tokenizers(target_tok, draft_tok) -> Vocabulary:
    """SHARED when both tokenizers map the same ids to the same tokens with the same special
    tokens, else TEXT (a draft of another family drafts through text). A draft tokenizer that
    cannot give text back (ROUND_TRIP does not survive encode + decode) is refused: text-level
    drafting needs it."""
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    same = target_vocab == draft_vocab and all(
        getattr(target_tok, attr, None) == getattr(draft_tok, attr, None)
        for attr in ("eos_token", "bos_token", "pad_token", "unk_token")
    )
    if same:
        return Vocabulary.SHARED
    try:
        text = draft_tok.decode(
            draft_tok.encode(ROUND_TRIP, add_special_tokens=False),
            skip_special_tokens=True,
            clean_up_tokenization_spaces=False,
        )
    except Exception as exc:  # a tokenizer without a decoder, a broken one
        why = first_line(exc) or type(exc).__name__
        raise ModelError(
            f"draft and target tokenizers differ, and the draft's cannot decode text: {why}"
        ) from None
    if text.strip() != ROUND_TRIP.strip():
        raise ModelError(
            f"draft and target tokenizers differ, and the draft's does not give text back "
            f"({ROUND_TRIP.strip()!r} decodes to {text.strip()!r}); text-level drafting needs it"
        )
    return Vocabulary.TEXT
