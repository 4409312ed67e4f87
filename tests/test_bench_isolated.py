"""Reference columns in a child process (specgen/bench/isolated.py): a child that crashes is its
column's one-line result while every other column is measured and written; Ctrl-C kills a busy
child; no child outlives the run. Three spawned children in all (each imports torch: seconds)."""

from __future__ import annotations

import csv
import json
import os
import signal
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from specgen.bench import llamacpp as bench_llamacpp
from specgen.bench import measure as measuring
from specgen.bench import methods
from specgen.bench.isolated import IsolatedRunner, RunnerFailed
from specgen.bench.measure import BenchSettings
from specgen.bench.runners import Generation
from specgen.cli.bench import bench_app
from specgen.config import GenerationConfig, SamplingConfig
from specgen.decoding.prompts import PromptRecord
from specgen.decoding.stats import Stats
from specgen.runtime.pair import Pair

CRASH_LINE = "fake crashed (SIGSEGV) - see README 'llama.cpp on CPUs with AMX'"


class FixedTokens:
    """A reference built in the child: answers [its torch threads, its pid, 5, 5, ...]; on call
    `crash_on` it dies of SIGSEGV as llama.cpp does, on call `sleep_on` it hangs for a minute."""

    def __init__(self, name: str, crash_on: int | None = None, sleep_on: int | None = None):
        self.name, self.crash_on, self.sleep_on, self.calls = name, crash_on, sleep_on, 0

    def generate(self, prompt_ids, config):
        self.calls += 1
        if self.calls == self.crash_on:
            os.kill(os.getpid(), signal.SIGSEGV)
        if self.calls == self.sleep_on:
            time.sleep(60)
        n = config.max_new_tokens
        ids = ([torch.get_num_threads(), os.getpid()] + [5] * n)[:n]
        return Generation(ids, 0.5, 0.1, 1, Stats(method=self.name, new_tokens=n, seconds=0.5))


def reaped(pid: int) -> bool:
    """No process, not even a zombie, has this pid."""
    return not Path(f"/proc/{pid}").exists()


app = typer.Typer(add_completion=False)
app.add_typer(bench_app, name="bench")


@app.callback()
def _root() -> None:
    """A stand-in for specgen's app."""


def test_a_crashing_reference_is_its_columns_one_line_and_the_rest_is_written(
    tiny_dirs, tmp_path, monkeypatch
):
    real = methods.registry

    def with_fakes():
        specs = real()
        specs["fake-ref"] = methods.MethodSpec(
            "fake-ref",
            False,
            lambda pair: IsolatedRunner("fake-ref", FixedTokens, ("fake-ref",), label="fake"),
            "a reference in a child",
        )
        specs["fake-crash"] = methods.MethodSpec(
            "fake-crash",
            False,
            lambda pair: IsolatedRunner(
                "fake-crash",
                FixedTokens,
                ("fake-crash", 2),
                label="fake",
                crash_hint=" - see README 'llama.cpp on CPUs with AMX'",
            ),
            "a reference that segfaults",
        )
        return specs

    monkeypatch.setattr(methods, "registry", with_fakes)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "category": "c", "prompt": f"say {i}"}) + "\n" for i in (1, 2, 3)),
        encoding="utf-8",
    )
    out_json, out_csv = tmp_path / "b.json", tmp_path / "b.csv"
    result = CliRunner().invoke(
        app,
        [
            "bench",
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
            "--prompts",
            str(prompts),
            "--methods",
            "fake-crash,fake-ref",
            "-n",
            "4",
            "--no-warmup",
            "--json",
            str(out_json),
            "--csv",
            str(out_csv),
        ],
    )
    assert result.exit_code == 1, result.output  # everything is written, and the run says a column failed
    assert "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[-1].startswith("error: 1 of 3 columns failed: fake-crash")
    assert f"bench: fake-crash: {CRASH_LINE}" in result.stderr  # said as it happens
    progress = [line for line in result.stderr.splitlines() if line.startswith("measured ")]
    assert progress == ["measured 1/3: p1", "measured 2/3: p2", "measured 3/3: p3"]  # a line per prompt
    assert f"fake-crash failed: {CRASH_LINE}" in " ".join(result.stdout.split())  # the table's line

    data = json.loads(out_json.read_text())
    assert data["methods"] == ["plain", "fake-crash", "fake-ref"]
    assert data["failures"] == [
        {"method": "fake-crash", "prompt_id": "p2", "category": "c", "repeat": 0, "error": CRASH_LINE}
    ]
    measured = [(m["method"], m["prompt_id"]) for m in data["measurements"]]
    assert measured == [  # the methods alternate their order: p2 runs them in reverse
        ("plain", "p1"),
        ("fake-crash", "p1"),
        ("fake-ref", "p1"),
        ("fake-ref", "p2"),
        ("plain", "p2"),
        ("plain", "p3"),
        ("fake-ref", "p3"),
    ]
    assert {g["method"] for g in data["summary"]} == {
        "plain",
        "fake-ref",
    }  # the crashed column: its line only
    ref = [m for m in data["measurements"] if m["method"] == "fake-ref"]
    assert all(m["seconds"] == 0.5 and m["new_tokens"] == 4 for m in ref)  # the child's own timings
    assert all(m["token_ids"][0] == 1 for m in ref)  # the child runs the parent's torch threads
    children = {m["token_ids"][1] for m in data["measurements"] if m["method"] != "plain"}
    assert len(children) == 2 and all(reaped(pid) for pid in children)  # stopped and reaped, no zombie

    rows = list(csv.DictReader(out_csv.open(encoding="utf-8")))
    assert len(rows) == 7 + 1
    assert [(r["method"], r["prompt_id"], r["repeat"], r["error"]) for r in rows if r["error"]] == [
        ("fake-crash", "p2", "0", CRASH_LINE)
    ]


def test_ctrl_c_during_a_childs_generation_kills_it_and_keeps_what_was_measured(tiny_pair):
    main = threading.main_thread().ident

    class Plain:
        """In-process plain decoding; on its second prompt it arms a Ctrl-C for a second later,
        while the reference's child hangs in its third generation (the methods alternate their
        order: p1 plain, reference; p2 reference, plain; p3 plain, reference)."""

        name = "plain"

        def __init__(self):
            self.calls = 0

        def generate(self, prompt_ids, config):
            self.calls += 1
            if self.calls == 2:
                threading.Timer(1.0, signal.pthread_kill, (main, signal.SIGINT)).start()
            n = config.max_new_tokens
            return Generation([1] * n, 1.0, 0.1, 1, Stats(method="plain", new_tokens=n))

    reference = IsolatedRunner("fake-ref", FixedTokens, ("fake-ref", None, 3), label="fake")
    settings = BenchSettings(
        GenerationConfig(max_new_tokens=3, sampling=SamplingConfig()), warmup=False, threads=1
    )
    started = time.perf_counter()
    prompts = [PromptRecord(f"p{i}", "x", i, "A") for i in (1, 2, 3)]
    result = measuring.run_bench(Pair(*tiny_pair), [], prompts, settings, runners=[Plain(), reference])
    assert time.perf_counter() - started < 30  # not the child's minute
    assert result.interrupted and result.failures == []
    assert [(m.method, m.prompt_id) for m in result.measurements] == [
        ("plain", "p1"),
        ("fake-ref", "p1"),
        ("fake-ref", "p2"),
        ("plain", "p2"),
        ("plain", "p3"),
    ]
    child = result.measurements[1].token_ids[1]
    assert reference.process is None and reaped(child)
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


# -- without a child: where measure records a failure, and llama.cpp's two sides -----------------
class Quick:
    """An in-process runner; `fail` raises RunnerFailed as a dead child's proxy does."""

    def __init__(self, name, fail=False):
        self.name, self.fail = name, fail

    def generate(self, prompt_ids, config):
        if self.fail:
            raise RunnerFailed("fake crashed (SIGILL)")
        n = config.max_new_tokens
        return Generation([3] * n, 1.0, 0.1, 1, Stats(method=self.name, new_tokens=n))


def test_a_failure_in_the_warmup_stops_that_column_only():
    settings = BenchSettings(GenerationConfig(max_new_tokens=4), repeats=2, warmup=True, threads=1)
    prompts = [(PromptRecord("p1", "x", 1, "A"), [1]), (PromptRecord("p2", "y", 2, "B"), [2])]
    warmups, failures = {}, []
    runs = list(
        measuring.measure(
            [Quick("plain"), Quick("dead", fail=True), Quick("b")],
            prompts,
            settings,
            warmups=warmups,
            failures=failures,
        )
    )
    assert failures == [measuring.Failure("dead", "p1", "A", None, "fake crashed (SIGILL)")]
    assert set(warmups) == {"plain", "b"}
    assert [(m.method, m.prompt_id) for m in runs] == [  # every other repeat in reverse order
        (name, p) for p in ("p1", "p2") for names in (("plain", "b"), ("b", "plain")) for name in names
    ]


def test_llamacpp_runs_through_a_child_that_copies_the_threads(monkeypatch):
    """LlamaCppRunner is an isolated runner whose child builds LlamaCppGenerator; that side is
    checked here in-process against a stand-in for llama_cpp (the extra is not installed)."""
    built = {}

    class Llama:
        def __init__(self, **kwargs):
            built.update(kwargs)

        def n_ctx(self):
            return built["n_ctx"]

        def reset(self):
            pass

        def generate(self, prompt_ids, **kwargs):
            yield from [7, 8, 2, 9]  # 2 is a stop id

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=Llama))
    monkeypatch.setattr(bench_llamacpp, "installed", lambda: True)
    target = types.SimpleNamespace(
        gguf=Path("t.gguf"),
        context_length=64,
        stop_ids=frozenset({2}),
        name="t",
        source="t.gguf",
        gguf_file=lambda: "t.gguf",
    )
    runner = bench_llamacpp.LlamaCppRunner(types.SimpleNamespace(target=target), "llamacpp")
    assert isinstance(runner, IsolatedRunner) and runner.process is None  # started by its first generation
    assert runner.crash_hint == " - see README 'llama.cpp on CPUs with AMX'"
    child_side = runner.factory(*runner.args)  # what isolated.serve builds in the child
    assert built["model_path"] == "t.gguf" and built["n_ctx"] == 64
    assert built["n_threads"] == built["n_threads_batch"] == torch.get_num_threads()
    gen = child_side.generate([1, 2, 3], GenerationConfig(max_new_tokens=10))
    assert gen.token_ids == [7, 8] and gen.stats.stop == "eos"
