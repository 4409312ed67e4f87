"""Threads that fit the machine (runtime/threads.py): one torch thread per core that other
processes leave free, looked at again while decoding; `--threads N` and SPECGEN_THREADS fix it;
a bad count is one line; the count in use is in the JSON and in /metrics."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from specgen.cli import app
from specgen.errors import ConfigError
from specgen.runtime import threads

runner = CliRunner()


@pytest.fixture
def restore():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class Machine:
    """/proc/stat and /proc/self/stat as a test drives them: ticks per core go by, other
    processes use `others` cores' worth of them and this process `own`."""

    def __init__(self, monkeypatch, cpus: int = 2):
        self.cpus, self.busy, self.total, self.own = cpus, 0, 0, 0
        monkeypatch.setattr(threads, "_affinity", lambda: list(range(cpus)))
        monkeypatch.setattr(threads, "_cpu_ticks", lambda wanted: (self.busy, self.total))
        monkeypatch.setattr(threads, "_own_ticks", lambda: self.own)
        monkeypatch.setattr(threads, "_STARTED", (None, None, 0.0))
        monkeypatch.setattr(threads, "PERIOD", 0.0)

    def run(self, others: float, own: float, ticks: int = 100) -> None:
        self.total += ticks * self.cpus
        self.busy += int((others + own) * ticks)
        self.own += int(own * ticks)


def test_a_busy_core_leaves_one_thread_and_a_freed_one_two(monkeypatch, restore):
    machine = Machine(monkeypatch)
    fit = threads.Threads(fixed=None)
    monkeypatch.delenv("SPECGEN_THREADS", raising=False)
    fit.fixed = None
    machine.run(others=1.0, own=0.2)  # another process holds a core while the models load
    assert fit.start() == 1 and torch.get_num_threads() == 1
    machine.run(others=1.0, own=1.0)
    fit.tick()
    assert fit.count == 1
    machine.run(others=0.0, own=1.0)  # it ended: both cores again
    fit.tick()
    assert fit.count == 2 and torch.get_num_threads() == 2
    machine.run(others=0.3, own=2.0)  # a little load: still free
    fit.tick()
    assert fit.count == 2


def test_too_short_a_look_keeps_the_count_until_a_longer_one(monkeypatch, restore):
    machine = Machine(monkeypatch)
    monkeypatch.delenv("SPECGEN_THREADS", raising=False)
    fit = threads.Threads()
    machine.run(others=1.0, own=0.0, ticks=3)
    assert fit.start() == 2  # 3 ticks say nothing yet
    machine.run(others=1.0, own=1.0, ticks=50)
    fit.tick()
    assert fit.count == 1


def test_a_fixed_count_is_kept(monkeypatch, restore):
    machine = Machine(monkeypatch)
    fit = threads.Threads(fixed=2)
    machine.run(others=2.0, own=0.0)
    assert fit.start() == 2
    fit.tick()
    assert fit.count == 2 and torch.get_num_threads() == 2
    monkeypatch.setenv("SPECGEN_THREADS", "1")
    assert threads.Threads().fixed == 1


@pytest.mark.parametrize("count", [0, -1, 10_000])
def test_a_bad_count_is_one_line(count, tiny_dirs):
    with pytest.raises(ConfigError, match="--threads must be in 1.."):
        threads.check_count(count)
    result = runner.invoke(
        app, ["run", "hi", "--target", str(tiny_dirs["target"]), "--method", "plain", "--threads", str(count)]
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--threads must be in 1.." in lines[0], result.output


def test_the_json_says_how_many_threads_ran(tiny_dirs):
    result = runner.invoke(
        app,
        ["run", "hi", "--target", str(tiny_dirs["target"]), "--draft", str(tiny_dirs["draft"]), "-n", "4"]
        + ["--device", "cpu", "--dtype", "float32", "--format", "json", "--threads", "1", "--no-server"],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["stats"]["threads"] == 1
