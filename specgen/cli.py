"""The `specgen` command line: options -> settings objects -> one call. No tensors here."""

from __future__ import annotations

import contextlib
import enum
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from specgen.catalog import DEFAULT_DRAFT, DEFAULT_TARGET  # stdlib-only imports: --help stays instant
from specgen.errors import SpecgenError

app = typer.Typer(help="Speculative decoding for language models, shown round by round.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


class Format(str, enum.Enum):
    rich = "rich"
    plain = "plain"
    json = "json"


def _version(value: bool) -> None:
    if value:
        from specgen import __version__

        typer.echo(f"specgen {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Show the version and exit.")] = False) -> None:
    """Speculative decoding for language models, shown round by round."""


@contextlib.contextmanager
def user_errors():
    """Known failures become one red line and exit 1; SPECGEN_DEBUG=1 shows the traceback."""
    try:
        yield
    except SpecgenError as exc:
        if os.environ.get("SPECGEN_DEBUG"):
            raise
        _error_line(str(exc), exc.hint)
        raise typer.Exit(1) from None
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except Exception as exc:  # an unexpected failure: still one line, with a way to see more
        if os.environ.get("SPECGEN_DEBUG"):
            raise
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        _error_line(f"unexpected {type(exc).__name__}: {first}", "set SPECGEN_DEBUG=1 for the traceback")
        raise typer.Exit(1) from None


def _error_line(message: str, hint: str | None = None) -> None:
    from rich.console import Console

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    console.print(f"[bold red]error:[/] {message}" + (f" [dim]({hint})[/]" if hint else ""), markup=True)


def _read_prompt(prompt: str | None, file: Path | None) -> str:
    from specgen.errors import PromptError

    if prompt is not None and file is not None:
        raise PromptError("give the prompt as an argument or with --file, not both")
    if file is not None:
        try:
            return file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PromptError(f"cannot read prompt file {file}: {exc.strerror or exc}") from None
    if prompt == "-":
        return sys.stdin.read()
    if prompt is None:
        raise PromptError("no prompt given; pass PROMPT, '-' for stdin, or --file F")
    return prompt


# Options shared by run (and later chat and bench).
TargetOpt = Annotated[str, typer.Option("--target", "-t", help="Target model: directory, .gguf file, catalog name or HF id.")]
DraftOpt = Annotated[str, typer.Option("--draft", "-d", help="Draft model (same tokenizer as the target).")]
MethodOpt = Annotated[str, typer.Option("--method", "-m", help="plain, chain, rsd-c, rsd-s or multi-draft.")]
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", "-n", help="Stop after this many new tokens.")]
DraftTokensOpt = Annotated[int, typer.Option("--draft-tokens", "-k", help="Draft tokens per round.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu, cuda (all GPUs) or cuda:N.")]
DraftDeviceOpt = Annotated[Optional[str], typer.Option("--draft-device", help="Device for the draft model (default: chosen with the target's placement).")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto, bfloat16, float16 or float32.")]
TemperatureOpt = Annotated[float, typer.Option("--temperature", help="0 is greedy; >0 samples (lossless).")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0: off).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (1: off).")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Seed for every random draw.")]
BranchingOpt = Annotated[str, typer.Option("--branching", help="rsd-c/multi-draft: children per depth, e.g. 2,2,1.")]
BeamWidthOpt = Annotated[int, typer.Option("--beam-width", help="rsd-s: beam width W.")]
DepthOpt = Annotated[int, typer.Option("--depth", help="rsd-s: tree depth L.")]


@app.command()
def run(
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt; '-' reads it from stdin.")] = None,
    file: Annotated[Optional[Path], typer.Option("--file", "-f", help="Read the prompt from a file.")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Do not apply the chat template.")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="System message for the chat template.")] = None,
    target: TargetOpt = DEFAULT_TARGET,
    draft: DraftOpt = DEFAULT_DRAFT,
    method: MethodOpt = "chain",
    max_new_tokens: MaxNewOpt = 256,
    draft_tokens: DraftTokensOpt = 4,
    device: DeviceOpt = "auto",
    draft_device: DraftDeviceOpt = None,
    dtype: DtypeOpt = "auto",
    temperature: TemperatureOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    seed: SeedOpt = None,
    branching: BranchingOpt = "2,2,1",
    beam_width: BeamWidthOpt = 3,
    depth: DepthOpt = 4,
    show_tree: Annotated[bool, typer.Option("--show-tree", help="Print each tree round's tree (tree methods).")] = False,
    format: Annotated[Optional[Format], typer.Option("--format", help="rich (terminal default), plain (pipe default) or json.")] = None,
) -> None:
    """Generate a reply to PROMPT, showing each speculative round."""
    with user_errors():
        config = generation_config(method, max_new_tokens, draft_tokens, temperature, top_k, top_p, seed,
                                   branching, beam_width, depth)
        text = _read_prompt(prompt, file)
        from specgen.errors import PromptError

        if not text.strip():
            raise PromptError("the prompt is empty")
        fmt = format or (Format.rich if sys.stdout.isatty() else Format.plain)
        _run(text, raw, system, config, fmt, target, draft, device, draft_device, dtype, show_tree)


def generation_config(method, max_new_tokens, draft_tokens, temperature, top_k, top_p, seed,
                      branching="2,2,1", beam_width=3, depth=4):
    """Options -> a validated GenerationConfig (shared by run, chat and bench)."""
    from specgen.config import GenerationConfig, Method, SamplingConfig, parse_branching

    return GenerationConfig(
        method=Method.parse(method), max_new_tokens=max_new_tokens, draft_tokens=draft_tokens,
        sampling=SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
        branching=parse_branching(branching), beam_width=beam_width, depth=depth)


def _run(text, raw, system, config, fmt, target, draft, device, draft_device, dtype, show_tree=False) -> None:
    from specgen import session
    from specgen.render import JsonRenderer, PlainRenderer, RichRenderer

    settings = session.ModelSettings(target, draft, device, draft_device, dtype)
    pair = session.load(settings, config.method, quiet=fmt is Format.json)
    prompt_ids = session.encode_prompt(pair.target.tokenizer, text, raw, system)
    engine = session.build_engine(pair, config.method, config)
    if fmt is Format.rich:
        from rich.console import Console

        renderer = RichRenderer(Console(highlight=False), show_tree=show_tree)
    elif fmt is Format.json:
        renderer = JsonRenderer()
    else:
        renderer = PlainRenderer(show_tree=show_tree)
    outcome = session.generate(engine, pair.target.tokenizer, prompt_ids, config, renderer)
    if outcome.interrupted:
        raise typer.Exit(130)


from specgen.models_cli import models_app  # noqa: E402

app.add_typer(models_app, name="models", help="The offline model catalog: list, pull, path, verify, remove.")


def _mount_bench() -> None:
    from specgen.bench_cli import bench  # imports this module's option aliases: mount last

    app.command()(bench)


_mount_bench()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
