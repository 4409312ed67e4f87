"""`specgen bench serve`: a server started on the loaded pair (this process, a free port) and
driven by N concurrent streaming clients per method (specgen/bench/concurrency.py drives it);
every setting checked before a model loads, progress, the table and --json. No tensor code here."""

from __future__ import annotations

import contextlib
import io
import threading
from typing import Annotated, Optional

import typer

from specgen.bench import report
from specgen.cli.bench_options import (
    JsonOpt,
    LimitOpt,
    MethodsOpt,
    PromptsOpt,
    check_repeats,
    measuring,
    method_names,
    pair_name,
    print_table,
    prompt_set,
    refuse_before_load,
    runnable,
    stderr,
    write_json,
)
from specgen.cli.options import user_errors
from specgen.config import GenerationConfig, Method, ModelSettings
from specgen.errors import ConfigError
from specgen.status import error_line, note

ConcurrencyOpt = Annotated[
    Optional[str],
    typer.Option(
        "--concurrency",
        help="Numbers of concurrent streaming clients (comma list, e.g. 1,2,4,8), each against the "
        "server per method; aggregate tok/s, TTFT and time per token, speculative vs plain.",
    ),
]
PerClientOpt = Annotated[
    int, typer.Option("--requests-per-client", help="Requests each client sends, one after another.")
]
MaxBatchOpt = Annotated[int, typer.Option("--max-batch-size", help="The server's batch width.")]


@measuring
def serve(
    *,
    models: ModelSettings,
    methods: MethodsOpt = None,
    prompts: PromptsOpt = "quick",
    limit: LimitOpt = None,
    repeats: Annotated[
        int, typer.Option("--repeats", "-r", help="Runs per cell, methods in alternating order, pooled.")
    ] = 1,
    generation: GenerationConfig,
    concurrency: ConcurrencyOpt = None,
    per_client: PerClientOpt = 2,
    max_batch: MaxBatchOpt = 16,
    json_file: JsonOpt = None,
) -> None:
    """A server under load: the pair served here, driven by concurrent streaming clients per method.

    Its default methods are specgen's own (transformers' and llama.cpp's columns run no server);
    the sampling options go into every request, the seed offset by the request's number.
    """
    with user_errors():
        check_repeats(repeats)
        names = method_names(methods, generation, models)
        items = prompt_set(prompts, limit, {"--json": json_file})
        run_serve(
            names,
            items,
            generation,
            models,
            concurrency,
            per_client,
            max_batch,
            json_file,
            repeats,
            methods is not None,
        )


def run_serve(
    names: list[str],
    items: list,
    generation: GenerationConfig,
    models: ModelSettings,
    concurrency: str | None,
    per_client: int,
    max_batch: int,
    json_file,
    repeats: int,
    named: bool,
    notes: tuple[str, ...] = (),
) -> None:
    """`bench serve` once the options every bench command takes are checked (and bench's old
    spelling, `bench --concurrency`): its own checked, then `notes` said, then the measuring."""
    from specgen.bench.throughput import parse_sizes  # torch: only once the command runs

    levels = parse_sizes(concurrency, "--concurrency")
    if not levels:
        raise ConfigError("bench serve drives the server at --concurrency levels (e.g. 1,2,4,8); give them")
    names = check(names, per_client, max_batch, json_file, named)
    for line in notes:  # once the settings are known good: an error stays one line
        note(line)
    measure(names, items, generation, levels, per_client, max_batch, models, json_file, repeats, named)


def check(names, per_client: int, max_batch: int, json_file, named: bool) -> list[str]:
    """Its settings, before anything loads: the methods it sends to the server."""
    from specgen.bench.concurrency import speculative  # torch: only once the command runs

    if per_client < 1:
        raise ConfigError(f"--requests-per-client must be >= 1, got {per_client}")
    if not 1 <= max_batch <= 256:  # the server's own bound (serve --max-batch-size)
        raise ConfigError(f"--max-batch-size must be in 1..256, got {max_batch}")
    # the default list: specgen's own methods only (transformers' and llama.cpp's run no server)
    if not named:
        names = [n for n in names if n in {m.value for m in Method}]
    for name in names:
        speculative(name)  # a named method that is not specgen's: one line, before anything loads
    report.check_outputs({"--json": json_file})
    return names


def measure(
    names,
    items,
    config,
    levels,
    per_client,
    max_batch,
    models: ModelSettings,
    json_file,
    repeats: int = 1,
    named: bool = True,
):
    """Start a server on the loaded pair (this process, a free port), drive it, stop it, report."""
    # torch: only once the command runs
    from specgen.bench import concurrency, measure
    from specgen.bench import methods as registry
    from specgen.bench import prompts as prompt_sets
    from specgen.runtime.pair import load

    err = stderr()
    load_as = Method.CHAIN if any(Method(n.split("/")[0]).needs_draft_model for n in names) else Method.PLAIN
    refuse_before_load(registry, names, named, models.draft)
    pair = load(models, load_as, quiet=not err.is_terminal)
    names = runnable(registry, pair, names, named, err)
    law = config.sampling
    sampling = (
        concurrency.GREEDY
        if law.greedy
        else {"temperature": law.temperature, "top_p": law.top_p, "top_k": law.top_k, "seed": law.seed}
    )
    prompts = [item.chat() for item in items]
    # each fits, before the server starts
    prompt_sets.encode_all(pair.target.tokenizer, items, pair.target.context_length)

    def progress(cell):
        err.print(
            f"{cell.concurrency} clients · {cell.method}: {cell.wall_tokens_per_second:.1f} tok/s"
            + (f" ({len(cell.errors)} errors)" if cell.errors else ""),
            style="dim",
            markup=False,
        )

    with (
        measure.fixed_threads(models.threads) as used,
        _serving(models, pair, config, levels, max_batch) as running,
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
        f"specgen bench serve · {pair_name(pair)} · {len(prompts)} prompts · {per_client} requests per client"
        + (f" · {repeats} runs per cell, interleaved" if repeats > 1 else "")
        + f" · {config.max_new_tokens} new "
        f"tokens · {'greedy' if law.greedy else f'temperature {law.temperature}'} · batch up to {max_batch}"
        + (" · INTERRUPTED" if interrupted else "")
    )
    print_table(concurrency.table(cells, title))
    if json_file is not None:
        write_json(
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
                    "width_caps": {str(w): k for w, k in running.scheduler.caps.k.items()},
                    "drafting_together": {str(w): n for w, n in running.scheduler.caps.least.items()},
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
def _serving(models: ModelSettings, pair, config, levels, max_batch: int):
    """A server on the loaded pair in this process, on a free port, stopped on the way out."""
    from specgen.serve.server import ServeOptions, prepare  # torch: only once the command runs

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
    stderr().print(
        f"bench concurrency: server at {running.state.info['url']}; draft length by batch width: "
        + (", ".join(f"{w}:{k}" for w, k in caps.k.items()) or "as requested")
        + (
            "; rows that draft with the model together, at least: "
            + ", ".join(f"{w}:{n}" for w, n in caps.least.items())
            if caps
            else ""
        ),
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
