"""`specgen bench`: options -> settings (every one checked before a model loads) -> one
measurement run -> a table and files. The measuring is in specgen/bench/measure.py, the reports
in specgen/bench/report.py; no tensor code here.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import threading
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specgen.bench import report
from specgen.bench.html import write_html
from specgen.cli.options import user_errors, with_options
from specgen.config import GenerationConfig, Method, ModelSettings
from specgen.errors import ConfigError
from specgen.status import error_line, note

REFERENCE_METHODS = "hf-assisted,hf-assisted-k4,hf-lookup"  # see specgen/bench/references.py
DEFAULT_METHODS = ",".join(m.value for m in Method if m is not Method.EAGLE) + "," + REFERENCE_METHODS


@with_options(defaults={"max_new_tokens": 128}, fixed={"method": "plain"})
def bench(
    *,
    models: ModelSettings,
    methods: Annotated[
        Optional[str],
        typer.Option(
            "--methods",
            help=f"Comma list of methods (default: all of them, {DEFAULT_METHODS}). "
            "plain is always measured: it is the denominator of every speed-up.",
        ),
    ] = None,
    prompts: Annotated[
        str,
        typer.Option(
            "--prompts",
            "-p",
            help="A prompt set in prompts/ by name (quick, code-generation, ...), "
            "'all' (every category set), or a JSONL file: each line an object with 'id', "
            "'category' and 'prompt' (text) or 'messages' (a conversation).",
        ),
    ] = "quick",
    limit: Annotated[
        Optional[int], typer.Option("--limit", help="Keep the first N prompts of each prompt file.")
    ] = None,
    repeats: Annotated[
        int,
        typer.Option(
            "--repeats",
            "-r",
            help="Runs per prompt and method; the report uses medians. With --concurrency: runs per cell, in "
            "alternating order, pooled.",
        ),
    ] = 1,
    warmup: Annotated[
        bool, typer.Option("--warmup/--no-warmup", help="One short generation per method before measuring.")
    ] = True,
    generation: GenerationConfig,
    batch_sizes: Annotated[
        Optional[str],
        typer.Option(
            "--batch-sizes",
            help="Throughput mode: decode the whole prompt set at each batch size (comma list, "
            "e.g. 1,4,8) per method, with deterministic mode off and on.",
        ),
    ] = None,
    concurrency: Annotated[
        Optional[str],
        typer.Option(
            "--concurrency",
            help="Server mode: drive an HTTP server on the pair with these numbers of concurrent "
            "streaming clients (comma list, e.g. 1,2,4,8) per method; aggregate tok/s, TTFT and "
            "time per token, speculative vs plain.",
        ),
    ] = None,
    per_client: Annotated[
        int,
        typer.Option(
            "--requests-per-client", help="Server mode: requests each client sends, one after another."
        ),
    ] = 2,
    max_batch: Annotated[
        int, typer.Option("--max-batch-size", help="Server mode: the server's batch width.")
    ] = 16,
    verify_windows: Annotated[
        Optional[str],
        typer.Option(
            "--verify-windows",
            help="Throughput mode: deterministic cells at these windows (e.g. 8,16,32,64); "
            "default: --verify-window when --deterministic is given.",
        ),
    ] = None,
    json_file: Annotated[
        Optional[Path],
        typer.Option(
            "--json", help="Write the environment, settings, every measurement and the summary as JSON."
        ),
    ] = None,
    csv_file: Annotated[
        Optional[Path], typer.Option("--csv", help="Write one CSV row per measurement.")
    ] = None,
    plot_file: Annotated[
        Optional[Path],
        typer.Option(
            "--plot", help="Draw speed-up and tokens per target forward to a PNG (needs matplotlib)."
        ),
    ] = None,
    html_file: Annotated[
        Optional[Path],
        typer.Option(
            "--html",
            help="Write a self-contained page: the table, speed-up per method and category with its range, "
            "acceptance per draft position, draft share, first token differing from plain (inline "
            "SVG; nothing else needed).",
        ),
    ] = None,
) -> None:
    """Measure decoding methods against plain decoding of the target on a prompt set."""
    with user_errors():
        # the measuring modules import torch and transformers: only once the command runs
        from specgen.bench import llamacpp, measure, throughput
        from specgen.bench import methods as registry
        from specgen.bench import prompts as prompt_sets

        settings = measure.BenchSettings(generation, repeats=repeats, warmup=warmup, threads=models.threads)
        names = registry.parse_methods(methods)
        llamacpp.refuse_early(names, models.target)
        registry.check_settings(names, generation)
        if plot_file is not None:
            report.require_matplotlib()  # before a long run, not after it
        items = prompt_sets.load_prompts(prompts, limit)
        sizes = throughput.parse_sizes(batch_sizes, "--batch-sizes")
        windows = throughput.parse_sizes(verify_windows, "--verify-windows")
        implied = bool(windows and not sizes)
        if implied:
            sizes = [1]
        levels = throughput.parse_sizes(concurrency, "--concurrency")
        outputs = {"--json": json_file, "--csv": csv_file, "--plot": plot_file, "--html": html_file}
        report.check_not_read(outputs, prompt_sets.prompt_files(prompts))
        named = methods is not None
        if levels:
            names = _check_concurrency(names, bool(sizes or windows), outputs, per_client, max_batch, named)
            _concurrency(
                names,
                items,
                generation,
                levels,
                per_client,
                max_batch,
                models,
                json_file,
                models.threads,
                repeats,
                named=named,
            )
        elif sizes:
            names, windows = _check_throughput(names, generation, windows, outputs, named, repeats)
            if implied:  # once the settings are known good: an error stays one line
                note("bench: --verify-windows measures throughput cells (--batch-sizes 1 unless given)")
            _throughput(
                names,
                items,
                replace(generation, deterministic=False),
                sizes,
                windows,
                models,
                json_file,
                models.threads,
                named=named,
            )
        else:
            _per_prompt(names, items, settings, models, outputs, named)


def _check_concurrency(
    names, throughput_asked: bool, outputs: dict, per_client: int, max_batch: int, named: bool
) -> list[str]:
    """bench --concurrency's settings, before anything loads."""
    from specgen.bench.concurrency import speculative  # torch: see bench()

    if throughput_asked or any(outputs[option] is not None for option in ("--csv", "--plot", "--html")):
        raise ConfigError(
            "--concurrency reports its own cells; it takes --json, not --batch-sizes, "
            "--verify-windows, --csv, --plot or --html"
        )
    if per_client < 1:
        raise ConfigError(f"--requests-per-client must be >= 1, got {per_client}")
    if not 1 <= max_batch <= 256:  # the server's own bound (serve --max-batch-size)
        raise ConfigError(f"--max-batch-size must be in 1..256, got {max_batch}")
    # the default list: specgen's own methods only (transformers' and llama.cpp's run no server)
    if not named:
        names = [n for n in names if n in {m.value for m in Method}]
    for name in names:
        speculative(name)  # a named method that is not specgen's: one line, before anything loads
    report.check_outputs({"--json": outputs["--json"]})
    return names


def _check_throughput(
    names, config, windows: list[int], outputs: dict, named: bool, repeats: int = 1
) -> tuple[list[str], list[int]]:
    """bench --batch-sizes's settings, before anything loads: the engine methods it measures and
    its deterministic windows (--verify-window's when --deterministic is given and none are)."""
    windows = windows or ([config.verify_window] if config.deterministic else [])
    engine_names = {m.value for m in Method}
    for window in windows:  # each deterministic cell's settings, before any model loads
        if window < 2:
            raise ConfigError("--verify-windows values must be >= 2")
        for name in [n for n in names if n in engine_names] or [config.method.value]:
            replace(config, method=Method(name), deterministic=True, verify_window=window)
    if any(outputs[option] is not None for option in ("--csv", "--plot", "--html")):
        raise ConfigError(
            "--csv, --plot and --html report the per-prompt bench; with --batch-sizes use --json"
        )
    if repeats > 1:
        raise ConfigError(
            "--batch-sizes runs each cell once; --repeats is for the per-prompt and --concurrency modes"
        )
    report.check_outputs({"--json": outputs["--json"]})
    other = [n for n in names if n not in engine_names]
    if other and named:
        raise ConfigError(
            f"--batch-sizes measures specgen's own methods (no variants, @DRAFT columns or "
            f"references); '{other[0]}' is not one"
        )
    return [n for n in names if n in engine_names], windows


def _per_prompt(names, items, settings, models: ModelSettings, outputs: dict, named: bool) -> None:
    """The per-prompt bench: measured, then the table and each file; the exit status says what failed."""
    report.check_outputs(outputs)  # before the run
    result = _measure(names, items, settings, models, named=named)
    if not _report(result, outputs):
        raise typer.Exit(1)
    if result.interrupted:
        raise typer.Exit(130)
    if result.failures:  # everything measured is written; the run still did not do all it was asked
        error_line(
            f"{len(result.failures)} of {len(result.methods)} columns failed: "
            + "; ".join(f"{f.method}: {f.error}" for f in result.failures)[:400]
        )
        raise typer.Exit(1)


def _throughput(
    names, items, config, sizes, windows, models: ModelSettings, json_file, threads=None, named: bool = True
):
    # torch: see bench()
    from specgen.bench import measure, throughput
    from specgen.bench import methods as registry
    from specgen.bench import prompts as prompt_sets
    from specgen.decoding.build import resolve_draft_length
    from specgen.runtime.pair import load

    err = Console(emoji=False, stderr=True, highlight=False)
    load_as = Method.CHAIN if any(Method(n).needs_draft_model for n in names) else Method.PLAIN
    pair = load(models, load_as, quiet=not err.is_terminal)
    names = _runnable(registry, pair, names, named, err)
    config, k = resolve_draft_length(pair, config, drafts=True)  # the k the per-prompt bench and `run` use
    if k is not None:
        err.print(f"bench: draft length k={k.k} for this device ({k.reason})", style="dim", markup=False)
    prompts = prompt_sets.encode_all(pair.target.tokenizer, items, pair.target.context_length)
    modes = ["off"] + [f"window {w}" for w in windows]
    err.print(
        f"bench throughput: {len(prompts)} prompts x methods {', '.join(names)} x batch sizes "
        f"{sizes} x modes {modes}",
        style="dim",
        markup=False,
    )

    def progress(cell):
        err.print(
            f"{cell.method} b{cell.batch_size} {cell.mode}: "
            + (cell.skipped or f"{cell.wall_tokens_per_second:.2f} tok/s"),
            style="dim",
            markup=False,
        )

    with measure.fixed_threads(threads) as used:
        cells = throughput.run_throughput(pair, names, prompts, config, sizes, windows, on_cell=progress)
    interrupted = any(c.interrupted for c in cells)
    title = (
        f"specgen bench --batch-sizes · {pair.target.name}"
        + (f" + {pair.draft.name}" if pair.draft else "")
        + f" · {len(prompts)} prompts · "
        f"{config.max_new_tokens} new tokens · {'greedy' if config.sampling.greedy else 'sampling'}"
        + (" · INTERRUPTED" if interrupted else "")
    )
    Console(emoji=False, highlight=False, width=None if sys.stdout.isatty() else 160).print(
        throughput.table(cells, title)
    )
    if json_file is not None:
        _write_throughput(
            json_file, measure.environment(pair, used), items, sizes, windows, config, cells, interrupted
        )
    if interrupted:
        raise typer.Exit(130)
    failed = [c for c in cells if c.failed]
    if failed:  # the table and the JSON hold every cell; the run still did not do all it was asked
        error_line(
            f"{len(failed)} of {len(cells)} cells failed: {failed[0].method} b{failed[0].batch_size} "
            f"{failed[0].mode}: {failed[0].skipped}"[:400]
        )
        raise typer.Exit(1)


def _runnable(registry, pair, names: list[str], named: bool, err, drafts=None) -> list[str]:
    """The columns this pair can run: a named one it cannot is a ConfigError before anything is
    measured; from the default list it is left out, with a line."""
    unfit = {n: why for n in names if (why := registry.unsupported(pair, n, drafts))}
    if unfit and named:
        raise ConfigError(next(iter(unfit.values())), hint="leave it out of --methods")
    for why in unfit.values():
        err.print(f"bench: left out {why}", style="dim", markup=False)
    return [n for n in names if n not in unfit]


def _concurrency(
    names,
    items,
    config,
    levels,
    per_client,
    max_batch,
    models: ModelSettings,
    json_file,
    threads=None,
    repeats: int = 1,
    named: bool = True,
):
    """Start a server on the loaded pair (this process, a free port), drive it, stop it, report."""
    # torch: see bench()
    from specgen.bench import concurrency, measure
    from specgen.bench import methods as registry
    from specgen.bench import prompts as prompt_sets
    from specgen.runtime.pair import load

    err = Console(emoji=False, stderr=True, highlight=False)
    load_as = Method.CHAIN if any(Method(n.split("/")[0]).needs_draft_model for n in names) else Method.PLAIN
    pair = load(models, load_as, quiet=not err.is_terminal)
    names = _runnable(registry, pair, names, named, err)
    law = config.sampling
    sampling = (
        concurrency.GREEDY
        if law.greedy
        else {"temperature": law.temperature, "top_p": law.top_p, "top_k": law.top_k, "seed": law.seed}
    )
    prompts = [item.chat() for item in items]
    prompt_sets.encode_all(
        pair.target.tokenizer, items, pair.target.context_length
    )  # each fits, before the server starts

    def progress(cell):
        err.print(
            f"{cell.concurrency} clients · {cell.method}: {cell.wall_tokens_per_second:.1f} tok/s"
            + (f" ({len(cell.errors)} errors)" if cell.errors else ""),
            style="dim",
            markup=False,
        )

    with (
        measure.fixed_threads(threads) as used,
        _serving(models, pair, config, levels, max_batch, err) as running,
    ):
        info = running.state.info
        cells, interrupted = concurrency.run_concurrency(
            info["url"],
            running.token,
            info["model"],
            prompts,
            names,
            levels,
            per_client,
            config.max_new_tokens,
            progress,
            repeats,
            sampling,
        )
    learned = _learned(running.scheduler)
    if learned:
        err.print(
            "plain step measured by batch width (the rows' floors): "
            + ", ".join(f"{w}:{seconds * 1000:.0f} ms" for w, seconds in learned.items()),
            style="dim",
            markup=False,
        )
    title = (
        f"specgen bench --concurrency · {pair.target.name}"
        + (f" + {pair.draft.name}" if pair.draft else "")
        + f" · {len(prompts)} prompts · {per_client} requests per client"
        + (f" · {repeats} runs per cell, interleaved" if repeats > 1 else "")
        + f" · {config.max_new_tokens} new "
        f"tokens · {'greedy' if law.greedy else f'temperature {law.temperature}'} · batch up to {max_batch}"
        + (" · INTERRUPTED" if interrupted else "")
    )
    Console(emoji=False, highlight=False, width=None if sys.stdout.isatty() else 160).print(
        concurrency.table(cells, title)
    )
    if json_file is not None:
        _write_json(
            json_file,
            {
                "schema": "specgen-bench-concurrency/1",
                "environment": measure.environment(pair, used),
                "interrupted": interrupted,
                "settings": {
                    "prompts": [i.id for i in items],
                    "levels": levels,
                    "requests_per_client": per_client,
                    "repeats": repeats,
                    "max_tokens": config.max_new_tokens,
                    "max_batch_size": max_batch,
                    "sampling": sampling,
                    "width_caps": {str(w): k for w, k in running.scheduler.caps.items()},
                },
                "learned": learned,
                "cells": [c.record() for c in cells],
            },
        )
    if interrupted:
        raise typer.Exit(130)
    failed = [c for c in cells if c.errors]
    if failed:  # written above; a cell whose requests failed does not measure what it says
        error_line(
            f"{sum(len(c.errors) for c in failed)} requests failed in {len(failed)} cells: "
            f"{failed[0].method} at {failed[0].concurrency} clients: {failed[0].errors[0]}"[:400]
        )
        raise typer.Exit(1)


@contextlib.contextmanager
def _serving(models: ModelSettings, pair, config, levels, max_batch: int, err):
    """A server on the loaded pair in this process, on a free port, stopped on the way out."""
    from specgen.serve.server import ServeOptions, prepare  # torch: see bench()

    running = prepare(
        models,
        ServeOptions(
            port=0,
            max_batch_size=max_batch,
            max_queue=max(levels) * 4,
            max_tokens=config.max_new_tokens,
            prefix_cache=0,
        ),
        quiet=True,
        pair=pair,
        log=io.StringIO(),
    )
    server = threading.Thread(target=running.serve_until_stopped, daemon=True)
    server.start()
    caps = running.scheduler.caps
    err.print(
        f"bench concurrency: server at {running.state.info['url']}; draft length by batch width: "
        + (", ".join(f"{w}:{k}" for w, k in caps.items()) or "as requested"),
        style="dim",
        markup=False,
    )
    try:
        yield running
    finally:
        running.should_exit = True
        server.join(timeout=30)


def _learned(scheduler) -> dict:
    """Per batch width, the seconds of a plain round the server's engine measured: what each
    row's drafting was compared against (decoding/floor.py)."""
    engine = scheduler.engine
    if engine is None:
        return {}
    return {str(w): seconds for w in sorted(engine.plain.widths) if (seconds := engine.plain.seconds(w))}


def _write_throughput(json_file, env, items, sizes, windows, config, cells, interrupted) -> None:
    _write_json(
        json_file,
        {
            "schema": "specgen-bench-throughput/1",
            "environment": env,
            "interrupted": interrupted,
            "settings": {
                "prompts": [i.id for i in items],
                "batch_sizes": sizes,
                "windows": windows,
                **{k: v for k, v in asdict(config).items() if k != "method"},
            },
            "cells": [c.record() for c in cells],
        },
    )


def _write_json(json_file, data: dict) -> None:
    """--json of the throughput and concurrency modes (atomically, a spare file if it fails)."""
    text = json.dumps(data, indent=1, default=str) + "\n"
    if not report.save(
        "--json", json_file, lambda path: path.write_text(text, encoding="utf-8"), fallback=True
    ):
        raise typer.Exit(1)


def _measure(names, items, settings, models: ModelSettings, named: bool = True):
    from specgen.bench import measure  # torch: see bench()
    from specgen.bench import methods as registry
    from specgen.decoding.build import resolve_draft_length
    from specgen.runtime.pair import load, load_draft_alone

    err = Console(emoji=False, stderr=True, highlight=False)
    load_as = Method.CHAIN if registry.needs_draft(names) else Method.PLAIN
    pair = load(models, load_as, quiet=not err.is_terminal)
    drafts = {}
    for name in registry.extra_drafts(names):  # METHOD@DRAFT columns: each other draft once, with its own k
        model = load_draft_alone(replace(models, draft=name), pair.target, quiet=not err.is_terminal)
        own, choice = resolve_draft_length(replace(pair, draft=model), settings.generation, drafts=True)
        drafts[name] = registry.ExtraDraft(
            model,
            {}
            if choice is None
            else {"draft_tokens": own.draft_tokens, "draft_confidence": own.draft_confidence},
        )
        if choice is not None:
            err.print(
                f"bench: draft length k={choice.k} with {name} ({choice.reason})", style="dim", markup=False
            )
    asked = names
    names = _runnable(registry, pair, names, named, err, drafts)
    left_out = {
        n: registry.unsupported(pair, n, drafts) for n in asked if n not in names
    }  # the JSON says so too
    generation, k = resolve_draft_length(pair, settings.generation, drafts=True)
    settings = replace(settings, generation=generation)
    if k is not None:
        err.print(f"bench: draft length k={k.k} for this device ({k.reason})", style="dim", markup=False)
    total = len(items) * settings.repeats * len(names)
    err.print(
        f"bench: {len(items)} prompts x {settings.repeats} repeats x {len(names)} methods "
        f"({', '.join(names)}) = {total} generations",
        style="dim",
        markup=False,
    )
    if err.is_terminal:
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err,
            transient=True,
        ) as progress:
            task = progress.add_task("measuring", total=total)

            def tick(m):
                progress.update(task, advance=1, description=escape(f"{m.prompt_id} · {m.method}"))

            result = measure.run_bench(pair, names, items, settings, on_measurement=tick, drafts=drafts)
            return _noted(result, k, left_out)
    # one line per prompt, said when the next prompt starts (a column that failed measures fewer
    # generations per prompt, so counting them would misplace the lines) and after the last
    said: list[str] = []
    current: list = []

    def say(prompt_id):
        said.append(prompt_id)
        err.print(f"measured {len(said)}/{len(items)}: {prompt_id}", style="dim", markup=False)

    def line(m):
        if current and current[0] != m.prompt_id:
            say(current[0])
        current[:] = [m.prompt_id]

    result = measure.run_bench(pair, names, items, settings, on_measurement=line, drafts=drafts)
    if current and current[0] not in said and not result.interrupted:
        say(current[0])
    return _noted(result, k, left_out)


def _noted(result, chosen, left_out: dict):
    """Record how the draft length was chosen (JSON settings, table title), and the default
    list's methods this pair cannot run, each with why."""
    result.settings["draft_tokens_choice"] = f"device default: {chosen.reason}" if chosen else "given"
    result.settings["left_out"] = left_out
    return result


def _report(result, outputs: dict) -> bool:
    """The table, then each file; one that fails does not stop the others. False if any failed."""
    Console(emoji=False, highlight=False, width=None if sys.stdout.isatty() else 160).print(
        report.table(result)
    )
    ok = True
    writers = {
        "--json": report.write_json,
        "--csv": report.write_csv,
        "--plot": report.write_plot,
        "--html": write_html,
    }
    for option, path in outputs.items():
        write = writers[option]
        if path is not None:  # the format comes from the real name: the temporary file's is .tmp
            kind = {"kind": report.plot_kind(path)} if option == "--plot" else {}
            ok &= report.save(
                option,
                path,
                lambda p, write=write, kind=kind: write(result, p, **kind),
                fallback=option != "--plot",
            )
    return ok
