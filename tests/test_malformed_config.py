"""A malformed model or head directory is one line naming the file and, where known, the field,
through run, bench, train-head and serve alike: JSON nested 100,000 deep, a string where a number
belongs, heads that are 0 or do not divide the hidden size, an unknown rope type, a vocabulary
larger than memory, a config that does not match its weights (models/model_files.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import save_tiny
from typer.testing import CliRunner

from specgen.cli import app
from specgen.models.eagle_format import save_head
from specgen.models.eagle_head import Eagle3Head, HeadConfig, default_layers

runner = CliRunner()
DEEP = "[" * 100_000 + "]" * 100_000
COMMON = ["--dtype", "float32", "--device", "cpu"]


def assert_one_line_error(result, *fragments):
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and "unexpected" not in result.output, result.output
    lines = [
        line
        for line in result.output.strip().splitlines()
        if line.strip() and not line.startswith("loading ")
    ]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def edited(source: Path, root: Path, name: str, file: str, edit) -> Path:
    """A copy of model directory `source` whose `file` is rewritten by `edit` (the parsed JSON
    changed in place, or the file's new text returned)."""
    directory = root / name
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(source, directory)
    path = directory / file
    value = json.loads(path.read_text())
    text = edit(value)
    path.write_text(text if isinstance(text, str) else json.dumps(value))
    return directory


def setter(**fields):
    return lambda config: config.update(fields)


# (name, file, edit, what the line names)
MODEL_CASES = [
    ("deep-config", "config.json", lambda c: DEEP, ["config.json", "nested too deeply"]),
    (
        "deep-generation",
        "generation_config.json",
        lambda c: DEEP,
        ["generation_config.json", "nested too deeply"],
    ),
    (
        "deep-tokenizer-config",
        "tokenizer_config.json",
        lambda c: DEEP,
        ["tokenizer_config.json", "nested too deeply"],
    ),
    ("deep-tokenizer", "tokenizer.json", lambda c: DEEP, ["tokenizer.json", "nested too deeply"]),
    ("string-size", "config.json", setter(hidden_size="64"), ["config.json", "hidden_size", '"64"']),
    ("string-layers", "config.json", setter(num_hidden_layers="two"), ["config.json", "num_hidden_layers"]),
    ("list-heads", "config.json", setter(num_attention_heads=[4]), ["config.json", "num_attention_heads"]),
    ("string-eps", "config.json", setter(rms_norm_eps="tiny"), ["config.json", "rms_norm_eps"]),
    ("zero-heads", "config.json", setter(num_attention_heads=0), ["config.json", "num_attention_heads is 0"]),
    (
        "zero-kv-heads",
        "config.json",
        setter(num_key_value_heads=0),
        ["config.json", "num_key_value_heads is 0"],
    ),
    (
        "heads-not-dividing",
        "config.json",
        setter(num_attention_heads=3),
        ["config.json", "hidden_size 64 is not a multiple of num_attention_heads 3"],
    ),
    ("kv-not-dividing", "config.json", setter(num_key_value_heads=3), ["num_key_value_heads 3"]),
    (
        "unknown-rope",
        "config.json",
        setter(rope_scaling={"rope_type": "bogus", "factor": 2.0}),
        ["config.json", "rope_scaling", '"bogus"'],
    ),
    (
        "unknown-rope-parameters",
        "config.json",
        setter(rope_parameters={"rope_type": "bogus", "rope_theta": 1e4}),
        ["config.json", "rope_parameters", '"bogus"'],
    ),
    ("string-rope", "config.json", setter(rope_scaling="linear"), ["config.json", "rope_scaling"]),
    ("huge-vocabulary", "config.json", setter(vocab_size=10**13), ["config.json", "vocab_size", "memory"]),
    (
        "string-eos",
        "generation_config.json",
        setter(eos_token_id="x"),
        ["generation_config.json", "eos_token_id"],
    ),
    ("pad-outside", "config.json", setter(pad_token_id=10_000), ["config.json", "pad_token_id 10000"]),
    (
        "weights-differ",
        "config.json",
        setter(intermediate_size=96),
        ["config.json does not match model.safetensors", "mlp"],
    ),
    ("null", "config.json", lambda c: "null", ["config.json holds null"]),
]


@pytest.fixture(scope="module")
def broken(tiny_dirs, tmp_path_factory):
    """Every case's directory, made once from the tiny target (and its draft)."""
    root = tmp_path_factory.mktemp("broken")
    return {name: edited(tiny_dirs["target"], root, name, file, edit) for name, file, edit, _ in MODEL_CASES}


@pytest.mark.parametrize("name,file,edit,fragments", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_a_malformed_target_is_one_line_naming_the_file_and_field(
    broken, tiny_dirs, name, file, edit, fragments
):
    result = runner.invoke(
        app,
        [
            "run",
            "hi",
            "--target",
            str(broken[name]),
            "--draft",
            str(tiny_dirs["draft"]),
            "-n",
            "2",
            "--format",
            "plain",
            *COMMON,
        ],
    )
    assert_one_line_error(result, "target", *fragments)


@pytest.mark.parametrize("name", ["deep-config", "zero-heads", "huge-vocabulary", "unknown-rope"])
def test_a_malformed_draft_is_one_line_naming_it(broken, tiny_dirs, name):
    result = runner.invoke(
        app,
        [
            "run",
            "hi",
            "--target",
            str(tiny_dirs["target"]),
            "--draft",
            str(broken[name]),
            "-n",
            "2",
            "--format",
            "plain",
            *COMMON,
        ],
    )
    fragments = next(c[3] for c in MODEL_CASES if c[0] == name)
    assert_one_line_error(result, "draft", *fragments)


@pytest.mark.parametrize("name", ["deep-config", "zero-heads"])
def test_bench_and_train_head_say_the_same_line(broken, tiny_dirs, tmp_path, name):
    fragments = next(c[3] for c in MODEL_CASES if c[0] == name)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "chat", "prompt": "hello"}) + "\n")
    bench = runner.invoke(
        app,
        [
            "bench",
            "--target",
            str(broken[name]),
            "--draft",
            str(tiny_dirs["draft"]),
            "--prompts",
            str(prompts),
            "-n",
            "2",
            "--no-warmup",
            "--methods",
            "plain,chain",
            *COMMON,
        ],
    )
    assert_one_line_error(bench, *fragments)
    out = tmp_path / "head"
    train = runner.invoke(
        app,
        [
            "train-head",
            "--out",
            str(out),
            "--target",
            str(broken[name]),
            "--tokens",
            "2000",
            "--quiet",
            *COMMON,
        ],
    )
    assert_one_line_error(train, *fragments)


def test_serve_refuses_to_start_with_the_line(broken, tiny_dirs):
    server = subprocess.run(
        [
            sys.executable,
            "-m",
            "specgen",
            "serve",
            "--target",
            str(broken["zero-heads"]),
            "--draft",
            str(tiny_dirs["draft"]),
            "--port",
            "0",
            "--api-key",
            "k",
            *COMMON,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert server.returncode == 1, server.stderr
    lines = [line for line in server.stderr.splitlines() if line.strip() and not line.startswith("loading ")]
    assert len(lines) == 1 and "config.json" in lines[0] and "num_attention_heads is 0" in lines[0], (
        server.stderr
    )


LAYERS = 6


@pytest.fixture(scope="module")
def head_dirs(tmp_path_factory):
    """A 6-layer tiny target and a random EAGLE-3 head for it (original layout)."""
    root = tmp_path_factory.mktemp("heads")
    target = save_tiny(root / "target", seed=1, layers=LAYERS)
    torch.manual_seed(0)
    head = Eagle3Head(HeadConfig(64, 4, 2, 16, 128, 259, 200, default_layers(LAYERS)))
    save_head(head, root / "head", "original", "tiny", LAYERS)
    return {"target": target, "head": root / "head", "root": root}


HEAD_CASES = [
    ("deep", lambda c: DEEP, ["config.json", "nested too deeply"]),
    ("string-hidden", setter(hidden_size="64"), ["hidden_size", '"64"']),
    ("zero-heads", setter(num_attention_heads=0), ["num_attention_heads is 0"]),
    (
        "heads-not-dividing",
        lambda c: c.update(num_attention_heads=3, num_key_value_heads=3, head_dim=None),
        ["not a multiple of num_attention_heads 3"],
    ),
    ("huge-draft-vocabulary", setter(draft_vocab_size=10**12), ["draft_vocab_size"]),
    ("unknown-rope", setter(rope_scaling={"rope_type": "bogus"}), ["rope_scaling", '"bogus"']),
    ("string-eagle-config", setter(eagle_config="x"), ["eagle_config"]),
    (
        "string-layer-ids",
        setter(eagle_config={"eagle_aux_hidden_state_layer_ids": "1,2,3"}),
        ["eagle_aux_hidden_state_layer_ids"],
    ),
]


@pytest.mark.parametrize("name,edit,fragments", HEAD_CASES, ids=[c[0] for c in HEAD_CASES])
def test_a_malformed_head_is_one_line_naming_the_field(head_dirs, name, edit, fragments):
    head = edited(head_dirs["head"], head_dirs["root"], f"head-{name}", "config.json", edit)
    result = runner.invoke(
        app,
        [
            "run",
            "def f(x):",
            "--target",
            str(head_dirs["target"]),
            "--draft",
            str(head),
            "-n",
            "2",
            "--format",
            "plain",
            *COMMON,
        ],
    )
    assert_one_line_error(result, *fragments)
