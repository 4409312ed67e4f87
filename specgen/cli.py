"""The `specgen` command line: options -> settings objects -> one call. No tensors here."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from specgen.errors import ConfigError

from specgen.catalog import DEFAULT_DRAFT, DEFAULT_TARGET  # stdlib-only imports: --help stays instant
from specgen.options import (BeamWidthOpt, BranchingOpt, DepthOpt, DeviceOpt, DraftDeviceOpt, DraftOpt,
                             DraftTokensOpt, DraftQuantOpt, TargetQuantOpt, DtypeOpt, CompileOpt, Format, MaxNewOpt, MethodOpt, SeedOpt, TargetOpt,
                             TemperatureOpt, TopKOpt, TopPOpt, DeterministicOpt, VerifyWindowOpt, ScheduleOpt, ConfidenceOpt,
                             check_text, generation_config, read_prompt, user_errors)

app = typer.Typer(help="Speculative decoding for language models, shown round by round.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _version(value: bool) -> None:
    if value:
        from specgen import __version__

        typer.echo(f"specgen {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Show the version and exit.")] = False) -> None:
    """Speculative decoding for language models, shown round by round."""


@app.command()
def run(
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt; '-' reads it from stdin.")] = None,
    file: Annotated[Optional[Path], typer.Option("--file", "-f", help="Read the prompt from a file.")] = None,
    prompts_file: Annotated[Optional[Path], typer.Option("--prompts-file", help="Many prompts: one per line, or JSONL with a 'prompt' field.")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="With --prompts-file: rows decoded together (dynamic batching).")] = 1,
    raw: Annotated[bool, typer.Option("--raw", help="Do not apply the chat template.")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="System message for the chat template.")] = None,
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    method: MethodOpt = "chain",
    max_new_tokens: MaxNewOpt = 256,
    draft_tokens: DraftTokensOpt = "device",
    draft_schedule: ScheduleOpt = None,
    draft_confidence: ConfidenceOpt = None,
    device: DeviceOpt = "auto",
    draft_device: DraftDeviceOpt = None,
    dtype: DtypeOpt = "auto",
    draft_quant: DraftQuantOpt = "auto",
    target_quant: TargetQuantOpt = "auto",
    temperature: TemperatureOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    seed: SeedOpt = None,
    branching: BranchingOpt = "2,2,1",
    beam_width: BeamWidthOpt = 3,
    depth: DepthOpt = 4,
    show_tree: Annotated[bool, typer.Option("--show-tree", help="Print each tree round's tree (tree methods).")] = False,
    deterministic: DeterministicOpt = False,
    verify_window: VerifyWindowOpt = 32,
    compile: CompileOpt = "auto",
    format: Annotated[Optional[Format], typer.Option("--format", help="rich (terminal default), plain (pipe default) or json.")] = None,
    server: Annotated[bool, typer.Option("--server/--no-server", help="Generate on a running `specgen serve` with the same model options when there is one (a single prompt).")] = True,
) -> None:
    """Generate a reply to PROMPT, showing each speculative round."""
    with user_errors():
        config = generation_config(method, max_new_tokens, draft_tokens, temperature, top_k, top_p, seed,
                                   branching, beam_width, depth, deterministic, verify_window, draft_schedule,
                                   draft_confidence)
        if system is not None:
            check_text(system, "--system")
        if batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
        if batch_size > 1 and prompts_file is None:
            raise ConfigError("--batch-size batches the prompts of --prompts-file; a single prompt has no batch",
                              hint="give --prompts-file FILE, or leave --batch-size out")
        if prompts_file is not None:
            if prompt is not None or file is not None:
                raise ConfigError("give either PROMPT/--file or --prompts-file, not both")
            fmt = format or Format.plain
            _run_many(prompts_file, batch_size, raw, system, config, fmt, target, draft, device, draft_device, dtype,
                      (draft_quant, compile, target_quant))
            return
        text = read_prompt(prompt, file)
        from specgen.errors import PromptError

        if not text.strip():
            raise PromptError("the prompt is empty")
        fmt = format or (Format.rich if sys.stdout.isatty() else Format.plain)
        _run(text, raw, system, config, fmt, target, draft, device, draft_device, dtype, show_tree,
             (draft_quant, compile, target_quant), server)


def _run_many(path, batch_size, raw, system, config, fmt, target, draft, device, draft_device, dtype,
              quant_and_compile=(None, "auto", "auto")) -> None:
    """Several prompts; outputs in input order. Batches decode together with any method."""
    from specgen import session
    from specgen.render import JsonRenderer, PlainRenderer

    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
    texts = session.read_prompts_file(path)
    pair = session.load(session.ModelSettings(target, draft, device, draft_device, dtype, *quant_and_compile),
                        config.method,
                        quiet=fmt is Format.json)
    config, _ = session.resolve_draft_length(pair, config)
    prompts = [session.encode_prompt(pair.target.tokenizer, text, raw, system) for text in texts]
    stopped: list[int] = []  # prompts that Ctrl-C left unfinished (1-based, input order)
    if batch_size == 1:
        engine = session.build_engine(pair, config.method, config)
        for number, ids in enumerate(prompts, 1):
            renderer = JsonRenderer() if fmt is Format.json else PlainRenderer()
            outcome = session.generate(engine, pair.target.tokenizer, ids, config, renderer)
            if outcome.interrupted:  # its partial text was shown; the rest never started
                stopped = list(range(number, len(prompts) + 1))
                for rest in prompts[number:]:
                    _write_row(session.unfinished(rest, config), fmt)
                break
    else:
        rows = session.run_batch(pair, prompts, config, batch_size)
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
        sys.stderr.write(f"interrupted: {len(prompts) - len(stopped)} of {len(prompts)} prompts finished; "
                         f"not finished: {_numbers(stopped)} (marked interrupted)\n")
        raise typer.Exit(130)


def _write_row(outcome, fmt) -> None:
    """One batched prompt's result: a JSON object, or its text on one line (empty if unfinished)."""
    from specgen.render import JsonRenderer

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


def _run(text, raw, system, config, fmt, target, draft, device, draft_device, dtype, show_tree=False,
         quant_and_compile=(None, "auto", "auto"), use_server=False) -> None:
    from specgen.config import ModelSettings

    settings = ModelSettings(target, draft, device, draft_device, dtype, *quant_and_compile)
    renderer = _renderer(fmt, show_tree)
    if use_server:  # a running `specgen serve` with these model options: no loading at all
        from specgen.server import generate_on_server

        try:
            outcome = generate_on_server(settings, {"text": text, "raw": raw, "system": system, "config": config},
                                         renderer, quiet=fmt is Format.json)
        except KeyboardInterrupt:  # a second Ctrl-C while the server was stopping
            raise typer.Exit(130) from None
        if outcome is not None:
            if outcome.interrupted:
                raise typer.Exit(130)
            return
    from specgen import session

    pair = session.load(settings, config.method, quiet=fmt is Format.json)
    config, _ = session.resolve_draft_length(pair, config)
    prompt_ids = session.encode_prompt(pair.target.tokenizer, text, raw, system)
    engine = session.build_engine(pair, config.method, config)
    outcome = session.generate(engine, pair.target.tokenizer, prompt_ids, config, renderer)
    if outcome.interrupted:
        raise typer.Exit(130)


def _renderer(fmt, show_tree: bool):
    from specgen.render import JsonRenderer, PlainRenderer, RichRenderer

    if fmt is Format.rich:
        from rich.console import Console

        return RichRenderer(Console(highlight=False), show_tree=show_tree)
    if fmt is Format.json:
        return JsonRenderer()
    return PlainRenderer(show_tree=show_tree)


from specgen.models_cli import models_app  # noqa: E402

app.add_typer(models_app, name="models", help="The offline model catalog: list, pull, path, verify, remove.")


from specgen.bench_cli import bench  # noqa: E402
from specgen.chat_cli import chat  # noqa: E402
from specgen.serve_cli import serve  # noqa: E402

app.command()(chat)
app.command()(bench)
app.command()(serve)


def main() -> None:
    """The `specgen` command. It ends with `os._exit` once its output is flushed: Python's own
    teardown of a loaded pair (thousands of modules, packed weights and tensors, 4-5 GB) took
    1.2 s of every warm `specgen run` (measured on a 2-core EPYC) and does nothing a finished
    command needs (every file specgen writes is closed, or renamed into place, before this)."""
    try:
        app()
        status = 0
    except SystemExit as exc:
        status = exit_status(exc.code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`) or stream: nothing left to say
            pass
    os._exit(status)


def exit_status(code) -> int:
    """SystemExit's code as a process status: None is 0, an int is itself, text is printed, 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except (OSError, ValueError):
        pass
    return 1


if __name__ == "__main__":
    main()
