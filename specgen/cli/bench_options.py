"""What the bench commands share (per prompt, `bench batch`, `bench serve`): their common options,
declared once, and what they do alike once they run: the method list and the prompt set checked
before a model loads, the columns a loaded pair can run, the table on stdout, a --json of cells.
No tensor code here."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from specgen.bench import report
from specgen.cli.options import with_options
from specgen.config import GenerationConfig, Method, ModelSettings
from specgen.errors import ConfigError

REFERENCE_METHODS = "hf-assisted,hf-assisted-k4,hf-lookup"  # see specgen/bench/references.py
DEFAULT_METHODS = ",".join(m.value for m in Method if m is not Method.EAGLE) + "," + REFERENCE_METHODS

# every bench command: the models' and a generation's option groups (cli/groups.py), 128 new
# tokens by default, and no --method (each column is a method)
measuring = with_options(defaults={"max_new_tokens": 128}, fixed={"method": "plain"})

MethodsOpt = Annotated[
    Optional[str],
    typer.Option(
        "--methods",
        help=f"Comma list of methods (default: all of them, {DEFAULT_METHODS}). "
        "plain is always measured: it is the denominator of every speed-up.",
    ),
]
PromptsOpt = Annotated[
    str,
    typer.Option(
        "--prompts",
        "-p",
        help="A prompt set in prompts/ by name (quick, code-generation, ...), "
        "'all' (every category set), or a JSONL file: each line an object with 'id', "
        "'category' and 'prompt' (text) or 'messages' (a conversation).",
    ),
]
LimitOpt = Annotated[
    Optional[int], typer.Option("--limit", help="Keep the first N prompts of each prompt file.")
]
JsonOpt = Annotated[
    Optional[Path],
    typer.Option("--json", help="Write the environment, the settings and every measurement as JSON."),
]


def method_names(methods: str | None, generation: GenerationConfig, models: ModelSettings) -> list[str]:
    """--methods as column names (plain first), each checked before a model loads: a llama.cpp
    column's needs, every method's settings."""
    # the measuring modules import torch: only once a command runs
    from specgen.bench import llamacpp
    from specgen.bench import methods as registry

    names = registry.parse_methods(methods)
    llamacpp.refuse_early(names, models.target)
    registry.check_settings(names, generation)
    return names


def prompt_set(prompts: str, limit: int | None, outputs: dict) -> list:
    """The prompt set's records; no output option may name a file it reads."""
    from specgen.bench import prompts as prompt_sets  # torch: see method_names

    items = prompt_sets.load_prompts(prompts, limit)
    report.check_not_read(outputs, prompt_sets.prompt_files(prompts))
    return items


def check_repeats(repeats: int) -> None:
    if repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {repeats}")


def refuse_before_load(registry, names: list[str], named: bool, draft: str | None) -> None:
    """A named column that the draft's argument alone says cannot run is a ConfigError before the
    pair loads (`runnable` says the same of it after; from the default list it is left out then)."""
    if not named:
        return
    for name in names:
        why = registry.unsupported_before_load(name, draft)
        if why is not None:
            raise ConfigError(why, hint="leave it out of --methods")


def runnable(registry, pair, names: list[str], named: bool, err, drafts=None) -> list[str]:
    """The columns this pair can run: a named one it cannot is a ConfigError before anything is
    measured; from the default list it is left out, with a line."""
    unfit = {n: why for n in names if (why := registry.unsupported(pair, n, drafts))}
    if unfit and named:
        raise ConfigError(next(iter(unfit.values())), hint="leave it out of --methods")
    for why in unfit.values():
        err.print(f"bench: left out {why}", style="dim", markup=False)
    return [n for n in names if n not in unfit]


def stderr() -> Console:
    return Console(emoji=False, stderr=True, highlight=False)


def print_table(table) -> None:
    """A report's table on stdout (160 columns when it is not a terminal)."""
    Console(emoji=False, highlight=False, width=None if sys.stdout.isatty() else 160).print(table)


def pair_name(pair) -> str:
    return pair.target.name + (f" + {pair.draft.name}" if pair.draft else "")


def write_json(json_file, data: dict) -> None:
    """--json of `bench batch` and `bench serve` (atomically, a spare file if it fails)."""
    text = json.dumps(data, indent=1, default=str) + "\n"
    if not report.save(
        "--json", json_file, lambda path: path.write_text(text, encoding="utf-8"), fallback=True
    ):
        raise typer.Exit(1)
