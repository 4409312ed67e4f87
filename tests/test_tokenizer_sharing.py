"""A draft built from the target's tokenizer files shares the target's tokenizer object (one
load less per start); any difference in those files means a separate load and the usual check."""

from __future__ import annotations

import json
import shutil

import pytest

from specgen.models import load as models
from specgen.errors import ModelError


def load(target, draft):
    return models.load_pair(str(target), str(draft), device="cpu", dtype="float32", quiet=True)


def test_same_tokenizer_files_share_one_tokenizer(tiny_dirs):
    target, draft = load(tiny_dirs["target"], tiny_dirs["draft"])
    assert draft.tokenizer is target.tokenizer
    assert models.tokenizer_fingerprint(str(tiny_dirs["target"])) == models.tokenizer_fingerprint(
        str(tiny_dirs["draft"]))


def test_a_different_special_token_is_loaded_and_caught(tiny_dirs, tmp_path):
    odd = tmp_path / "draft"
    shutil.copytree(tiny_dirs["draft"], odd)
    config_file = odd / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["eos_token"] = "<|endoftext|>"  # same vocabulary, another end-of-sequence token
    config_file.write_text(json.dumps(config))
    assert models.tokenizer_fingerprint(str(odd)) != models.tokenizer_fingerprint(str(tiny_dirs["target"]))
    with pytest.raises(ModelError, match="eos_token"):
        load(tiny_dirs["target"], odd)


def test_a_different_vocabulary_is_still_refused(tiny_dirs):
    with pytest.raises(ModelError, match="tokenizers differ"):
        load(tiny_dirs["target"], tiny_dirs["odd_draft"])


def test_unreadable_tokenizer_files_mean_no_fingerprint(tmp_path):
    assert models.tokenizer_fingerprint(str(tmp_path)) is None
    assert models.tokenizer_fingerprint(None) is None
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("not json")
    assert models.tokenizer_fingerprint(str(tmp_path)) is None
