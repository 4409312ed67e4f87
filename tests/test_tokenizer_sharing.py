"""A draft built from the target's tokenizer files shares the target's tokenizer object (one
load less per start); any difference in those files means a separate load and the usual check
(a draft whose tokenizer differs drafts through text)."""

from __future__ import annotations

import json
import shutil

import pytest

from specgen.errors import ModelError
from specgen.models import load as models


def load(target, draft):
    return models.load_pair(str(target), str(draft), device="cpu", dtype="float32", quiet=True)


def test_same_tokenizer_files_share_one_tokenizer(tiny_dirs):
    target, draft = load(tiny_dirs["target"], tiny_dirs["draft"])
    assert draft.tokenizer is target.tokenizer
    assert models.tokenizer_fingerprint(str(tiny_dirs["target"])) == models.tokenizer_fingerprint(
        str(tiny_dirs["draft"])
    )


def test_a_different_special_token_is_loaded_and_drafts_through_text(tiny_dirs, tmp_path):
    odd = tmp_path / "draft"
    shutil.copytree(tiny_dirs["draft"], odd)
    config_file = odd / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["eos_token"] = "<|endoftext|>"  # same vocabulary, another end-of-sequence token
    config_file.write_text(json.dumps(config))
    assert models.tokenizer_fingerprint(str(odd)) != models.tokenizer_fingerprint(str(tiny_dirs["target"]))
    target, draft = load(tiny_dirs["target"], odd)
    assert draft.tokenizer is not target.tokenizer and draft.vocabulary is models.Vocabulary.TEXT


def test_a_different_vocabulary_drafts_through_text(tiny_dirs):
    _, draft = load(tiny_dirs["target"], tiny_dirs["odd_draft"])
    assert draft.vocabulary is models.Vocabulary.TEXT


class Lossy:
    """A draft tokenizer that loses case: text does not come back from it."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, ids, **kwargs):
        return self.inner.decode(ids, **kwargs).lower()


def test_a_draft_tokenizer_that_cannot_give_text_back_is_refused():
    from tiny import build_tokenizer

    assert models.compare_tokenizers(build_tokenizer(), build_tokenizer("<|odd|>")) is models.Vocabulary.TEXT
    with pytest.raises(ModelError, match="tokenizers differ.*give text back"):
        models.compare_tokenizers(build_tokenizer(), Lossy(build_tokenizer("<|odd|>")))


def test_unreadable_tokenizer_files_mean_no_fingerprint(tmp_path):
    assert models.tokenizer_fingerprint(str(tmp_path)) is None
    assert models.tokenizer_fingerprint(None) is None
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("not json")
    assert models.tokenizer_fingerprint(str(tmp_path)) is None
