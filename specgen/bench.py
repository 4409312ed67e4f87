"""Measure decoding methods against plain decoding of the target, in one run, fairly.

Owns, in this order in the file:
- prompt sets: `prompts/*.jsonl` by name, a file, or `all`; encoded once with the chat template;
- methods: a registry of small runners behind one interface (`Runner.generate(ids, config)
  -> Generation`): specgen's engine methods, and transformers' own assisted generation and
  prompt lookup as reference columns, all on the same loaded pair;
- measurement: a warm-up per method, then for each prompt and repeat every method in a fixed
  order (plain first) so machine drift hits all alike; threads fixed; memory peaks per run;
- the summary: medians over repeats, per-prompt speed-up over plain, geometric means per
  method and category, greedy exactness against plain, the environment record.

Knows nothing about Typer or output formats: `specgen.bench_cli` maps options onto these
calls and writes the table, JSON, CSV and plot.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Protocol

import torch

from specgen import placement

from specgen.replay import ReplayResult
from specgen.config import GenerationConfig, Method
from specgen.errors import ConfigError, PromptError

PLAIN = Method.PLAIN.value
QUICK = "quick"
ALL = "all"


# -- prompt sets -------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchPrompt:
    """One prompt of a set: a single user `prompt`, or a conversation in `messages`."""

    id: str
    category: str
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None


def prompt_dirs() -> list[Path]:
    """Where prompt sets live: the repository's `prompts/` next to the package, then ./prompts."""
    candidates = [Path(__file__).resolve().parent.parent / "prompts", Path.cwd() / "prompts"]
    found: list[Path] = []
    for directory in candidates:
        if directory.is_dir() and directory.resolve() not in [d.resolve() for d in found]:
            found.append(directory)
    return found


def prompt_set_names(dirs: list[Path] | None = None) -> list[str]:
    dirs = prompt_dirs() if dirs is None else dirs
    return sorted({p.stem for d in dirs for p in d.glob("*.jsonl")})


def load_prompts(spec: str, limit: int | None = None, dirs: list[Path] | None = None) -> list[BenchPrompt]:
    """`spec` is a set name (a file stem under prompts/), `all`, or a path to a JSONL file.

    `limit` keeps the first N prompts of each file (so `all --limit 2` keeps every category).
    """
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    dirs = prompt_dirs() if dirs is None else dirs
    prompts: list[BenchPrompt] = []
    for path in _prompt_files(spec.strip(), dirs):
        prompts.extend(read_prompt_file(path)[:limit])
    seen: set[str] = set()
    for item in prompts:
        if item.id in seen:
            raise PromptError(f"prompt id '{item.id}' appears twice in --prompts {spec}")
        seen.add(item.id)
    if not prompts:
        raise PromptError(f"--prompts {spec} holds no prompts")
    return prompts


def _prompt_files(spec: str, dirs: list[Path]) -> list[Path]:
    if spec == ALL:
        for directory in dirs:
            files = sorted(p for p in directory.glob("*.jsonl") if p.stem != QUICK)
            if files:
                return files
        raise PromptError("no prompt sets found for --prompts all (looked for prompts/*.jsonl "
                          "next to the package and in the current directory)")
    is_name = spec and "/" not in spec and os.sep not in spec and not spec.endswith(".jsonl")
    if is_name:
        for directory in dirs:
            if (directory / f"{spec}.jsonl").is_file():
                return [directory / f"{spec}.jsonl"]
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    names = ", ".join(prompt_set_names(dirs) + [ALL]) or ALL
    raise PromptError(f"unknown prompt set '{spec}': not a file, and not one of: {names}")


def read_prompt_file(path: Path) -> list[BenchPrompt]:
    """Parse and check one JSONL prompt file; any problem is one line naming file:line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptError(f"cannot read prompt file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptError(f"{where}: not valid JSON ({exc.msg})") from None
        prompts.append(_prompt_from(obj, where))
    return prompts


def _prompt_from(obj, where: str) -> BenchPrompt:
    if not isinstance(obj, dict):
        raise PromptError(f"{where}: each line must be a JSON object")
    for key in ("id", "category"):
        if not isinstance(obj.get(key), str) or not obj[key].strip():
            raise PromptError(f"{where}: missing or empty string field '{key}'")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        raise PromptError(f"{where}: needs exactly one of 'prompt' or 'messages'")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptError(f"{where}: 'prompt' must be a non-empty string")
        return BenchPrompt(obj["id"], obj["category"], prompt=prompt)
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)
    if not ok:
        raise PromptError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    return BenchPrompt(obj["id"], obj["category"], messages=tuple(dict(m) for m in messages))


def encode(tokenizer, item: BenchPrompt) -> list[int]:
    """Token ids of one prompt, through the chat template with the generation prompt added."""
    from specgen.session import encode_prompt

    if item.messages is None:
        return encode_prompt(tokenizer, item.prompt)
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError(f"prompt {item.id} is a conversation but the target's tokenizer has no chat template")
    encoded = tokenizer.apply_chat_template(list(item.messages), add_generation_prompt=True, return_dict=True)
    return list(encoded["input_ids"])


# -- methods -------------------------------------------------------------------------------
@dataclass
class Generation:
    """One generation as a runner reports it; counters are None where the method cannot know."""

    token_ids: list[int]
    seconds: float  # wall time from the call to the last token on the host
    ttft_seconds: float | None  # wall time to the first new token (prefill included)
    first_tokens: int = 1  # tokens that arrived together with the first one
    prefill_seconds: float | None = None
    target_forwards: int | None = None  # target forwards that produced tokens (not a bare prefill)
    drafted: int | None = None
    accepted: int | None = None
    histogram: dict[int, int] | None = None  # accepted length -> rounds, for rounds with a draft
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    stop: str | None = None


class Runner(Protocol):
    """A method under test. `config.method` is ignored: the runner knows its own method."""

    name: str

    def generate(self, prompt_ids: list[int], config: GenerationConfig) -> Generation: ...


class EngineRunner:
    """A specgen method through the Engine, with a fresh engine (and drafter cache) per call,
    so a repeat cannot reuse the draft cache of the run before it."""

    def __init__(self, pair, method: Method, name: str | None = None, overrides: dict | None = None):
        self.pair, self.method, self.name = pair, method, name or method.value
        self.overrides = overrides or {}

    def generate(self, prompt_ids: list[int], config: GenerationConfig) -> Generation:
        from specgen.session import build_engine
        from specgen.stats import Stats

        config = replace(config, method=self.method, **self.overrides)
        engine = build_engine(self.pair, self.method, config)
        stats = Stats(method=self.name, prompt_tokens=len(prompt_ids))
        first_tokens = 0
        started = time.perf_counter()
        state = engine.start(prompt_ids, config)
        stats.prefill_seconds = state.prefill_seconds
        for result in engine.rounds(state, config):
            if isinstance(result, ReplayResult):  # deterministic mode: a window replayed
                stats.update_replay(result, time.perf_counter() - started)
                continue
            stats.update(result, time.perf_counter() - started)
            first_tokens = first_tokens or len(result.emitted)
        seconds = time.perf_counter() - started
        ids = state.ids[len(prompt_ids): state.verified if config.deterministic else None]
        speculative = self.method is not Method.PLAIN
        return Generation(
            ids, seconds, stats.time_to_first_token, first_tokens, stats.prefill_seconds,
            stats.target_forwards, stats.drafted, stats.accepted,
            dict(stats.accepted_lengths) if speculative else None,
            stats.draft_seconds if speculative else None, stats.verify_seconds, stats.stop)


@dataclass(frozen=True)
class MethodSpec:
    name: str
    needs_draft: bool
    build: Callable[[object], Runner]  # Pair -> Runner
    description: str


def registry() -> dict[str, MethodSpec]:
    """Every method bench can run, in the default order: specgen's engine methods, then the
    transformers references. New engine methods appear here as they land in `Method`."""
    specs = {}
    for method in Method:
        specs[method.value] = MethodSpec(method.value, method.needs_draft_model,
                                         lambda pair, m=method: EngineRunner(pair, m),
                                         f"specgen {method.value} decoding")
    from specgen.bench_refs import REFERENCES, HFRunner  # imports this module's Generation

    for ref in REFERENCES:
        specs[ref.name] = MethodSpec(ref.name, ref.uses_assistant,
                                     lambda pair, r=ref: HFRunner(pair, r), ref.description)
    from specgen import bench_llamacpp

    if bench_llamacpp.installed():  # optional extra: listed (and in the default run) once installed
        for name, description in bench_llamacpp.METHODS.items():
            specs[name] = MethodSpec(name, False, lambda pair, n=name: bench_llamacpp.LlamaCppRunner(pair, n),
                                     description)
    return specs


def variant(name: str) -> tuple[Method, dict] | None:
    """'chain/k2' -> (CHAIN, {draft_tokens: 2, schedule: fixed}); 'chain/additive' or
    'lookup/expected-gain' -> an adaptive schedule (up to the run's --draft-tokens, or 8 with
    'auto'); 'chain/c0.5' -> a draft confidence stop at 0.5 (--draft-confidence; c0: none); suffixes
    combine ('lookup-chain/k4/c0.5'). None when `name` is not a variant. Lets one bench run
    compare draft lengths, schedules and confidence stops of the same method, each against the
    same plain runs."""
    from specgen.adaptive import Schedule

    base, *suffixes = name.split("/")
    methods = {m.value: m for m in Method}
    if not suffixes or base not in methods or methods[base].is_tree or base == PLAIN:
        return None
    overrides: dict = {}
    for suffix in suffixes:
        if suffix[:1] == "k" and suffix[1:].isdigit() and int(suffix[1:]) >= 1 and "draft_tokens" not in overrides:
            overrides.update(draft_tokens=int(suffix[1:]), schedule=overrides.get("schedule", Schedule.FIXED))
        elif suffix[:1] == "c" and _fraction(suffix[1:]) is not None and "draft_confidence" not in overrides:
            overrides["draft_confidence"] = _fraction(suffix[1:])
        elif suffix in {s.value for s in Schedule} and "schedule_named" not in overrides:
            overrides.update(schedule=Schedule(suffix), schedule_named=True)
        else:
            return None
    overrides.pop("schedule_named", None)
    return methods[base], overrides


def _fraction(text: str) -> float | None:
    """A confidence stop in [0, 1) (0: off), else None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 <= value < 1.0 else None


def parse_methods(text: str | None) -> list[str]:
    """A comma list -> method names, plain first (always measured: it is every denominator).

    Besides the registry's names, chain and lookup take variants: `chain/k2` (fixed k = 2),
    `chain/additive`, `chain/expected-gain`, `chain/fixed`, `chain/c0.5` (a confidence stop),
    combined as `chain/k4/c0.5` (see `variant`).
    """
    specs = registry()
    names = list(specs) if text is None or not text.strip() else [
        n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in specs and variant(n) is None]
    from specgen import bench_llamacpp

    if any(n in bench_llamacpp.METHODS for n in unknown):
        bench_llamacpp.require()
    if unknown:
        raise ConfigError(f"unknown method '{unknown[0]}' in --methods; choose from: {', '.join(specs)} "
                          "(chain and lookup also take /kN, /cX (confidence stop) or /fixed, /additive, /expected-gain)")
    ordered = [PLAIN] + [n for n in names if n != PLAIN]
    return list(dict.fromkeys(ordered))


def check_settings(names: list[str], config: GenerationConfig) -> None:
    """Validate `config` as each engine method would see it, before any model is loaded."""
    engine_methods = {m.value: m for m in Method}
    for name in names:
        if name in engine_methods:
            replace(config, method=engine_methods[name])
        elif variant(name) is not None:
            method, overrides = variant(name)
            replace(config, method=method, **overrides)


def needs_draft(names: list[str]) -> bool:
    specs = registry()
    return any(specs[n].needs_draft if n in specs else variant(n)[0].needs_draft_model for n in names)


def build_runner(pair, name: str) -> Runner:
    specs = registry()
    if name in specs:
        return specs[name].build(pair)
    method, overrides = variant(name)
    return EngineRunner(pair, method, name, overrides)


# -- measurement ---------------------------------------------------------------------------
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
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")


@dataclass
class Measurement:
    """One generation of one prompt by one method in one repeat."""

    prompt_id: str
    category: str
    method: str
    repeat: int
    prompt_tokens: int
    new_tokens: int
    seconds: float
    prefill_seconds: float | None
    ttft_seconds: float | None
    tokens_per_second: float  # new tokens / total seconds, the same for every method
    decode_tokens_per_second: float | None  # tokens after the first arrival / time after it
    acceptance_rate: float | None
    tokens_per_target_forward: float | None
    target_forwards: int | None
    drafted: int | None
    accepted: int | None
    accepted_length_histogram: dict[str, int] | None
    draft_seconds: float | None
    verify_seconds: float | None
    peak_memory_bytes: int | None
    stop_reason: str | None
    token_ids: list[int]


def to_measurement(item: BenchPrompt, method: str, repeat: int, prompt_tokens: int,
                   gen: Generation, peak: int | None) -> Measurement:
    new = len(gen.token_ids)
    after_first = new - gen.first_tokens
    decode_time = gen.seconds - gen.ttft_seconds if gen.ttft_seconds is not None else 0.0
    decode = after_first / decode_time if after_first > 0 and decode_time > 0 else None
    histogram = None if gen.histogram is None else {str(k): v for k, v in sorted(gen.histogram.items())}
    return Measurement(
        item.id, item.category, method, repeat, prompt_tokens, new, gen.seconds, gen.prefill_seconds,
        gen.ttft_seconds, new / gen.seconds if gen.seconds > 0 else 0.0, decode,
        gen.accepted / gen.drafted if gen.drafted else None,
        new / gen.target_forwards if gen.target_forwards else None,
        gen.target_forwards, gen.drafted, gen.accepted, histogram, gen.draft_seconds,
        gen.verify_seconds, peak, gen.stop, list(gen.token_ids))


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


def measure(runners: list[Runner], prompts: list[tuple[BenchPrompt, list[int]]],
            settings: BenchSettings, memory: MemoryProbe | None = None,
            warmups: dict | None = None) -> Iterator[Measurement]:
    """Warm each method up once (its seconds go to `warmups`: compilation and CUDA-graph
    capture happen there, apart from every measurement), then for each prompt, for each
    repeat, run every method in the given order (the caller puts plain first). Yields
    measurements as they complete."""
    memory = memory or MemoryProbe()
    config = settings.generation
    if settings.warmup and prompts:
        short = replace(config, max_new_tokens=min(settings.warmup_tokens, config.max_new_tokens))
        for runner in runners:
            started = time.perf_counter()
            runner.generate(prompts[0][1], short)
            if warmups is not None:
                warmups[runner.name] = round(time.perf_counter() - started, 3)
    for item, ids in prompts:
        for repeat in range(settings.repeats):
            for runner in runners:
                memory.reset()
                gen = runner.generate(ids, config)
                yield to_measurement(item, runner.name, repeat, len(ids), gen, memory.peak())


# -- summary -------------------------------------------------------------------------------
@dataclass
class PromptResult:
    """One prompt and one method: medians over repeats, and how it compares with plain."""

    prompt_id: str
    category: str
    method: str
    repeats: int
    new_tokens: int  # first repeat
    tokens_per_second: float  # median
    seconds: float  # median
    ttft_seconds: float | None  # median
    speedup: float | None  # this median tok/s over plain's median tok/s on the same prompt
    identical_to_plain: bool | None  # greedy only: first-repeat ids equal plain's
    first_mismatch: int | None  # index of the first differing token, when not identical


@dataclass
class GroupSummary:
    """One method over one category (or `all`)."""

    method: str
    category: str
    prompts: int
    tokens_per_second: float | None  # geometric mean of per-prompt medians
    speedup: float | None  # geometric mean of per-prompt speed-ups
    speedup_min: float | None
    speedup_max: float | None
    acceptance_rate: float | None  # pooled: accepted / drafted over every run
    tokens_per_target_forward: float | None  # pooled: new tokens / target forwards
    ttft_seconds: float | None  # median of per-prompt medians
    draft_seconds: float | None  # summed over every run
    verify_seconds: float | None
    accepted_length_histogram: dict[str, int] | None
    identical: int | None  # prompts identical to plain (greedy only)
    compared: int
    peak_memory_bytes: int | None


def geometric_mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    if not values or any(v <= 0 for v in values):
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def per_prompt(measurements: list[Measurement], greedy: bool) -> list[PromptResult]:
    groups: dict[tuple[str, str], list[Measurement]] = {}
    for m in measurements:
        groups.setdefault((m.prompt_id, m.method), []).append(m)
    results = []
    for (prompt_id, method), runs in groups.items():
        runs.sort(key=lambda m: m.repeat)
        plain = sorted(groups.get((prompt_id, PLAIN), []), key=lambda m: m.repeat)
        tps = statistics.median(m.tokens_per_second for m in runs)
        plain_tps = statistics.median(m.tokens_per_second for m in plain) if plain else None
        identical = mismatch = None
        if greedy and plain:
            mismatch = _first_mismatch(runs[0].token_ids, plain[0].token_ids)
            identical = mismatch is None
        results.append(PromptResult(
            prompt_id, runs[0].category, method, len(runs), runs[0].new_tokens, tps,
            statistics.median(m.seconds for m in runs), _median([m.ttft_seconds for m in runs]),
            tps / plain_tps if plain_tps else None, identical, mismatch))
    return results


def summarize(measurements: list[Measurement], prompt_results: list[PromptResult],
              methods: list[str]) -> list[GroupSummary]:
    """Per method: an `all` row, then one row per category (in order of first appearance)."""
    categories = list(dict.fromkeys(m.category for m in measurements))
    rows = []
    for method in methods:
        for category in [ALL] + categories:
            runs = [m for m in measurements if m.method == method and category in (ALL, m.category)]
            results = [r for r in prompt_results if r.method == method and category in (ALL, r.category)]
            if runs:
                rows.append(_group(method, category, runs, results))
    return rows


def _group(method: str, category: str, runs: list[Measurement], results: list[PromptResult]) -> GroupSummary:
    def total(attr):
        values = [getattr(m, attr) for m in runs]
        return None if any(v is None for v in values) else sum(values)

    drafted, accepted, forwards = total("drafted"), total("accepted"), total("target_forwards")
    histogram: Counter | None = Counter()
    for m in runs:
        if m.accepted_length_histogram is None:
            histogram = None
            break
        histogram.update(m.accepted_length_histogram)
    speedups = [r.speedup for r in results if r.speedup is not None]
    compared = [r for r in results if r.identical_to_plain is not None]
    peaks = [m.peak_memory_bytes for m in runs if m.peak_memory_bytes is not None]
    return GroupSummary(
        method, category, len(results), geometric_mean([r.tokens_per_second for r in results]),
        geometric_mean(speedups) if len(speedups) == len(results) else None,
        min(speedups, default=None), max(speedups, default=None),
        accepted / drafted if drafted else None,
        sum(m.new_tokens for m in runs) / forwards if forwards else None,
        _median([r.ttft_seconds for r in results]), total("draft_seconds"), total("verify_seconds"),
        None if histogram is None else {str(k): v for k, v in sorted(histogram.items(), key=lambda kv: int(kv[0]))},
        sum(r.identical_to_plain for r in compared) if compared else None, len(compared),
        max(peaks) if peaks else None)


# -- a whole run ---------------------------------------------------------------------------
@dataclass
class BenchResult:
    environment: dict
    settings: dict
    methods: list[str]
    greedy: bool
    measurements: list[Measurement]
    prompts: list[PromptResult]
    summary: list[GroupSummary]
    interrupted: bool = False


def assistant_settings(pair, names: list[str]) -> dict:
    from specgen.bench_refs import _assistant_settings

    return _assistant_settings(pair, names)


def run_bench(pair, method_names: list[str], prompts: list[BenchPrompt], settings: BenchSettings,
              on_measurement: Callable[[Measurement], None] | None = None,
              runners: list[Runner] | None = None) -> BenchResult:
    """Encode the prompts, build the runners (plain first), measure, summarise.

    Ctrl-C stops the measurement and keeps what was measured (`interrupted` is set).
    `runners` replaces the registry's runners (tests inject deliberately wrong methods).
    """
    specs = registry()
    if runners is None:
        method_names = parse_methods(",".join(method_names))
        from specgen import bench_llamacpp

        if not getattr(pair.target, "gguf", None) and any(n in bench_llamacpp.METHODS for n in method_names):
            import sys

            sys.stderr.write(f"bench: llama.cpp columns skipped: target {pair.target.name} has no GGUF file\n")
            method_names = [n for n in method_names if n not in bench_llamacpp.METHODS]
        runners = [build_runner(pair, name) for name in method_names]
    method_names = [r.name for r in runners]
    if PLAIN not in method_names:
        raise ConfigError("plain decoding must be measured: it is the denominator of every speed-up")
    tokenizer = pair.target.tokenizer
    encoded = []
    for item in prompts:
        ids = encode(tokenizer, item)
        if len(ids) >= pair.target.context_length - 1:
            raise PromptError(f"prompt {item.id} has {len(ids)} tokens; the target's context holds "
                              f"{pair.target.context_length}")
        encoded.append((item, ids))
    devices = [pair.target.device] + ([pair.draft.device] if pair.draft is not None else [])
    memory = MemoryProbe(devices)
    measurements: list[Measurement] = []
    warmups: dict[str, float] = {}
    interrupted = False
    with fixed_threads(settings.threads) as threads:
        env = environment(pair, threads)
        try:
            for m in measure(runners, encoded, settings, memory, warmups):
                measurements.append(m)
                if on_measurement is not None:
                    on_measurement(m)
        except KeyboardInterrupt:
            interrupted = True
    env["peak_memory"] = memory.kind
    greedy = settings.generation.sampling.greedy
    prompt_results = per_prompt(measurements, greedy)
    described = {name: specs[name].description if name in specs else f"specgen {name}" for name in method_names}
    run_settings = {
        "methods": described, "prompts": len(prompts), "repeats": settings.repeats,
        "warmup": settings.warmup, "warmup_tokens": settings.warmup_tokens, "warmup_seconds": warmups,
        **{k: v for k, v in asdict(settings.generation).items() if k != "method"}, "greedy": greedy,
        "hf_assistant": assistant_settings(pair, method_names),
    }
    return BenchResult(env, run_settings, method_names, greedy, measurements, prompt_results,
                       summarize(measurements, prompt_results, method_names), interrupted)


def environment(pair, threads: int) -> dict:
    """Where and with what the numbers were measured."""
    import transformers

    from specgen import __version__

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    env = {
        "cpu": placement.cpu_name(), "cpu_count": os.cpu_count(), "torch_threads": threads,
        "torch_interop_threads": torch.get_num_interop_threads(), "gpus": gpus,
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__, "specgen": __version__,
        "target": _model_record(pair.target), "draft": _model_record(pair.draft) if pair.draft else None,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu_flags": sorted(f for f in (placement.cpu_flags() or ()) if f.startswith(("avx", "amx", "sse4"))),
        "cpu_format": _format_record(),
    }
    if gpus:
        env["cuda"] = torch.version.cuda
    return env


def _format_record() -> dict:
    """What --dtype auto picks on this CPU, and why (placement.cpu_format)."""
    chosen = placement.cpu_format()
    return {"dtype": str(chosen.dtype).removeprefix("torch."), "reason": chosen.reason}


def _model_record(loaded) -> dict:
    return {"name": loaded.name, "source": loaded.source, "device": str(loaded.device),
            "dtype": str(loaded.dtype).removeprefix("torch."), "weights": getattr(loaded, "weights", "none"),
            "parameters": _parameters(loaded.model)}


def _parameters(model) -> int:
    from specgen.int8 import RowInt8Linear

    packed = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, RowInt8Linear))
    return sum(p.numel() for p in model.parameters()) + packed
