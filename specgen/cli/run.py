"""`specgen run`: one prompt (live view, plain text or JSON; on a running server when one
matches) or a prompts file (dynamic batching, outputs in input order). No tensor code here."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from specgen.cli.options import Format, note_unused, sigterm_as_ctrl_c, user_errors, with_options
from specgen.cli.prompt_set import check_options, run_to_file
from specgen.cli.reading import check_text, read_prompt
from specgen.cli.remote import generate_on_server
from specgen.cli.render import JsonRenderer, PlainRenderer, RichRenderer
from specgen.config import GenerationConfig, ModelSettings
from specgen.decoding.prompts import encode_prompt, read_prompts_file
from specgen.errors import ConfigError, PromptError
from specgen.status import note


@with_options()
def run(
    *,
    ctx: typer.Context,
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt; '-' reads it from stdin.")] = None,
    file: Annotated[Optional[Path], typer.Option("--file", "-f", help="Read the prompt from a file.")] = None,
    prompts_file: Annotated[
        Optional[Path],
        typer.Option("--prompts-file", help="Many prompts: one per line, or JSONL with a 'prompt' field."),
    ] = None,
    batch_size: Annotated[
        int,
        typer.Option("--batch-size", help="With --prompts-file: rows decoded together (dynamic batching)."),
    ] = 1,
    output: Annotated[
        Optional[Path],
        typer.Option(
            "--output",
            "-o",
            help="With --prompts-file: write each prompt's result as one JSON line here as it finishes (with "
            "its id); a rerun skips the prompts already there.",
        ),
    ] = None,
    ray_address: Annotated[
        Optional[str],
        typer.Option(
            "--ray",
            help="With --output: decode on a Ray cluster, 'auto' or its ADDRESS (pip install "
            "'specgen\\[ray]').",
            show_default=False,
        ),
    ] = None,
    ray_actors: Annotated[
        Optional[int],
        typer.Option(
            "--ray-actors",
            help="With --ray: actors, each loading the pair once (default: as many as the cluster fits).",
            show_default=False,
        ),
    ] = None,
    ray_threads: Annotated[
        Optional[int],
        typer.Option(
            "--ray-threads",
            help="With --ray: CPU threads (and CPUs reserved) per actor (default 1).",
            show_default=False,
        ),
    ] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Do not apply the chat template.")] = False,
    system: Annotated[
        Optional[str], typer.Option("--system", help="System message for the chat template.")
    ] = None,
    models: ModelSettings,
    generation: GenerationConfig,
    show_tree: Annotated[
        bool, typer.Option("--show-tree", help="Print each tree round's tree (tree methods).")
    ] = False,
    format: Annotated[
        Optional[Format],
        typer.Option("--format", help="rich (terminal default), plain (pipe default) or json."),
    ] = None,
    logprobs: Annotated[
        Optional[int],
        typer.Option(
            "--logprobs",
            help="JSON output: each token's log-probability under the target and the N most likely tokens at "
            "its position (0..20).",
        ),
    ] = None,
    server: Annotated[
        bool,
        typer.Option(
            "--server/--no-server",
            help="Generate on a running `specgen serve` with the same model options when there is one (a "
            "single prompt).",
        ),
    ] = True,
) -> None:
    """Generate a reply to PROMPT, showing each speculative round."""
    sigterm_as_ctrl_c()
    with user_errors():
        config = replace(generation, sampling=replace(generation.sampling, logprobs=logprobs))
        note_unused(ctx, config)
        if logprobs is not None and format is not Format.json and output is None:
            raise ConfigError("--logprobs are written in the JSON output", hint="add --format json")
        if system is not None:
            check_text(system, "--system")
            if raw:
                raise ConfigError(
                    "--system goes through the chat template, which --raw leaves out",
                    hint="put the system text in the prompt itself, or drop --raw",
                )
        if batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
        if batch_size > 1 and prompts_file is None:
            raise ConfigError(
                "--batch-size batches the prompts of --prompts-file; a single prompt has no batch",
                hint="give --prompts-file FILE, or leave --batch-size out",
            )
        check_options(prompts_file, output, ray_address, ray_actors, ray_threads)
        if show_tree and (
            not config.method.is_tree or format is Format.json or output is not None or batch_size > 1
        ):
            note(
                "--show-tree draws the trees of rsd-c, rsd-s and multi-draft in the rich and plain views, "
                "one "
                "prompt at a time (not --output, not --batch-size above 1); this run has none to show"
            )
        if prompts_file is not None:
            if prompt is not None or file is not None:
                raise ConfigError("give either PROMPT/--file or --prompts-file, not both")
            fmt = format or Format.plain
            if output is not None:
                run_to_file(
                    prompts_file,
                    output,
                    batch_size,
                    raw,
                    system,
                    config,
                    models,
                    fmt is Format.json,
                    ray_address,
                    ray_actors,
                    ray_threads or 1,
                )
                return
            _run_many(prompts_file, batch_size, raw, system, config, fmt, models, show_tree)
            return
        text = read_prompt(prompt, file)
        if not text.strip():
            raise PromptError("the prompt is empty")
        fmt = format or (Format.rich if sys.stdout.isatty() else Format.plain)
        _run(text, raw, system, config, fmt, models, show_tree, server)


def _run_many(
    path, batch_size, raw, system, config, fmt, settings: ModelSettings, show_tree: bool = False
) -> None:
    """Several prompts; outputs in input order. Batches decode together with any method."""
    # decoding imports torch: only once a run needs it (--help and a served run stay light)
    from specgen.decoding import run as driver
    from specgen.decoding.build import build_engine, check_draft, resolve_draft_length
    from specgen.runtime.pair import load

    texts = read_prompts_file(path)
    check_draft(settings.draft, config.method)
    pair = load(settings, config.method, quiet=fmt is Format.json)
    pair.keep_prefixes()  # prompts of a set often share a system prompt or a preamble
    config, _ = resolve_draft_length(pair, config)
    prompts = [encode_prompt(pair.target.tokenizer, text, raw, system) for text in texts]
    stopped: list[int] = []  # prompts that Ctrl-C left unfinished (1-based, input order)
    engine = build_engine(pair, config)
    for number, ids in enumerate(prompts, 1):  # every prompt fits, before the first is decoded
        engine.check_prompt(ids, f"prompt {number} of {path}")
    if batch_size == 1:  # each prompt's text streams as it is made
        for number, ids in enumerate(prompts, 1):
            renderer = JsonRenderer() if fmt is Format.json else PlainRenderer(show_tree=show_tree)
            outcome = driver.generate(engine, pair.target.tokenizer, ids, config, renderer)
            if outcome.interrupted:  # its partial text was shown; the rest never started
                stopped = list(range(number, len(prompts) + 1))
                for rest in prompts[number:]:
                    _write_row(driver.unfinished(rest, config), fmt)
                break
    else:
        rows = driver.run_prompts(engine, pair.target.tokenizer, prompts, config, batch_size)
        item = next(rows, None)
        while item is not None:
            index, outcome = item
            if outcome.interrupted:
                stopped.append(index + 1)
            try:
                _write_row(outcome, fmt)
                item = next(rows, None)
            except KeyboardInterrupt:  # pressed while a row was being written: finish the others
                try:
                    item = rows.throw(KeyboardInterrupt())
                except (StopIteration, KeyboardInterrupt):
                    item = None
    if stopped:
        sys.stderr.write(
            f"interrupted: {len(prompts) - len(stopped)} of {len(prompts)} prompts finished; "
            f"not finished: {_numbers(stopped)} (marked interrupted)\n"
        )
        raise typer.Exit(130)


def _write_row(outcome, fmt) -> None:
    """One batched prompt's result: a JSON object, or its text on one line (empty if unfinished)."""
    if fmt is Format.json:
        JsonRenderer().finish(outcome)
    else:
        sys.stdout.write(outcome.text + "\n")
        sys.stdout.flush()


def _numbers(values: list[int]) -> str:
    """[2, 3, 4, 7] -> '2-4, 7'."""
    spans: list[list[int]] = []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _run(text, raw, system, config, fmt, settings: ModelSettings, show_tree=False, use_server=False) -> None:
    renderer = _renderer(fmt, show_tree)
    if use_server:  # a running `specgen serve` with these model options: no loading at all
        try:
            outcome = generate_on_server(
                settings, text, raw, system, config, renderer, quiet=fmt is Format.json
            )
        except KeyboardInterrupt:  # a second Ctrl-C while the server was stopping
            raise typer.Exit(130) from None
        if outcome is not None:
            if outcome.interrupted:
                raise typer.Exit(130)
            return
    from specgen.decoding import run as driver  # torch: only when this process loads the pair
    from specgen.decoding.build import build_engine, check_draft, resolve_draft_length
    from specgen.runtime import onednn
    from specgen.runtime.pair import load

    check_draft(settings.draft, config.method)
    short = onednn.short_work(config.max_new_tokens, text)  # one short answer: fbgemm only
    with onednn.fbgemm_only() if short else contextlib.nullcontext():
        pair = load(settings, config.method, quiet=fmt is Format.json)
    config, _ = resolve_draft_length(pair, config)
    prompt_ids = encode_prompt(pair.target.tokenizer, text, raw, system)
    outcome = driver.generate(build_engine(pair, config), pair.target.tokenizer, prompt_ids, config, renderer)
    if outcome.interrupted:
        raise typer.Exit(130)


def _renderer(fmt, show_tree: bool):
    if fmt is Format.rich:
        return RichRenderer(Console(emoji=False, highlight=False), show_tree=show_tree)
    if fmt is Format.json:
        return JsonRenderer()
    return PlainRenderer(show_tree=show_tree)
