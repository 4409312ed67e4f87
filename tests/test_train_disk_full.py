"""`specgen train-head` on a full disk: one line naming the file that did not fit, exit 1, no
temporary left behind, and what was written whole before (the recorded shards, the last complete
checkpoint) kept, so a rerun with space continues from it. torch.save reports a full disk as
RuntimeError("[enforce fail at inline_container.cc] unexpected pos"), safetensors as its own
error: both must read as the disk being full.

The disk is a small tmpfs of the test's own (root only: skipped elsewhere), enlarged with
`mount -o remount,size=...` or freed of a filler file for the rerun."""

from __future__ import annotations

import gc
import json
import os
import subprocess

import pytest
import torch
from tiny import save_tiny
from typer.testing import CliRunner

from specgen.cli.app import app
from specgen.errors import DiskFullError
from specgen.models.eagle_head import default_layers
from specgen.models.load import load_pair
from specgen.train import data

LAYERS = 4
SEQUENCES, LENGTH = 6, 200  # ~80 KB of features each (3 taps x 64 x fp16 a token)
runner = CliRunner()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("disk-full") / "target", seed=1, layers=LAYERS)


@pytest.fixture
def fixed_data(monkeypatch):
    """The training sequences: random tokens of a fixed length (their size on disk known, and
    no scan of the installed packages' sources)."""
    from specgen.train import head

    generator = torch.Generator().manual_seed(0)
    sequences = [
        data.Sequence(torch.randint(0, 256, (LENGTH,), generator=generator).tolist(), 0)
        for _ in range(SEQUENCES)
    ]
    monkeypatch.setattr(head, "_sequences", lambda *args: sequences)
    return sequences


@pytest.fixture
def disk(tmp_path):
    """`disk(kib)`: a tmpfs of that size at one directory (mounted, or remounted at the new size)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    where = tmp_path / "disk"
    where.mkdir()
    mounted = []

    def size(kib: int):
        command = (
            ["mount", "-o", f"remount,size={kib}k", str(where)]
            if mounted
            else ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where)]
        )
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"no tmpfs here: {done.stderr.strip()}")
        mounted.append(kib)
        return where

    yield size
    if mounted:
        gc.collect()  # a failed run's trainer, in its traceback's cycle, holds the shards it read (mapped)
        if subprocess.run(["umount", str(where)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(where)], check=False)  # detached now, freed once unused


def train(target, out, *extra):
    return runner.invoke(
        app,
        [
            "train-head",
            "--out",
            str(out),
            "--target",
            str(target),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--tokens",
            "1000",
            "--draft-vocab",
            "100",
            "--quiet",
            *extra,
        ],
    )


def assert_one_line(result, file: str) -> None:
    """Exit 1 and one line on stderr, naming `file` and saying the disk is full; no traceback."""
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and "disk full while writing" in lines[0] and file in lines[0], result.stderr
    assert "No space left on device" in lines[0] and "inline_container" not in result.output
    assert "Traceback" not in result.output and "unexpected" not in result.output, result.output


def temporaries(out):
    return [p.name for p in out.rglob("*.tmp")]  # pathlib's * matches dot files too


def fill(where, leave: int):
    """A file taking all the free space of `where` but `leave` bytes."""
    stat = os.statvfs(where)
    (where / "filler").write_bytes(b"\0" * max(stat.f_bavail * stat.f_frsize - leave, 0))


def test_a_checkpoint_that_does_not_fit_keeps_the_last_and_a_rerun_resumes_from_it(target, fixed_data, disk):
    where = disk(4096)
    out = where / "head"
    first = train(target, out)
    assert first.exit_code == 0, first.output
    kept = (out / "checkpoint.pt").read_bytes()
    trained = json.loads((out / "training.json").read_text())
    fill(where, len(kept) // 2)  # half a checkpoint free: the next one cannot be written whole

    full = train(target, out, "--minutes", "0.005")
    assert_one_line(full, str(out / "checkpoint.pt"))
    assert not temporaries(out)
    assert (out / "checkpoint.pt").read_bytes() == kept  # the last complete checkpoint, untouched
    assert json.loads((out / "training.json").read_text()) == trained  # no head written from the failed run

    (where / "filler").unlink()  # space again: the rerun goes on from the kept checkpoint
    resumed = train(target, out, "--minutes", "0.005")
    assert resumed.exit_code == 0, resumed.output
    again = json.loads((out / "training.json").read_text())
    assert again["steps"] > trained["steps"] and again["tokens_trained"] > trained["tokens_trained"]
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    assert saved["report"]["steps_done"] == again["steps"]
    assert not temporaries(out)


def test_a_shard_that_does_not_fit_is_one_line_and_a_rerun_with_space_records_it(target, fixed_data, disk):
    where = disk(64)  # the manifest fits, the features of 1200 tokens (~480 KB) do not
    out = where / "head"
    full = train(target, out)
    assert_one_line(full, str(out / "data" / "shard-0.safetensors"))
    assert not temporaries(out) and not list((out / "data").glob("shard-*"))
    assert json.loads((out / "data" / "manifest.json").read_text())["sequences"] == 0

    disk(4096)
    done = train(target, out)
    assert done.exit_code == 0, done.output
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["sequences"] == SEQUENCES and manifest["shards"] == 1


def test_recording_stopped_by_a_full_disk_continues_where_it_stopped(target, fixed_data, disk, monkeypatch):
    """A shard a sequence: those written before the disk filled stay as they are, the rerun
    records the rest, and no sequence is recorded twice."""
    monkeypatch.setattr(data, "SHARD_TOKENS", 1)
    where = disk(256)  # a few of the ~80 KB shards fit, not all six
    out = where / "head"
    full = train(target, out)
    assert_one_line(full, f"{out / 'data'}/")  # a shard (or the manifest counting the last one)
    assert not temporaries(out)
    before = {p.name: p.stat().st_mtime_ns for p in (out / "data").glob("shard-*.safetensors")}
    assert 1 <= len(before) < SEQUENCES

    disk(4096)
    done = train(target, out)
    assert done.exit_code == 0, done.output
    shards = data.Shards(out)
    assert {p.name: p.stat().st_mtime_ns for p in shards.files()[: len(before)]} == before
    assert [ids.tolist() for ids, *_ in shards.sequences()] == [s.ids for s in fixed_data]


def test_a_shard_the_manifest_does_not_count_is_recorded_again_not_twice(tmp_path, monkeypatch):
    """The disk filled (or a kill came) between a shard's write and the manifest's: the rerun
    removes that shard and records its sequences again (no tmpfs needed)."""
    model = load_pair(
        str(save_tiny(tmp_path / "target", seed=1, layers=LAYERS)),
        None,
        device="cpu",
        dtype="float32",
        quiet=True,
    )[0]
    torch.manual_seed(0)
    sequences = [data.Sequence(torch.randint(0, 256, (20,)).tolist(), 0) for _ in range(4)]
    shards = data.Shards(tmp_path / "head")
    shards.write_manifest({"sequences": 0, "shards": 0})
    real, writes = data.Shards.write_manifest, []

    def manifest_on_a_full_disk(self, manifest):
        writes.append(manifest["sequences"])
        if len(writes) == 2:
            raise DiskFullError(f"disk full while writing {self.dir / 'manifest.json'}; free some space")
        real(self, manifest)

    monkeypatch.setattr(data.Shards, "write_manifest", manifest_on_a_full_disk)
    with pytest.raises(DiskFullError):
        data.record(model.model, default_layers(LAYERS), sequences, shards, model.device, shard_tokens=1)
    assert len(shards.files()) == 2 and shards.manifest()["sequences"] == 1  # the second shard is not counted
    monkeypatch.undo()
    data.record(model.model, default_layers(LAYERS), sequences, shards, model.device, shard_tokens=1)
    assert [ids.tolist() for ids, *_ in shards.sequences()] == [s.ids for s in sequences]
    assert shards.manifest() == {"sequences": 4, "shards": 4}
