"""The static-cache draft (and, on CUDA, its compiled step) changes nothing the target decides."""

from __future__ import annotations

import pytest
import torch

from specgen.config import GenerationConfig, Method
from specgen.drafters import ModelDrafter
from specgen.engine import Engine
from specgen.static_draft import StaticModelDrafter
from test_engine import PROMPT, reference_greedy


def run(target, drafter, n=20, k=3, prompt=PROMPT):
    engine = Engine(target.model, target.device, frozenset(), target.context_length, drafter)
    rounds = list(engine.generate(prompt, GenerationConfig(method=Method.CHAIN, max_new_tokens=n, draft_tokens=k)))
    return [t for r in rounds for t in r.emitted], [(tuple(r.draft_tokens), r.accepted) for r in rounds]


@pytest.mark.parametrize("k", [1, 4])
def test_static_draft_proposes_what_the_dynamic_draft_proposes(tiny_pair, k):
    target, draft = tiny_pair
    static_tokens, static_rounds = run(target, StaticModelDrafter(draft.model, draft.device, max_length=128,
                                                                  compile=False), k=k)
    dynamic_tokens, dynamic_rounds = run(target, ModelDrafter(draft.model, draft.device), k=k)
    assert static_tokens == dynamic_tokens == reference_greedy(target.model, PROMPT, 20)
    assert static_rounds == dynamic_rounds  # same drafts, same acceptance: the cache is exact


def test_static_draft_is_reused_across_generations(tiny_pair):
    target, draft = tiny_pair
    drafter = StaticModelDrafter(draft.model, draft.device, max_length=128, compile=False)
    for prompt in (PROMPT, PROMPT[:5], PROMPT[::-1]):
        tokens, _ = run(target, drafter, n=12, prompt=prompt)
        assert tokens == reference_greedy(target.model, prompt, 12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_static_draft_on_cuda_keeps_greedy_output(tiny_dirs):
    from specgen.models import load_pair

    target, draft = load_pair(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cuda",
                              dtype="float32", quiet=True)
    drafter = StaticModelDrafter(draft.model, draft.device, max_length=256, compile=True)
    assert drafter.compiled
    compiled, compiled_rounds = run(target, drafter, n=24)
    plain, dynamic_rounds = run(target, ModelDrafter(draft.model, draft.device), n=24)
    assert compiled == plain
    assert compiled_rounds == dynamic_rounds


def test_cli_static_draft_matches_plain(tiny_dirs):
    import json

    from typer.testing import CliRunner

    from specgen.cli import app

    models = ["--target", str(tiny_dirs["target"]), "--draft", str(tiny_dirs["draft"]), "--dtype", "float32",
              "--device", "cpu", "-n", "10", "--format", "json"]
    runner = CliRunner()
    plain = runner.invoke(app, ["run", "hello", *models, "--method", "plain"])
    static = runner.invoke(app, ["run", "hello", *models, "--static-draft"])
    assert static.exit_code == 0, static.output
    assert (json.loads(static.stdout.splitlines()[-1])["token_ids"]
            == json.loads(plain.stdout.splitlines()[-1])["token_ids"])
