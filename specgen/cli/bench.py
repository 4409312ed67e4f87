"""`specgen bench`: the per-prompt bench (options -> settings, every one checked before a model
loads -> one measurement run -> a table and files), and the command group that holds `bench
batch` (cli/bench_batch.py) and `bench serve` (cli/bench_serve.py). Bench's old spellings of
those, `bench --batch-sizes`/`--verify-windows` and `bench --concurrency`, still run them. The
measuring is in specgen/bench/measure.py, the reports in specgen/bench/report.py and table.py; no tensor code.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specgen.bench import report, table
from specgen.bench.html import write_html
from specgen.cli.bench_batch import batch, run_batch
from specgen.cli.bench_options import (
    JsonOpt,
    LimitOpt,
    MethodsOpt,
    PromptsOpt,
    measuring,
    method_names,
    print_table,
    prompt_set,
    refuse_before_load,
    runnable,
    stderr,
)
from specgen.cli.bench_serve import run_serve, serve
from specgen.cli.options import user_errors
from specgen.config import GenerationConfig, Method, ModelSettings
from specgen.errors import ConfigError
from specgen.status import error_line

bench_app = typer.Typer(add_completion=False)
bench_app.command("batch")(batch)
bench_app.command("serve")(serve)


@bench_app.callback(invoke_without_command=True, subcommand_metavar="[COMMAND] [ARGS]...")
@measuring
def bench(
    ctx: typer.Context,
    *,
    models: ModelSettings,
    methods: MethodsOpt = None,
    prompts: PromptsOpt = "quick",
    limit: LimitOpt = None,
    repeats: Annotated[
        int,
        typer.Option(
            "--repeats",
            "-r",
            help="Runs per prompt and method, methods in alternating order (an even count cancels steady "
            "drift); the report uses medians.",
        ),
    ] = 1,
    warmup: Annotated[
        bool, typer.Option("--warmup/--no-warmup", help="One short generation per method before measuring.")
    ] = True,
    generation: GenerationConfig,
    json_file: JsonOpt = None,
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
    # the old spellings of `bench batch` and `bench serve` (_old_spelling)
    batch_sizes: Annotated[Optional[str], typer.Option("--batch-sizes", hidden=True)] = None,
    verify_windows: Annotated[Optional[str], typer.Option("--verify-windows", hidden=True)] = None,
    concurrency: Annotated[Optional[str], typer.Option("--concurrency", hidden=True)] = None,
    per_client: Annotated[int, typer.Option("--requests-per-client", hidden=True)] = 2,
    max_batch: Annotated[int, typer.Option("--max-batch-size", hidden=True)] = 16,
) -> None:
    """Measure decoding methods against plain decoding of the target on a prompt set.

    Per prompt, every method interleaved with plain, medians over --repeats. `specgen bench batch`
    measures throughput per batch size, `specgen bench serve` a server under concurrent clients.
    """
    if ctx.invoked_subcommand is not None:
        with user_errors():
            _options_after_the_name(ctx)
        return
    with user_errors():
        # the measuring modules import torch and transformers: only once the command runs
        from specgen.bench import measure

        settings = measure.BenchSettings(generation, repeats=repeats, warmup=warmup, threads=models.threads)
        names = method_names(methods, generation, models)
        if plot_file is not None:
            report.require_matplotlib()  # before a long run, not after it
        outputs = {"--json": json_file, "--csv": csv_file, "--plot": plot_file, "--html": html_file}
        items = prompt_set(prompts, limit, outputs)
        named = methods is not None
        old = {"--batch-sizes": batch_sizes, "--verify-windows": verify_windows, "--concurrency": concurrency}
        if not _old_spelling(
            old, names, items, generation, models, outputs, repeats, per_client, max_batch, named
        ):
            _per_prompt(names, items, settings, models, outputs, named)


def _options_after_the_name(ctx: typer.Context) -> None:
    """`bench --methods x batch` would measure batch's default methods: an option given before a
    subcommand's name is refused, in one line that shows where it goes."""
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name)  # typer's own click: its enum, compared by name
        if source is not None and source.name == "COMMANDLINE":
            name = ctx.invoked_subcommand
            raise ConfigError(
                f"{param.opts[0]} goes after the command's name: specgen bench {name} {param.opts[0]} ..."
            )


def _old_spelling(
    old: dict, names, items, generation, models, outputs: dict, repeats, per_client, max_batch, named
) -> bool:
    """Bench's old spellings of `bench serve` (`bench --concurrency`) and `bench batch` (`bench
    --batch-sizes`, `--verify-windows`) run those commands, with a note naming them; what those
    do not take is refused as it was. False when neither is asked."""
    from specgen.bench.throughput import parse_sizes  # torch: see bench()

    throughput = {
        option: parse_sizes(old[option], option) for option in ("--batch-sizes", "--verify-windows")
    }
    levels = parse_sizes(old["--concurrency"], "--concurrency")
    reports = [option for option in ("--csv", "--plot", "--html") if outputs[option] is not None]
    asked = [option for option, values in throughput.items() if values]
    if levels:
        if asked or reports:
            raise ConfigError(
                "--concurrency reports its own cells; it takes --json, not --batch-sizes, "
                "--verify-windows, --csv, --plot or --html"
            )
        run_serve(
            names,
            items,
            generation,
            models,
            old["--concurrency"],
            per_client,
            max_batch,
            outputs["--json"],
            repeats,
            named,
            notes=("bench: `bench --concurrency` is now `specgen bench serve --concurrency`; it still runs",),
        )
        return True
    if not asked:
        return False
    if reports:
        raise ConfigError(
            "--csv, --plot and --html report the per-prompt bench; with --batch-sizes use --json"
        )
    if repeats > 1:
        raise ConfigError(
            "--batch-sizes runs each cell once; --repeats is for the per-prompt bench and bench serve"
        )
    run_batch(
        names,
        items,
        generation,
        models,
        old["--batch-sizes"],
        old["--verify-windows"],
        outputs["--json"],
        named,
        notes=(f"bench: `bench {asked[0]}` is now `specgen bench batch {asked[0]}`; it still runs",),
    )
    return True


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


def _measure(names, items, settings, models: ModelSettings, named: bool = True):
    from specgen.bench import measure  # torch: see bench()
    from specgen.bench import methods as registry
    from specgen.decoding.build import resolve_draft_length
    from specgen.runtime.pair import load, load_draft_alone

    err = stderr()
    load_as = Method.CHAIN if registry.needs_draft(names) else Method.PLAIN
    refuse_before_load(registry, names, named, models.draft)
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
    names = runnable(registry, pair, names, named, err, drafts)
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
    print_table(table.table(result))
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
