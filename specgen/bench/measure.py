"""Measuring: a warm-up per method, then for each prompt and repeat every method, every other
time in reverse order (plain, chain, chain, plain, ...) so that drift in the machine's speed
hits all alike; threads fixed; memory peaks per run; the environment each figure was measured
in. A column whose isolated runner fails (a crashed llama.cpp) stops with one recorded line
while the others go on. Knows nothing about Typer or output formats."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import resource
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import torch
import transformers

from specgen import __version__
from specgen.bench import llamacpp as bench_llamacpp
from specgen.bench.isolated import IsolatedRunner, RunnerFailed, closing
from specgen.bench.methods import PLAIN, build_runner, in_turn, parse_methods, registry
from specgen.bench.prompts import encode_all
from specgen.bench.references import assistant_settings
from specgen.bench.runners import Generation, Runner
from specgen.bench.summary import GroupSummary, Noise, PromptResult, noise, per_prompt, summarize
from specgen.config import GenerationConfig
from specgen.decoding.prompts import PromptRecord
from specgen.errors import ConfigError, one_line
from specgen.models import placement
from specgen.runtime import head_memory
from specgen.runtime.int8 import RowInt8Linear
from specgen.status import note


@dataclass(frozen=True)
class BenchSettings:
    generation: GenerationConfig  # its `method` is ignored
    repeats: int = 1
    warmup: bool = True
    warmup_tokens: int = 16
    threads: int | None = None  # None: keep torch's current count (and report it)

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ConfigError(f"--repeats must be >= 1, got {self.repeats}")
        cpus = os.cpu_count() or 1
        if self.threads is not None and not 1 <= self.threads <= cpus:  # more threads than CPUs never pays
            raise ConfigError(f"--threads must be in 1..{cpus} (this machine's CPUs), got {self.threads}")


@dataclass
class Failure:
    """A column that stopped: its one line, and where (repeat None: in its warm-up). What it
    measured before stays in the measurements; it has no summary rows."""

    method: str
    prompt_id: str
    category: str
    repeat: int | None
    error: str


class MemoryProbe:
    """Peak memory of one run. CUDA: max_memory_allocated, reset per run. CPU: the process's
    peak RSS (VmHWM, reset per run through /proc/self/clear_refs where Linux allows it,
    else ru_maxrss, the peak since the process started)."""

    def __init__(self, devices: list[torch.device] = ()):
        self.cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
        self.kind = "cuda max_memory_allocated per run" if self.cuda else "cpu peak rss"
        self._resettable = False

    def reset(self) -> None:
        if self.cuda:
            for index in self.cuda:
                torch.cuda.reset_peak_memory_stats(index)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak RSS to the current RSS
            self._resettable = True
            self.kind = "cpu peak rss per run (VmHWM)"
        except OSError:
            self.kind = "cpu peak rss of the process (ru_maxrss)"

    def peak(self) -> int | None:
        if self.cuda:
            return sum(torch.cuda.max_memory_allocated(i) for i in self.cuda)
        if self._resettable:
            with contextlib.suppress(OSError, ValueError, IndexError):
                for line in Path("/proc/self/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


@contextlib.contextmanager
def fixed_threads(threads: int | None):
    """Fix torch's intra-op thread count for the measurement; restore it afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def measure(
    runners: list[Runner],
    prompts: list[tuple[PromptRecord, list[int]]],
    settings: BenchSettings,
    memory: MemoryProbe | None = None,
    warmups: dict | None = None,
    failures: list[Failure] | None = None,
) -> Iterator[Generation]:
    """Warm each method up once (its seconds go to `warmups`: compilation and CUDA-graph
    capture happen there, apart from every measurement), then for each prompt, for each
    repeat, run every method: in the given order (the caller puts plain first), then in reverse
    the next time, and so on across prompts. A machine that slows down (or speeds up) steadily
    then costs every method the same on average: with a fixed order, the later methods would
    always run on the slower machine. With an even --repeats each prompt's pairs cancel such
    drift by themselves; with one, the alternation cancels it over the prompts. Yields
    measurements as they complete. A column that fails (an isolated runner's crash, or any error
    of a runner) goes to `failures` with its line, is said on stderr and is not run again; the
    other columns go on."""
    memory = memory or MemoryProbe()
    failures = [] if failures is None else failures
    config = settings.generation

    def attempt(
        runner, item: PromptRecord, repeat: int | None, ids: list[int], run_config: GenerationConfig
    ) -> Generation | None:
        try:
            return runner.generate(ids, run_config)
        except Exception as exc:  # noqa: BLE001 - one column's failure is its line, never the others' loss
            line = str(exc) if isinstance(exc, RunnerFailed) else one_line(exc)
            failures.append(Failure(runner.name, item.id, item.category, repeat, line))
            note(f"bench: {runner.name}: {line}")
            return None

    def live() -> list[Runner]:
        failed = {f.method for f in failures}
        return [r for r in runners if r.name not in failed]

    if settings.warmup and prompts:
        short = replace(config, max_new_tokens=min(settings.warmup_tokens, config.max_new_tokens))
        item, ids = prompts[0]
        for runner in live():
            started = time.perf_counter()
            if attempt(runner, item, None, ids, short) is not None and warmups is not None:
                warmups[runner.name] = round(time.perf_counter() - started, 3)
    turn = 0
    for item, ids in prompts:
        for repeat in range(settings.repeats):
            order = in_turn(live(), turn)
            turn += 1
            for runner in order:
                memory.reset()
                gen = attempt(runner, item, repeat, ids, config)
                if gen is not None:
                    # an isolated runner's memory is its child's (the parent's peak says nothing of it)
                    peak = runner.peak_memory_bytes if isinstance(runner, IsolatedRunner) else memory.peak()
                    yield replace(
                        gen,
                        prompt_id=item.id,
                        category=item.category,
                        method=runner.name,
                        repeat=repeat,
                        prompt_tokens=len(ids),
                        peak_memory_bytes=peak,
                    )


@dataclass
class BenchResult:
    environment: dict
    settings: dict
    methods: list[str]
    greedy: bool
    measurements: list[Generation]
    prompts: list[PromptResult]
    summary: list[GroupSummary]
    interrupted: bool = False
    failures: list[Failure] = field(default_factory=list)  # columns that stopped, one line each
    noise: Noise | None = None  # plain against plain over the repeats (None with one repeat)


def run_bench(
    pair,
    method_names: list[str],
    prompts: list[PromptRecord],
    settings: BenchSettings,
    on_measurement: Callable[[Generation], None] | None = None,
    runners: list[Runner] | None = None,
    drafts: dict | None = None,
) -> BenchResult:
    """Encode the prompts, build the runners (plain first), measure, summarise.

    Ctrl-C stops the measurement and keeps what was measured (`interrupted` is set). A column
    whose isolated runner fails is recorded in `failures` and left out of the summary; the
    others are measured in full. Isolated runners' child processes are stopped on the way out.
    `runners` replaces the registry's runners (tests inject deliberately wrong methods).
    """
    specs = registry()
    if runners is None:
        method_names = parse_methods(",".join(method_names))
        if not getattr(pair.target, "gguf", None) and any(n in bench_llamacpp.METHODS for n in method_names):
            note(f"bench: llama.cpp columns skipped: target {pair.target.name} has no GGUF file")
            method_names = [n for n in method_names if n not in bench_llamacpp.METHODS]
        runners = [build_runner(pair, name, drafts) for name in method_names]
    with closing(runners):
        result = _run(pair, runners, prompts, settings, specs, on_measurement)
    if drafts:  # METHOD@DRAFT columns: which model each of them drafted with
        result.environment["extra_drafts"] = {
            name: _model_record(extra.model) | extra.overrides for name, extra in drafts.items()
        }
    return result


def _run(
    pair,
    runners: list[Runner],
    prompts: list[PromptRecord],
    settings: BenchSettings,
    specs: dict,
    on_measurement: Callable[[Generation], None] | None,
) -> BenchResult:
    method_names = [r.name for r in runners]
    if PLAIN not in method_names:
        raise ConfigError("plain decoding must be measured: it is the denominator of every speed-up")
    encoded = list(zip(prompts, encode_all(pair.target.tokenizer, prompts, pair.target.context_length)))
    devices = [pair.target.device] + ([pair.draft.device] if pair.draft is not None else [])
    memory = MemoryProbe(devices)
    measurements: list[Generation] = []
    warmups: dict[str, float] = {}
    failures: list[Failure] = []
    interrupted = False
    with fixed_threads(settings.threads) as threads:
        env = environment(pair, threads)
        try:
            for m in measure(runners, encoded, settings, memory, warmups, failures):
                measurements.append(m)
                if on_measurement is not None:
                    on_measurement(m)
        except KeyboardInterrupt:
            interrupted = True
    env["peak_memory"] = memory.kind
    greedy = settings.generation.sampling.greedy
    prompt_results = per_prompt(measurements, greedy)
    described = {
        name: specs[name].description if name in specs else f"specgen {name}" for name in method_names
    }
    run_settings = {
        "methods": described,
        "prompts": len(prompts),
        "repeats": settings.repeats,
        "warmup": settings.warmup,
        "warmup_tokens": settings.warmup_tokens,
        "warmup_seconds": warmups,
        **{k: v for k, v in asdict(settings.generation).items() if k != "method"},
        "greedy": greedy,
        "hf_assistant": assistant_settings(runners),
    }
    failed = {f.method for f in failures}
    summarized = [name for name in method_names if name not in failed]
    return BenchResult(
        env,
        run_settings,
        method_names,
        greedy,
        measurements,
        prompt_results,
        summarize(measurements, prompt_results, summarized),
        interrupted,
        failures,
        noise(measurements),
    )


def environment(pair, threads: int) -> dict:
    """Where and with what the numbers were measured."""
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else []
    )
    env = {
        "cpu": placement.cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "torch_interop_threads": torch.get_num_interop_threads(),
        "gpus": gpus,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "specgen": __version__,
        "target": _model_record(pair.target),
        "draft": _model_record(pair.draft) if pair.draft else None,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu_flags": sorted(f for f in (placement.cpu_flags() or ()) if f.startswith(("avx", "amx", "sse4"))),
        "cpu_format": _format_record(),
    }
    primed = head_memory.primed(pair.draft.model) if pair.draft else None
    if primed is not None:  # a draft head primed from earlier runs drafts better from the start
        env["draft"]["head_primed"] = primed
    if gpus:
        env["cuda"] = torch.version.cuda
    llama = _installed("llama-cpp-python")
    if llama:  # the llamacpp columns' build: a native one crashes on AMX CPUs (README)
        env["llama_cpp_python"] = llama
    return env


def _installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _format_record() -> dict:
    """What --dtype auto picks on this CPU, and why (placement.cpu_format)."""
    chosen = placement.cpu_format()
    return {"dtype": str(chosen.dtype).removeprefix("torch."), "reason": chosen.reason}


def _model_record(loaded) -> dict:
    return {
        "name": loaded.name,
        "source": loaded.source,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "weights": getattr(loaded, "weights", "none"),
        "parameters": _parameters(loaded.model),
    }


def _parameters(model) -> int:
    packed = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, RowInt8Linear))
    return sum(p.numel() for p in model.parameters()) + packed
