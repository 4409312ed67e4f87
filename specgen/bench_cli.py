"""`specgen bench`: options -> settings -> one measurement run -> a table and files.

Owns the command and the bench reports (Rich table, JSON, CSV, plot); the measuring is in
specgen/bench.py. Register with `app.command()(bench)` in specgen/cli.py after the shared
option aliases are defined (this module imports them from there). No tensor code here.
"""

from __future__ import annotations

import csv
import json
import os
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from specgen.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specgen.options import (DeterministicOpt, ScheduleOpt, ConfidenceOpt, VerifyWindowOpt, BeamWidthOpt, BranchingOpt, DepthOpt, DeviceOpt,
                         DraftDeviceOpt, DraftOpt, DraftTokensOpt, DraftQuantOpt, TargetQuantOpt, CompileOpt, DtypeOpt, MaxNewOpt, SeedOpt, TargetOpt,
                         TemperatureOpt, TopKOpt, TopPOpt, user_errors)

from specgen.config import Method
from specgen.errors import ConfigError

REFERENCE_METHODS = "hf-assisted,hf-assisted-k4,hf-lookup"  # see specgen.bench.REFERENCES
DEFAULT_METHODS = ",".join(m.value for m in Method) + "," + REFERENCE_METHODS


def bench(
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    methods: Annotated[Optional[str], typer.Option(
        "--methods", help=f"Comma list of methods (default: all of them, {DEFAULT_METHODS}). "
                          "plain is always measured: it is the denominator of every speed-up.")] = None,
    prompts: Annotated[str, typer.Option(
        "--prompts", "-p", help="A prompt set in prompts/ by name (quick, code-generation, ...), "
                                "'all' (every category set), or a JSONL file.")] = "quick",
    limit: Annotated[Optional[int], typer.Option(
        "--limit", help="Keep the first N prompts of each prompt file.")] = None,
    repeats: Annotated[int, typer.Option(
        "--repeats", "-r", help="Runs per prompt and method; the report uses medians.")] = 1,
    warmup: Annotated[bool, typer.Option(
        "--warmup/--no-warmup", help="One short generation per method before measuring.")] = True,
    threads: Annotated[Optional[int], typer.Option(
        "--threads", help="torch intra-op threads, fixed for the run (default: torch's current count).")] = None,
    max_new_tokens: MaxNewOpt = 128,
    draft_tokens: DraftTokensOpt = "device",
    draft_schedule: ScheduleOpt = None,
    draft_confidence: ConfidenceOpt = None,
    deterministic: DeterministicOpt = False,
    verify_window: VerifyWindowOpt = 32,
    device: DeviceOpt = "auto",
    draft_device: DraftDeviceOpt = None,
    dtype: DtypeOpt = "auto",
    draft_quant: DraftQuantOpt = "auto",
    target_quant: TargetQuantOpt = "auto",
    compile: CompileOpt = "auto",
    temperature: TemperatureOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    seed: SeedOpt = None,
    branching: BranchingOpt = "2,2,1",
    beam_width: BeamWidthOpt = 3,
    depth: DepthOpt = 4,
    batch_sizes: Annotated[Optional[str], typer.Option(
        "--batch-sizes", help="Throughput mode: decode the whole prompt set at each batch size (comma list, "
                              "e.g. 1,4,8) per method, with deterministic mode off and on.")] = None,
    verify_windows: Annotated[Optional[str], typer.Option(
        "--verify-windows", help="Throughput mode: deterministic cells at these windows (e.g. 8,16,32,64); "
                                 "default: --verify-window when --deterministic is given.")] = None,
    json_file: Annotated[Optional[Path], typer.Option(
        "--json", help="Write the environment, settings, every measurement and the summary as JSON.")] = None,
    csv_file: Annotated[Optional[Path], typer.Option(
        "--csv", help="Write one CSV row per measurement.")] = None,
    plot_file: Annotated[Optional[Path], typer.Option(
        "--plot", help="Draw speed-up and tokens per target forward to a PNG (needs matplotlib).")] = None,
) -> None:
    """Measure decoding methods against plain decoding of the target on a prompt set."""
    with user_errors():
        from specgen import bench as bench_mod
        from specgen.options import generation_config

        config = generation_config("plain", max_new_tokens, draft_tokens, temperature, top_k, top_p, seed,
                                   branching, beam_width, depth, deterministic, verify_window,
                                   schedule=draft_schedule, draft_confidence=draft_confidence)
        settings = bench_mod.BenchSettings(config, repeats=repeats, warmup=warmup, threads=threads)
        names = bench_mod.parse_methods(methods)
        bench_mod.check_settings(names, config)
        if plot_file is not None:
            require_matplotlib()  # before a long run, not after it
        items = bench_mod.load_prompts(prompts, limit)
        sizes = parse_list(batch_sizes, "--batch-sizes")
        windows = parse_list(verify_windows, "--verify-windows")
        if windows and not sizes:
            sizes = [1]
        if sizes:
            windows = windows or ([verify_window] if deterministic else [])
            if any(w < 2 for w in windows):
                raise ConfigError("--verify-windows values must be >= 2")
            if csv_file is not None or plot_file is not None:
                raise ConfigError("--csv and --plot report the per-prompt bench; with --batch-sizes use --json")
            check_outputs({"--json": json_file})
            _throughput(names, items, replace(config, deterministic=False), sizes, windows,
                        target, draft, device, draft_device, (dtype, draft_quant, compile, target_quant), json_file, threads)
            return
        check_outputs({"--json": json_file, "--csv": csv_file, "--plot": plot_file})  # before, not after, the run
        result = _measure(bench_mod, names, items, settings,
                          target, draft, device, draft_device, (dtype, draft_quant, compile, target_quant))
        written = _report(result, json_file, csv_file, plot_file)
        if not written:
            raise typer.Exit(1)
        if result.interrupted:
            raise typer.Exit(130)


def parse_list(text, what):
    from specgen.bench_batch import parse_sizes

    return parse_sizes(text, what)


def _throughput(names, items, config, sizes, windows, target, draft, device, draft_device, dtype_and_quant, json_file,
                threads=None):
    from rich.console import Console

    from specgen import bench as bench_mod
    from specgen import bench_batch, session

    names = [n for n in names if n in {m.value for m in Method}]
    err = Console(stderr=True, highlight=False)
    load_as = Method.CHAIN if any(Method(n).needs_draft_model for n in names) else Method.PLAIN
    pair = session.load(session.ModelSettings(target, draft, device, draft_device, *dtype_and_quant), load_as,
                        quiet=not err.is_terminal)
    prompts = [bench_mod.encode(pair.target.tokenizer, item) for item in items]
    modes = ["off"] + [f"window {w}" for w in windows]
    err.print(f"bench throughput: {len(prompts)} prompts x methods {', '.join(names)} x batch sizes "
              f"{sizes} x modes {modes}", style="dim", markup=False)

    def progress(cell):
        err.print(f"{cell.method} b{cell.batch_size} {cell.mode}: "
                  + (cell.skipped or f"{cell.tokens_per_second:.2f} tok/s"), style="dim", markup=False)

    with bench_mod.fixed_threads(threads) as used:
        cells = bench_batch.run_throughput(pair, names, prompts, config, sizes, windows, on_cell=progress)
    interrupted = any(c.interrupted for c in cells)
    title = (f"specgen bench --batch-sizes · {pair.target.name}"
             + (f" + {pair.draft.name}" if pair.draft else "") + f" · {len(prompts)} prompts · "
             f"{config.max_new_tokens} new tokens · {'greedy' if config.sampling.greedy else 'sampling'}"
             + (" · INTERRUPTED" if interrupted else ""))
    Console(highlight=False, width=None if sys.stdout.isatty() else 160).print(bench_batch.table(cells, title))
    if json_file is not None:
        env = bench_mod.environment(pair, used)
        data = {"schema": "specgen-bench-throughput/1", "environment": env, "interrupted": interrupted,
                "settings": {"prompts": [i.id for i in items], "batch_sizes": sizes, "windows": windows,
                             **{k: v for k, v in asdict(config).items() if k != "method"}},
                "cells": [asdict(c) for c in cells]}
        text = json.dumps(data, indent=1, default=str) + "\n"
        if not _save("--json", json_file, lambda path: _write_text(path, text), fallback=True):
            raise typer.Exit(1)
    if interrupted:
        raise typer.Exit(130)


def _measure(bench_mod, names, items, settings, target, draft, device, draft_device, dtype_and_quant):
    from rich.console import Console

    from specgen import session
    from specgen.config import Method

    err = Console(stderr=True, highlight=False)
    model_settings = session.ModelSettings(target, draft, device, draft_device, *dtype_and_quant)
    load_as = Method.CHAIN if bench_mod.needs_draft(names) else Method.PLAIN
    pair = session.load(model_settings, load_as, quiet=not err.is_terminal)
    generation, chosen = session.resolve_draft_length(pair, settings.generation, drafts=True)
    settings = replace(settings, generation=generation)
    if chosen is not None:
        err.print(f"bench: draft length k={chosen.k} for this device ({chosen.reason})", style="dim", markup=False)
    total = len(items) * settings.repeats * len(names)
    err.print(f"bench: {len(items)} prompts x {settings.repeats} repeats x {len(names)} methods "
              f"({', '.join(names)}) = {total} generations", style="dim", markup=False)
    if err.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, transient=True) as progress:
            task = progress.add_task("measuring", total=total)

            def tick(m):
                progress.update(task, advance=1, description=escape(f"{m.prompt_id} · {m.method}"))

            return _noted(bench_mod.run_bench(pair, names, items, settings, on_measurement=tick), chosen)
    per_prompt = settings.repeats * len(names)
    done = [0]

    def line(m):
        done[0] += 1
        if done[0] % per_prompt == 0:
            err.print(f"measured {done[0] // per_prompt}/{len(items)}: {m.prompt_id}", style="dim", markup=False)

    return _noted(bench_mod.run_bench(pair, names, items, settings, on_measurement=line), chosen)


def _noted(result, chosen):
    """Record how the draft length was chosen (JSON settings, table title)."""
    result.settings["draft_tokens_choice"] = f"device default: {chosen.reason}" if chosen else "given"
    return result


def _report(result, json_file, csv_file, plot_file) -> bool:
    """The table, then each file; one that fails does not stop the others. False if any failed."""
    from rich.console import Console

    Console(highlight=False, width=None if sys.stdout.isatty() else 160).print(table(result))
    ok = True
    for option, path, write in (("--json", json_file, write_json), ("--csv", csv_file, write_csv),
                                ("--plot", plot_file, write_plot)):
        if path is not None:  # the format comes from the real name: the temporary file's is .tmp
            kind = {"kind": _plot_kind(path)} if option == "--plot" else {}
            ok &= _save(option, path, lambda p, write=write, kind=kind: write(result, p, **kind),
                        fallback=option != "--plot")
    return ok


# -- output files ----------------------------------------------------------------------------
def check_outputs(paths: dict) -> None:
    """Fail before minutes of measuring if an output file cannot be written: its folder is made
    (as the writers would) and must take a file, the path must not be a folder, and no two
    options may name the same file."""
    seen: dict[Path, str] = {}
    for option, path in paths.items():
        if path is None:
            continue
        path = Path(path)
        key = path.expanduser().resolve()
        if key in seen:
            raise ConfigError(f"{seen[key]} and {option} both name {path}; give them different files")
        seen[key] = option
        if path.is_dir():
            raise ConfigError(f"{option} {path} is a directory; give a file name")
        if option == "--plot":
            _check_plot_format(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # os.access says yes to root even on a read-only mount; only a real write tells
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"):
                pass
        except OSError as exc:
            raise ConfigError(f"cannot write {option} {path}: {exc.strerror or exc}") from None


def _plot_kind(path) -> str:
    """The image format named by the file's extension; png without one."""
    return Path(path).suffix.lstrip(".").lower() or "png"


def _check_plot_format(path: Path) -> None:
    from matplotlib.figure import Figure

    kinds = Figure().canvas.get_supported_filetypes()
    kind = _plot_kind(path)
    if kind not in kinds:
        raise ConfigError(f"--plot {path}: matplotlib cannot write '.{kind}' files; use one of: "
                          + ", ".join(f".{k}" for k in sorted(kinds)))


def _atomic(path: Path, write) -> None:
    """`write(tmp)` to a temporary file beside `path`, then rename it over `path`: a failed or
    interrupted write never leaves a truncated report behind."""
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600; a report gets the usual permissions
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_text(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")


def _save(option: str, path: Path, write, fallback: bool) -> bool:
    """Write one output; on failure say so in one line and, for data files, where the data went
    instead (a file in the temp directory). True if `path` was written."""
    from rich.console import Console

    from specgen.options import error_line

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic(path, write)
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
        where = ""
        if fallback:
            try:
                handle, spare = tempfile.mkstemp(prefix="specgen-bench-", suffix=path.suffix or ".out")
                os.close(handle)
                write(Path(spare))
                where = f"; the data went to {spare} instead"
            except (OSError, ValueError):
                where = "; no copy could be written either, only the table above is left"
        error_line(f"cannot write {option} {path}: {reason}{where}")
        return False
    Console(stderr=True, highlight=False).print(f"wrote {path}", style="dim", markup=False)
    return True


# -- reports ---------------------------------------------------------------------------------
def to_json(result) -> dict:
    return {
        "schema": "specgen-bench/1",
        "environment": result.environment,
        "settings": result.settings,
        "methods": result.methods,
        "interrupted": result.interrupted,
        "summary": [asdict(g) for g in result.summary],
        "prompts": [asdict(p) for p in result.prompts],
        "measurements": [asdict(m) for m in result.measurements],
    }


def write_json(result, path: Path) -> None:
    """Indented, except that each per-prompt record and measurement sits on one line."""
    data = to_json(result)
    parts = []
    for key, value in data.items():
        if key in ("prompts", "measurements"):
            rows = ",\n  ".join(json.dumps(v) for v in value)
            parts.append(f' {json.dumps(key)}: [\n  {rows}\n ]' if value else f' {json.dumps(key)}: []')
        else:
            parts.append(f" {json.dumps(key)}: " + json.dumps(value, indent=1).replace("\n", "\n "))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{\n" + ",\n".join(parts) + "\n}\n", encoding="utf-8")


CSV_COLUMNS = [
    "prompt_id", "category", "method", "repeat", "prompt_tokens", "new_tokens", "seconds",
    "prefill_seconds", "ttft_seconds", "tokens_per_second", "decode_tokens_per_second",
    "acceptance_rate", "tokens_per_target_forward", "target_forwards", "drafted", "accepted",
    "accepted_length_histogram", "draft_seconds", "verify_seconds", "peak_memory_bytes",
    "stop_reason", "identical_to_plain", "speedup_prompt", "token_ids",
]


def histogram_text(histogram: dict[str, int] | None) -> str:
    """{"0": 3, "4": 12} -> "0:3 4:12" (accepted length : rounds)."""
    return "" if not histogram else " ".join(f"{k}:{v}" for k, v in histogram.items())


def write_csv(result, path: Path) -> None:
    """One row per measurement; the per-prompt exactness and speed-up are repeated on its rows."""
    by_prompt = {(p.prompt_id, p.method): p for p in result.prompts}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for m in result.measurements:
            row = asdict(m)
            summary = by_prompt[(m.prompt_id, m.method)]
            row["accepted_length_histogram"] = histogram_text(m.accepted_length_histogram)
            row["token_ids"] = " ".join(map(str, m.token_ids))
            row["identical_to_plain"] = summary.identical_to_plain
            row["speedup_prompt"] = summary.speedup
            writer.writerow({k: "" if row.get(k) is None else row[k] for k in CSV_COLUMNS})


def require_matplotlib() -> None:
    from specgen.errors import ConfigError

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib, which is not installed",
                          hint="pip install 'specgen[plot]' or pip install matplotlib") from None


def write_plot(result, path: Path, kind: str | None = None) -> None:
    """Two panels, speed-up over plain (geometric mean) and tokens per target forward: bars per
    method, grouped by category (`all` first)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = list(dict.fromkeys(g.category for g in result.summary))
    methods = [m for m in result.methods if m != "plain"]
    cells = {(g.method, g.category): g for g in result.summary}
    width = 0.8 / max(len(methods), 1)
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 1.2 * len(categories) + 3), 7.5), sharex=True)
    for panel, (attr, label) in zip(axes, [("speedup", "speed-up over plain (geo mean)"),
                                           ("tokens_per_target_forward", "tokens per target forward")]):
        for i, method in enumerate(methods):
            values = [getattr(cells[(method, c)], attr) if (method, c) in cells else None for c in categories]
            xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(categories))]
            panel.bar(xs, [v or 0.0 for v in values], width, label=method)
        panel.axhline(1.0, color="black", linewidth=0.8)
        panel.set_ylabel(label)
    axes[1].set_xticks(range(len(categories)), categories, rotation=20, ha="right")
    env = result.environment
    draft = env["draft"]["name"] if env.get("draft") else "-"
    fig.suptitle(f"{env['target']['name']} / {draft} · {env['target']['dtype']} · "
                 f"threads={env['torch_threads']}", fontsize="medium")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=min(len(methods), 4),
               fontsize="small", frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, format=kind or _plot_kind(path))
    plt.close(fig)


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def table(result):
    """Per method: the `all` row (bold), then one row per category."""
    from rich.table import Table

    env, s = result.environment, result.settings
    title = (f"specgen bench · {env['target']['name']}"
             + (f" + {env['draft']['name']}" if env.get("draft") else "")
             + f" · {env['target']['dtype']}"
             + (f" + int8 linears" if env['target'].get('weights') == "int8" else "")
             + (f" ({env['cpu_format']['reason']})" if env.get("cpu_format") and env['target']['device'] == "cpu"
                and env['cpu_format']['dtype'] == env['target']['dtype']
                else "")
             + f" · threads={env['torch_threads']} · k={s['draft_tokens']}"
             + (" (device default)" if str(s.get("draft_tokens_choice", "")).startswith("device") else "")
             + (f", stop below {s['draft_confidence']:g}" if s.get("draft_confidence") else "")
             + " · "
             f"{'greedy' if result.greedy else 'sampling'} · {s['max_new_tokens']} new tokens · "
             f"median of {s['repeats']}" + (" · INTERRUPTED" if result.interrupted else ""))
    warm = s.get("warmup_seconds") or {}
    caption = ("warm-up (compilation, capture; not in any figure): "
               + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in warm.items())) if warm else None
    t = Table(title=escape(title), title_justify="left", header_style="bold",
              caption=escape(caption) if caption else None, caption_justify="left")
    for name in ("method", "category", "prompts", "tok/s", "speed-up", "range", "acceptance",
                 "tok/fwd", "TTFT s", "draft share", "identical"):
        t.add_column(name, justify="left" if name in ("method", "category") else "right")
    rows = result.summary
    for i, g in enumerate(rows):
        first = g.category == "all"
        identical = "–" if g.identical is None or g.method == "plain" else f"{g.identical}/{g.compared}"
        busy = (g.draft_seconds or 0.0) + (g.verify_seconds or 0.0)
        share = _fmt(g.draft_seconds / busy if g.draft_seconds is not None and busy else None, ".0%")
        spread = ("–" if g.speedup_min is None or g.method == "plain"
                  else f"{g.speedup_min:.2f}-{g.speedup_max:.2f}")
        last = i + 1 == len(rows) or rows[i + 1].method != g.method
        t.add_row(escape(g.method) if first else "", escape(g.category), str(g.prompts), _fmt(g.tokens_per_second, ".1f"),
                  _fmt(g.speedup, ".2f", "x"), spread, _fmt(g.acceptance_rate, ".0%"),
                  _fmt(g.tokens_per_target_forward, ".2f"), _fmt(g.ttft_seconds, ".2f"), share, identical,
                  style="bold" if first else None, end_section=last)
    return t
