"""`specgen bench batch`: throughput of batched decoding per method and batch size, with
deterministic mode off and at each verify window (specgen/bench/throughput.py measures); every
setting checked before a model loads, progress, the table and --json. No tensor code here."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Annotated, Optional

import typer

from specgen.bench import report
from specgen.cli.bench_options import (
    JsonOpt,
    LimitOpt,
    MethodsOpt,
    PromptsOpt,
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


@measuring
def batch(
    *,
    models: ModelSettings,
    methods: MethodsOpt = None,
    prompts: PromptsOpt = "quick",
    limit: LimitOpt = None,
    generation: GenerationConfig,
    batch_sizes: Annotated[
        Optional[str],
        typer.Option(
            "--batch-sizes",
            help="Decode the whole prompt set at each batch size (comma list, e.g. 1,4,8) per method, "
            "with deterministic mode off and on.",
        ),
    ] = None,
    verify_windows: Annotated[
        Optional[str],
        typer.Option(
            "--verify-windows",
            help="Deterministic cells at these windows (e.g. 8,16,32,64); default: --verify-window when "
            "--deterministic is given.",
        ),
    ] = None,
    json_file: JsonOpt = None,
) -> None:
    """Throughput: the whole prompt set at each batch size per method, deterministic mode off and on.

    Each cell runs once; plain at batch size 1 with deterministic mode off is every speed-up's
    denominator, and each deterministic cell's tokens are compared with plain's in the same window.
    """
    with user_errors():
        names = method_names(methods, generation, models)
        items = prompt_set(prompts, limit, {"--json": json_file})
        run_batch(
            names, items, generation, models, batch_sizes, verify_windows, json_file, methods is not None
        )


def run_batch(
    names: list[str],
    items: list,
    generation: GenerationConfig,
    models: ModelSettings,
    batch_sizes: str | None,
    verify_windows: str | None,
    json_file,
    named: bool,
    notes: tuple[str, ...] = (),
) -> None:
    """`bench batch` once the options every bench command takes are checked (and bench's old
    spelling, `bench --batch-sizes`): its own checked, then `notes` said, then the measuring."""
    from specgen.bench import throughput  # torch: only once the command runs

    sizes = throughput.parse_sizes(batch_sizes, "--batch-sizes")
    windows = throughput.parse_sizes(verify_windows, "--verify-windows")
    if not sizes and not windows:
        raise ConfigError(
            "bench batch measures at --batch-sizes (e.g. 1,4,8) or --verify-windows (e.g. 8,32); give one"
        )
    implied = not sizes
    names, windows = check(names, generation, windows, json_file, named)
    for line in notes:  # once the settings are known good: an error stays one line
        note(line)
    if implied:
        note("bench: --verify-windows measures throughput cells (--batch-sizes 1 unless given)")
    measure(
        names,
        items,
        replace(generation, deterministic=False),
        sizes or [1],
        windows,
        models,
        json_file,
        named=named,
    )


def check(names, config, windows: list[int], json_file, named: bool) -> tuple[list[str], list[int]]:
    """Its settings, before anything loads: the engine methods it measures and its deterministic
    windows (--verify-window's when --deterministic is given and none are)."""
    windows = windows or ([config.verify_window] if config.deterministic else [])
    engine_names = {m.value for m in Method}
    for window in windows:  # each deterministic cell's settings, before any model loads
        if window < 2:
            raise ConfigError("--verify-windows values must be >= 2")
        for name in [n for n in names if n in engine_names] or [config.method.value]:
            replace(config, method=Method(name), deterministic=True, verify_window=window)
    report.check_outputs({"--json": json_file})
    other = [n for n in names if n not in engine_names]
    if other and named:
        raise ConfigError(
            f"bench batch measures specgen's own methods (no variants, @DRAFT columns or "
            f"references); '{other[0]}' is not one"
        )
    return [n for n in names if n in engine_names], windows


def measure(names, items, config, sizes, windows, models: ModelSettings, json_file, named: bool = True):
    # torch: only once the command runs
    from specgen.bench import measure, throughput
    from specgen.bench import methods as registry
    from specgen.bench import prompts as prompt_sets
    from specgen.decoding.build import resolve_draft_length
    from specgen.runtime.pair import load

    err = stderr()
    load_as = Method.CHAIN if any(Method(n).needs_draft_model for n in names) else Method.PLAIN
    refuse_before_load(registry, names, named, models.draft)
    pair = load(models, load_as, quiet=not err.is_terminal)
    names = runnable(registry, pair, names, named, err)
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

    with measure.fixed_threads(models.threads) as used:
        cells = throughput.run_throughput(pair, names, prompts, config, sizes, windows, on_cell=progress)
    interrupted = any(c.interrupted for c in cells)
    title = (
        f"specgen bench batch · {pair_name(pair)} · {len(prompts)} prompts · "
        f"{config.max_new_tokens} new tokens · {'greedy' if config.sampling.greedy else 'sampling'}"
        + (" · INTERRUPTED" if interrupted else "")
    )
    print_table(throughput.table(cells, title))
    if json_file is not None:
        write_json(
            json_file,
            {
                "schema": "specgen-bench-throughput/1",
                "environment": measure.environment(pair, used),
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
    if interrupted:
        raise typer.Exit(130)
    failed = [c for c in cells if c.failed]
    if failed:  # the table and the JSON hold every cell; the run still did not do all it was asked
        error_line(
            f"{len(failed)} of {len(cells)} cells failed: {failed[0].method} b{failed[0].batch_size} "
            f"{failed[0].mode}: {failed[0].skipped}"[:400]
        )
        raise typer.Exit(1)
