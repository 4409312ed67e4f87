"""The wheel works outside the checkout: built, installed (not editable) into a fresh virtual
environment, and run from another directory, `specgen bench --prompts quick` finds the prompt
sets that ship inside the package.

The default run installs the wheel alone and lends the fresh environment this one's
dependencies (a plain path in a .pth file: this environment's own .pth files, among them an
editable install's finder, are not read), so what it proves is the wheel's own contents; the
`slow` test installs the wheel with its dependencies from the index, as a user would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy of the checkout's tracked and new files."""
    source = tmp_path_factory.mktemp("source")
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for name in files:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return next(out.glob("specgen-*.whl"))


def fresh_env(root: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(root)
    return root / "bin" / "python"


def bench_quick(python: Path, tiny_dirs, cwd: Path, extra_env=None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(extra_env or {})}
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [
            str(python.parent / "specgen"),
            "bench",
            "--prompts",
            "quick",
            "--limit",
            "1",
            "--methods",
            "plain,chain",
            "-n",
            "4",
            "--no-warmup",
            "--target",
            str(tiny_dirs["target"]),
            "--draft",
            str(tiny_dirs["draft"]),
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--threads",
            "1",
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_wheel_carries_the_prompt_sets_and_bench_finds_them(wheel, tiny_dirs, tmp_path):
    python = fresh_env(tmp_path / "env")
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "lent-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = subprocess.run(
        [str(python), "-c", "import specgen; print(specgen.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert where.startswith(site), where  # the installed wheel, not the checkout
    assert (Path(site) / "specgen" / "prompts" / "quick.jsonl").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = bench_quick(python, tiny_dirs, elsewhere)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "chain" in result.stdout and "plain" in result.stdout


@pytest.mark.slow
def test_the_wheel_installs_with_its_dependencies_and_runs_bench(wheel, tiny_dirs, tmp_path):
    python = fresh_env(tmp_path / "env")
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "torch==2.13.0", str(wheel)],
        check=True,
        capture_output=True,
        timeout=1800,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = bench_quick(python, tiny_dirs, elsewhere)
    assert result.returncode == 0, result.stderr[-2000:]
