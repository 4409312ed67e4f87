"""`specgen run --prompts-file F --output OUT.jsonl` in one process (no Ray): every prompt once
with its id, written as it finishes; a rerun writes only the missing ones; a torn last line is
repaired; duplicate ids refused before loading; Ctrl-C keeps every finished prompt."""

from __future__ import annotations

import json
import os
import sys

import pytest
from tiny import stop_after_rows
from typer.testing import CliRunner

from specgen.cli import app
from specgen.scale.results import ResultsFile

runner = CliRunner()
PROMPTS = 'hello there\n{"prompt": "second one", "id": "b"}\n\nthird\nand a fourth, longer prompt\nfifth\n'
IDS = [1, "b", 4, 5, 6]  # line numbers, or the "id" field


def invoke(*args):
    return runner.invoke(app, list(args))


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return [
        "--target",
        str(tiny_dirs["target"]),
        "--draft",
        str(tiny_dirs["draft"]),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "-n",
        "6",
    ]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text(PROMPTS)
    return path


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory):
    """What the plain batched run (stdout, input order) gives for each prompt."""
    path = tmp_path_factory.mktemp("ref") / "prompts.txt"
    path.write_text(PROMPTS)
    result = invoke("run", "--prompts-file", str(path), *models, "--format", "json")
    assert result.exit_code == 0, result.output
    return {
        ident: json.loads(line)["token_ids"] for ident, line in zip(IDS, result.stdout.strip().splitlines())
    }


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_one_line_error(result, *fragments):
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    lines = [
        line
        for line in result.output.strip().splitlines()
        if line.strip() and not line.startswith("loading ")
    ]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_output_writes_every_prompt_once_with_its_id(models, prompts, tmp_path, reference):
    out = tmp_path / "out.jsonl"
    result = invoke("run", "--prompts-file", str(prompts), "--output", str(out), "--batch-size", "2", *models)
    assert result.exit_code == 0, result.output
    assert result.stdout == ""  # results go to the file; progress and the summary to stderr
    records = read(out)
    assert sorted(map(str, (r["id"] for r in records))) == sorted(map(str, IDS))
    assert {r["id"]: r["token_ids"] for r in records} == reference
    assert {"id", "text", "token_ids", "method", "stats"} <= set(records[0])
    assert "5/5 prompts" in result.stderr and "tok/s" in result.stderr
    assert "5 prompts written" in result.stderr


def test_a_rerun_writes_only_the_missing_prompts_and_repairs_a_torn_line(
    models, prompts, tmp_path, reference
):
    out = tmp_path / "out.jsonl"
    full = tmp_path / "full.jsonl"
    assert invoke("run", "--prompts-file", str(prompts), "--output", str(full), *models).exit_code == 0
    lines = full.read_bytes().splitlines(keepends=True)
    out.write_bytes(lines[0] + lines[1] + lines[2][:25])  # two whole lines, then a crash mid-line
    result = invoke("run", "--prompts-file", str(prompts), "--output", str(out), "--batch-size", "2", *models)
    assert result.exit_code == 0, result.output
    assert "dropped a torn last line (25 bytes)" in result.stderr
    assert "2 of 5 prompts already" in result.stderr and "3 prompts written" in result.stderr
    data = out.read_bytes()
    assert data.startswith(lines[0] + lines[1])  # the finished lines are kept as they were
    records = read(out)
    assert len(records) == 5 and {r["id"]: r["token_ids"] for r in records} == reference
    # once complete, a rerun loads nothing at all (a model that does not exist is never touched)
    again = invoke("run", "--prompts-file", str(prompts), "--output", str(out), "--target", "/nonexistent")
    assert again.exit_code == 0, again.output
    assert "all 5 prompts are already in" in again.stderr
    assert out.read_bytes() == data
    # a prompt inserted at the top renumbers the lines: their results answer other prompts now
    edited = tmp_path / "edited.txt"
    edited.write_text("gamma\n" + prompts.read_text())
    moved = invoke("run", "--prompts-file", str(edited), "--output", str(out), "--target", "/nonexistent")
    assert moved.exit_code == 1 and "result for id 1 made from another prompt than line 1" in moved.stderr, (
        moved.output
    )
    assert out.read_bytes() == data


def test_duplicate_ids_are_one_line_before_loading(prompts, tmp_path):
    prompts.write_text('{"prompt": "a", "id": "x"}\nplain\n{"prompt": "c", "id": "x"}\n')
    result = invoke(
        "run",
        "--prompts-file",
        str(prompts),
        "--output",
        str(tmp_path / "o.jsonl"),
        "--target",
        str(tmp_path / "no-model"),
    )
    assert_one_line_error(result, "prompts.txt:3", 'id "x"', "line 1")
    assert not (tmp_path / "o.jsonl").exists()
    prompts.write_text('first\n{"prompt": "b", "id": 1}\n')  # a line number is an id too
    result = invoke("run", "--prompts-file", str(prompts), "--output", str(tmp_path / "o.jsonl"))
    assert_one_line_error(result, "prompts.txt:2", "id 1")
    prompts.write_text('{"prompt": "b", "id": [1]}\n')
    result = invoke("run", "--prompts-file", str(prompts), "--output", str(tmp_path / "o.jsonl"))
    assert_one_line_error(result, "'id' must be a string or an integer")


def test_ctrl_c_keeps_every_finished_prompt_and_the_rerun_finishes(
    models, prompts, tmp_path, monkeypatch, reference
):
    out = tmp_path / "out.jsonl"
    args = ["run", "--prompts-file", str(prompts), "--output", str(out), "--batch-size", "2", *models]
    with monkeypatch.context() as patch:
        stop_after_rows(patch, 2)
        result = invoke(*args)
    assert result.exit_code == 130, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted: 2 prompts written to") and "(2 of 5 there)" in last
    records = read(out)  # every line whole JSON
    assert len(records) == 2 and all(r["token_ids"] == reference[r["id"]] for r in records)
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "3 prompts written" in result.stderr
    records = read(out)
    assert len(records) == 5 and {r["id"]: r["token_ids"] for r in records} == reference


def test_each_line_is_one_write_and_a_garbled_middle_line_is_refused(tmp_path, monkeypatch, prompts):
    out = tmp_path / "out.jsonl"
    writes = []
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append(bytes(data)) or real_write(fd, data))
    with ResultsFile.open(out) as results:
        results.write({"id": 1, "text": "é", "token_ids": [1], "method": "plain", "stats": {}})
        results.write({"id": "b", "text": "x\ny", "token_ids": [2], "method": "plain", "stats": {}})
    assert len(writes) == 2 and all(w.endswith(b"\n") and w.count(b"\n") == 1 for w in writes)
    monkeypatch.undo()
    with ResultsFile.open(out) as results:
        assert set(results.done) == {1, "b"} and results.dropped == 0
    out.write_bytes(out.read_bytes() + b"{not json\n" + b'{"id": 3, "text": ""}\n')
    result = invoke("run", "--prompts-file", str(prompts), "--output", str(out), "--target", "/nonexistent")
    assert_one_line_error(result, "out.jsonl:3", "not a specgen result line")


def test_a_second_run_on_the_same_file_is_refused(prompts, tmp_path):
    out = tmp_path / "out.jsonl"
    with ResultsFile.open(out):
        result = invoke(
            "run", "--prompts-file", str(prompts), "--output", str(out), "--target", "/nonexistent"
        )
    assert_one_line_error(result, "being written by another specgen run")


def test_the_lock_is_on_the_file_itself_whatever_the_cache(prompts, tmp_path, monkeypatch):
    """Two runs with different caches (users, containers) on one file: the second is refused."""
    out = tmp_path / "out.jsonl"
    with ResultsFile.open(out):
        monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "another-cache"))
        result = invoke(
            "run", "--prompts-file", str(prompts), "--output", str(out), "--target", "/nonexistent"
        )
    assert_one_line_error(result, "being written by another specgen run")
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("not a directory")
    with ResultsFile.open(out) as results:  # an unusable cache does not stop --output
        assert results.done == {}


@pytest.mark.parametrize(
    "content",
    [
        b"my precious single line\n",
        b'{"important": "config"}',
        b'{"important": "config"}\n',
        b"first prompt\nsecond prompt\n",
    ],
)
def test_a_file_that_holds_no_results_is_refused_and_left_as_it_was(prompts, tmp_path, content):
    """Only a results file's own torn last line is ever cut."""
    out = tmp_path / "notes.txt"
    out.write_bytes(content)
    result = invoke("run", "--prompts-file", str(prompts), "--output", str(out), "--target", "/nonexistent")
    assert_one_line_error(result, "not a specgen result")
    assert out.read_bytes() == content
    # the prompts file itself as the output
    result = invoke(
        "run", "--prompts-file", str(prompts), "--output", str(prompts), "--target", "/nonexistent"
    )
    assert_one_line_error(result, "not a specgen result")


def test_a_device_as_the_output(models, prompts):
    """/dev/null takes the results (fsync of a device fails with EINVAL: there is nothing to sync)."""
    result = invoke("run", "--prompts-file", str(prompts), "--output", "/dev/null", *models)
    assert result.exit_code == 0, result.output
    assert "5 prompts written" in result.stderr


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["hi", "--output", "o.jsonl"], "--output writes the results of --prompts-file"),
        (["--prompts-file", "p.txt", "--ray", "auto"], "--ray writes its results to a file"),
        (["--prompts-file", "p.txt", "--output", "o.jsonl", "--ray-actors", "2"], "go with --ray"),
        (
            ["--prompts-file", "p.txt", "--output", "o.jsonl", "--ray", "auto", "--ray-threads", "0"],
            "--ray-threads",
        ),
    ],
)
def test_output_and_ray_options_are_checked_first(args, fragment):
    assert_one_line_error(invoke("run", *args, "--target", "/nonexistent"), fragment)


def test_a_run_that_fails_before_its_first_result_leaves_no_file_it_made(prompts, tmp_path):
    out = tmp_path / "new.jsonl"
    result = invoke("run", "--prompts-file", str(prompts), "--output", str(out), "--target", "/nonexistent")
    assert result.exit_code == 1 and not out.exists(), result.output
    mine = tmp_path / "mine.jsonl"
    mine.write_text("")  # the user's own (empty) file stays
    result = invoke("run", "--prompts-file", str(prompts), "--output", str(mine), "--target", "/nonexistent")
    assert result.exit_code == 1 and mine.exists()


def test_ray_missing_gives_the_install_hint(prompts, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    result = invoke(
        "run",
        "--prompts-file",
        str(prompts),
        "--output",
        str(tmp_path / "o.jsonl"),
        "--ray",
        "auto",
        "--target",
        "/nonexistent",
    )
    assert_one_line_error(result, "--ray needs Ray", "pip install 'specgen[ray]'")
    assert not (tmp_path / "o.jsonl").exists()
