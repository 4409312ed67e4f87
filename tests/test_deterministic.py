"""Deterministic mode: the committed tokens depend on the prompt, settings and seed only."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_engine import PROMPT
from tiny import decode, engine_with

from specgen.config import GenerationConfig, Method, SamplingConfig
from specgen.decoding.engine import StopReason
from specgen.decoding.events import ReplayResult

METHODS = [
    dict(method=Method.PLAIN),
    dict(method=Method.CHAIN, draft_tokens=1),
    dict(method=Method.CHAIN, draft_tokens=4),
    dict(method=Method.CHAIN, draft_tokens=7),
    dict(method=Method.RSD_C, branching=(2, 2, 1)),
    dict(method=Method.RSD_S, beam_width=2, depth=3),
    dict(method=Method.MULTI_DRAFT, branching=(2, 2)),
]


class ShapeSensitive(torch.nn.Module):
    """A target whose logits depend slightly on how many tokens a forward scores.

    Real bf16 kernels do this (a 5-token forward differs from five 1-token forwards by up to
    0.06 on the default pair); the tiny models' small GEMMs happen to be exact, so the effect
    is injected here: the same perturbation for every row of a forward of M tokens.
    """

    def __init__(self, model, scale: float = 0.8):
        super().__init__()
        self.inner, self.scale = model, scale
        self.config, self.generation_config = model.config, model.generation_config

    def forward(self, input_ids, **kwargs):
        out = self.inner(input_ids=input_ids, **kwargs)
        noise = torch.randn(out.logits.shape[-1], generator=torch.Generator().manual_seed(input_ids.shape[1]))
        out.logits = out.logits + self.scale * noise.to(out.logits.dtype)
        return out


@pytest.fixture(scope="module")
def bf16_pair(tiny_dirs):
    """bf16 tiny models, the target made shape-sensitive."""
    from specgen.models.load import load_pair

    target, draft = load_pair(
        str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cpu", dtype="bfloat16", quiet=True
    )
    return replace(target, model=ShapeSensitive(target.model)), draft


def generate(pair, prompt, **settings):
    target, draft = pair
    config = GenerationConfig(**settings)
    events, state = decode(engine_with(pair, config), prompt, config)
    return state.ids[len(prompt) :], events


@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(), SamplingConfig(temperature=0.9, top_p=0.95, seed=11)],
    ids=["greedy", "sampling"],
)
@pytest.mark.parametrize("window", [8, pytest.param(32, marks=pytest.mark.slow)])  # 32: 14 s each (-m slow)
def test_every_method_and_draft_length_gives_the_same_tokens(bf16_pair, sampling, window):
    outputs = {}
    for settings in METHODS:
        ids, events = generate(
            bf16_pair,
            PROMPT,
            max_new_tokens=40,
            sampling=sampling,
            deterministic=True,
            verify_window=window,
            **settings,
        )
        assert len(ids) == 40
        assert isinstance(events[-1], ReplayResult) and events[-1].stop == StopReason.LENGTH
        outputs[f"{settings}"] = ids
    assert len({tuple(v) for v in outputs.values()}) == 1, outputs


def test_without_deterministic_mode_the_outputs_differ(bf16_pair):
    """The power check: the same settings without replay do depend on method and draft length."""
    outputs = {tuple(generate(bf16_pair, PROMPT, max_new_tokens=40, **settings)[0]) for settings in METHODS}
    assert len(outputs) > 1


def test_replays_count_windows_and_rollbacks(bf16_pair):
    ids, events = generate(
        bf16_pair,
        PROMPT,
        max_new_tokens=40,
        deterministic=True,
        verify_window=8,
        method=Method.CHAIN,
        draft_tokens=4,
    )
    replays = [e for e in events if isinstance(e, ReplayResult)]
    assert len(replays) >= 5  # 40 tokens in windows of 8
    assert all(r.checked >= 1 for r in replays)
    assert any(r.rolled_back for r in replays)  # the shape-sensitive target forces rollbacks
    for r in replays:
        assert (r.correction is None) == (not r.rolled_back)


def test_deterministic_greedy_in_fp32_equals_plain_greedy(tiny_pair):
    plain, _ = generate(tiny_pair, PROMPT, max_new_tokens=30, method=Method.PLAIN)
    chain, _ = generate(
        tiny_pair, PROMPT, max_new_tokens=30, method=Method.CHAIN, deterministic=True, verify_window=16
    )
    assert chain == plain


def test_eos_is_only_final_once_verified(bf16_pair):
    target, _ = bf16_pair
    first, _ = generate(
        bf16_pair, PROMPT, max_new_tokens=30, deterministic=True, verify_window=8, method=Method.PLAIN
    )  # the window size is part of what defines the output
    stop_token = first[12]
    ids_by_method = []
    for settings in METHODS[:5]:
        config = GenerationConfig(max_new_tokens=30, deterministic=True, verify_window=8, **settings)
        events, state = decode(
            engine_with(bf16_pair, config, stop_ids=frozenset({stop_token})), PROMPT, config
        )
        assert events[-1].stop == StopReason.EOS
        ids_by_method.append(state.ids[len(PROMPT) :])
    assert all(ids == ids_by_method[0] for ids in ids_by_method)
    assert ids_by_method[0][-1] == stop_token


def test_prompts_differ_only_by_their_own_content(bf16_pair):
    """A prompt's tokens do not depend on what was generated before in another sequence."""
    a, _ = generate(bf16_pair, PROMPT, max_new_tokens=20, deterministic=True, method=Method.CHAIN)
    generate(bf16_pair, PROMPT[::-1], max_new_tokens=20, deterministic=True, method=Method.CHAIN)
    b, _ = generate(bf16_pair, PROMPT, max_new_tokens=20, deterministic=True, method=Method.RSD_C)
    assert a == b


def test_chat_and_bench_accept_deterministic_mode(tiny_dirs, tmp_path):
    """chat: the same replies whatever the method; bench: runs and reports every method identical."""
    import json

    from typer.testing import CliRunner

    from specgen.cli import app

    runner = CliRunner()
    models = [
        "--target",
        str(tiny_dirs["target"]),
        "--draft",
        str(tiny_dirs["draft"]),
        "--dtype",
        "bfloat16",
        "--device",
        "cpu",
        "-n",
        "10",
        "--deterministic",
        "--verify-window",
        "4",
    ]
    replies = []
    for method in ("plain", "chain", "rsd-c"):
        result = runner.invoke(
            app, ["chat", *models, "--method", method, "--format", "json"], input="hello\nagain\n"
        )
        assert result.exit_code == 0, result.output
        records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
        replies.append([r["token_ids"] for r in records if "token_ids" in r])
        assert all(r["stats"]["verified_windows"] >= 3 for r in records if "stats" in r)
    assert replies[0] == replies[1] == replies[2] and len(replies[0]) == 2
    out = tmp_path / "bench.json"
    result = runner.invoke(
        app,
        [
            "bench",
            *models,
            "--methods",
            "chain,rsd-c",
            "--prompts",
            "quick",
            "--limit",
            "1",
            "--no-warmup",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["prompts"] and all(
        p["identical_to_plain"] for p in data["prompts"] if p["method"] != "plain"
    ), data["prompts"]
