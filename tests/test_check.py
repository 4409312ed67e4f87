"""`specgen check`: the self-test a user runs on their own pair, through the command line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specgen.cli import app

runner = CliRunner()


def options(tiny_dirs) -> list[str]:
    return [
        "--target",
        str(tiny_dirs["target"]),
        "--draft",
        str(tiny_dirs["draft"]),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "-n",
        "8",
        "--prompts",
        "2",
    ]


def test_check_prints_each_case_identical_and_exits_0(tiny_dirs):
    result = runner.invoke(app, ["check", *options(tiny_dirs)])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    labels = [line.split(None, 1)[1] for line in lines]
    for label in (
        "plain ",
        "plain, batched",
        "plain, cached",
        "plain, chunked",
        "plain, chat turn",
        "lookup ",
        "suffix ",
        "suffix, batched",
        "chain ",
        "chain, batched",
        "lookup-chain",
        "rsd-c",
        "rsd-s",
        "multi-draft",
        "chain, deterministic",
        "chain, mixed batch",
    ):
        assert any(label.strip() == other.split("  ")[0].strip() for other in labels), label
    assert all(line.startswith("ok") and "identical on 2 of 2 prompts" in line for line in lines)
    assert "all 16 cases are identical to transformers' generate" in result.stderr


def test_check_json_and_a_method_subset(tiny_dirs):
    result = runner.invoke(app, ["check", *options(tiny_dirs), "--methods", "plain,chain", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert {c["case"] for c in report["cases"]} == {
        "plain",
        "plain, batched",
        "plain, cached",
        "plain, chunked",
        "plain, chat turn",
        "chain",
        "chain, batched",
        "chain, deterministic",
        "plain, mixed batch",
    }
    assert all(c["identical"] and c["mismatches"] == [] for c in report["cases"])
    assert len(report["prompt_tokens"]) == 2 and report["max_new_tokens"] == 8


def test_a_difference_is_reported_with_its_position_and_exit_1(tiny_dirs, monkeypatch):
    """A reference that disagrees at token 3 (as a broken path would): each case says where, and
    the command fails."""
    from specgen.bench import check as machinery

    real = machinery.reference

    def shifted(pair, prompt, new_tokens):
        ids = real(pair, prompt, new_tokens)
        return ids[:3] + [(ids[3] + 1) % 256] + ids[4:]

    monkeypatch.setattr(machinery, "reference", shifted)
    result = runner.invoke(app, ["check", *options(tiny_dirs), "--methods", "plain"])
    assert result.exit_code == 1
    # the line counts from 1 (the 4th new token of the 1st prompt), the JSON's indexes from 0
    assert (
        "FAIL plain" in result.stdout
        and "prompt 1, new token 4:" in result.stdout
        and "logits" in result.stdout
    )
    assert "cases differ from transformers' generate" in result.stderr
    result = runner.invoke(app, ["check", *options(tiny_dirs), "--methods", "plain", "--json"])
    assert result.exit_code == 1
    first = json.loads(result.stdout)["cases"][0]["mismatches"][0]
    assert (first["prompt"], first["position"]) == (0, 3)


def test_a_mixed_batch_names_the_row_that_differs(tiny_dirs):
    """The mixed batch's rows take the methods and the prompts in turn, every prompt at least
    once; a prompt whose row differs is reported with that row's method."""
    from dataclasses import replace

    from specgen.bench import check as machinery
    from specgen.config import GenerationConfig, Method, ModelSettings
    from specgen.decoding.build import build_engine
    from specgen.runtime.pair import load

    settings = ModelSettings(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), "cpu", None, "float32")
    pair = load(settings, Method.CHAIN, quiet=True)
    cases = [
        machinery.Case(Method.CHAIN, machinery.Path.MIXED),
        machinery.Case(Method.PLAIN),
        machinery.Case(Method.LOOKUP),
        machinery.Case(Method.CHAIN, deterministic=True),
    ]
    methods = machinery.mixed_methods(cases)
    assert methods == [Method.CHAIN, Method.PLAIN, Method.LOOKUP]  # the case's own first
    prompts = machinery.check_prompts(pair, 2, 6)
    expected = [machinery.reference(pair, p, 6) for p in prompts]
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=6, draft_tokens=4)
    assert machinery._mixed(pair, config, methods, prompts, expected, build_engine) == ()
    # rows: prompt 1 chain, prompt 2 plain, prompt 1 lookup: prompt 2's reference, shifted at
    # its third token, is met by plain's row
    wrong = [expected[0], expected[1][:2] + [(expected[1][2] + 1) % 256] + expected[1][3:]]
    found = machinery._mixed(pair, config, methods, prompts, wrong, build_engine)
    assert [(m.prompt, m.position, m.method) for m in found] == [(1, 2, Method.PLAIN)]
    line = machinery.describe(replace(cases[0], mismatches=found), pair, 2)
    assert "differs on 1 of 2 prompts; prompt 2 (plain's row), new token 3:" in line


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompts", "0"], "--prompts must be in 1..16"),
        (["--draft", "none", "--methods", "chain"], "--draft none checks plain, lookup and suffix only"),
        (["--methods", "teleport"], "unknown method 'teleport'"),
        (["--methods", ","], "--methods ',' names no method"),
        (["--draft", "DRAFT", "--methods", "eagle"], "method eagle needs an EAGLE-3 head as the draft"),
    ],
)
def test_bad_options_are_one_line(tiny_dirs, args, message):
    args = [str(tiny_dirs["draft"]) if a == "DRAFT" else a for a in args]
    result = runner.invoke(app, ["check", "--target", str(tiny_dirs["target"]), "--device", "cpu", *args])
    assert result.exit_code == 1 and message in result.stderr and "Traceback" not in result.output


def test_without_a_draft(tiny_dirs):
    result = runner.invoke(
        app,
        [
            "check",
            "--target",
            str(tiny_dirs["target"]),
            "--draft",
            "none",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "-n",
            "6",
            "--prompts",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "all 10 cases are identical" in result.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("user_cache")
def test_the_catalog_pair_passes_check():
    """The default pair on the CPU's default path (int8 target, int8+prune draft): every case
    identical to transformers' generate on the same int8 target."""
    result = runner.invoke(app, ["check", "-n", "24", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["weights"] == "int8" and all(c["identical"] for c in report["cases"])
