"""The per-device default draft length: chosen from measured costs, deterministic, cached."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from specgen import draft_length
from specgen.config import parse_draft_tokens


def verify(slope: float) -> dict[int, float]:
    return {n: 1.0 + slope * (n - 1) for n in range(1, draft_length.MAX_K + 2)}


def test_cheap_draft_and_flat_verify_draft_long():
    assert draft_length.best_k(0.05, verify(0.0)) >= 4


def test_costly_draft_drafts_short():
    # the default pair on an AVX2 CPU, int8: draft step 0.5 of a target step, verify(5) 1.17 steps
    assert draft_length.best_k(0.5, verify(0.04)) == 2
    assert draft_length.best_k(0.9, verify(0.3)) == 1


def test_choice_is_deterministic_for_given_costs():
    assert {draft_length.best_k(0.3, verify(0.1)) for _ in range(5)} == {draft_length.best_k(0.3, verify(0.1))}


def test_device_keyword_parses():
    assert parse_draft_tokens("device") == (4, None)


def test_gpu_and_no_draft_need_no_measurement():
    cuda = SimpleNamespace(device=torch.device("cuda"))
    assert draft_length.choose(SimpleNamespace(target=cuda, draft=cuda)).k == draft_length.GPU_K
    assert draft_length.choose(SimpleNamespace(target=cuda, draft=None)).k == draft_length.GPU_K


def test_measured_once_then_cached(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    target, draft = tiny_pair
    pair = SimpleNamespace(target=target, draft=draft)
    first = draft_length.choose(pair)
    assert 1 <= first.k <= draft_length.MAX_K and "measured" in first.reason
    assert (tmp_path / "draft-length.json").is_file()
    monkeypatch.setattr(draft_length, "_ratios", lambda *a, **k: (_ for _ in ()).throw(AssertionError("re-measured")))
    assert draft_length.choose(pair) == first
