"""No load path runs Python code that comes with a model (`auto_map` in its configs).

A model directory whose config names an unknown model type and maps the Auto classes to a
local `evil.py` would make transformers ask "run the custom code? [y/N]" on stdin; in a
scripted `specgen chat` the first input line answered it. Every load passes
trust_remote_code=False, so such a model is refused in one line and the code never runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tiny import save_tiny
from typer.testing import CliRunner

from specgen.cli import app
from specgen.errors import ModelError

EVIL_CODE = """
import pathlib
pathlib.Path(__file__).with_name("RAN").write_text("the model's own code ran")
from transformers import Qwen2Config as EvilConfig, Qwen2ForCausalLM as EvilModel
from transformers import PreTrainedTokenizerFast as EvilTokenizer
"""


def _evil(directory: Path, known_type: bool = False) -> Path:
    """A tiny model whose config and tokenizer config map the Auto classes to local code."""
    save_tiny(directory, seed=1)
    config = json.loads((directory / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    if not known_type:
        config["model_type"] = "evil_model"
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    tokenizer["tokenizer_class"] = "EvilTokenizer"
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    (directory / "evil.py").write_text(EVIL_CODE)
    return directory


@pytest.fixture(scope="module")
def evil(tmp_path_factory) -> Path:
    return _evil(tmp_path_factory.mktemp("evil") / "EVIL")


@pytest.fixture(autouse=True)
def no_prompt(monkeypatch):
    """transformers asks on stdin before it runs remote code: any question fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("something asked on stdin whether to run a model's code")

    monkeypatch.setattr("builtins.input", refuse)


def _ran(directory: Path) -> bool:
    return (directory / "RAN").exists()


@pytest.mark.parametrize("role", ["target", "draft"])
def test_scripted_chat_cannot_answer_a_custom_code_prompt(evil, tiny_dirs, role):
    models = {"target": str(tiny_dirs["target"]), "draft": str(tiny_dirs["draft"]), role: str(evil)}
    result = CliRunner().invoke(
        app,
        ["chat", "--target", models["target"], "--draft", models["draft"], "--dtype", "float32", "-n", "4"],
        input="y\ny\nhello\n",
    )
    assert result.exit_code == 1
    assert not _ran(evil)
    assert "never runs code that comes with a model" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", [["run", "hi", "--no-server"], ["bench", "--limit", "1", "-n", "2"]])
def test_run_and_bench_refuse_custom_code(evil, tiny_dirs, command):
    result = CliRunner().invoke(
        app,
        [*command, "--target", str(evil), "--draft", str(tiny_dirs["draft"]), "--dtype", "float32"],
        input="y\n",
    )
    assert result.exit_code == 1
    assert not _ran(evil)
    assert "never runs code that comes with a model" in result.output


def test_every_load_function_refuses_custom_code(evil, tiny_dirs):
    from specgen.models import load as models
    from specgen.models import plan

    with pytest.raises(ModelError, match="never runs code"):
        models.load_pair(str(evil), None, device="cpu", dtype="float32", quiet=True)
    target, _ = models.load_pair(str(tiny_dirs["target"]), None, device="cpu", dtype="float32", quiet=True)
    with pytest.raises(ModelError, match="never runs code"):
        models.load_draft(str(evil), target, device="cpu", dtype="float32", quiet=True)
    with pytest.raises(ModelError, match="never runs code"):  # the multi-GPU device map reads the config
        plan._split_map(str(evil), target.dtype, [0, 1], {0: 1 << 30, 1: 1 << 30}, quiet=True)
    assert not _ran(evil)


def test_a_known_architecture_loads_natively_and_ignores_the_auto_map(tmp_path, tiny_dirs):
    """A qwen2 model with an auto_map loads with transformers' own classes; evil.py never runs."""
    from specgen.models import load as models

    directory = _evil(tmp_path / "mapped", known_type=True)
    target, _ = models.load_pair(str(directory), None, device="cpu", dtype="float32", quiet=True)
    assert type(target.model).__module__.startswith("transformers.models.qwen2")
    assert not _ran(directory)
    shutil.rmtree(directory)
