"""`specgen check`: a short self-test of a pair against transformers' own `generate`. No tensor
code here (bench/check.py does the work)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Annotated, Optional

import typer

from specgen.cli.groups import MaxNewOpt
from specgen.cli.options import user_errors, with_options
from specgen.config import Method, ModelSettings
from specgen.errors import ConfigError

NO_DRAFT = "none"
CheckDraftOpt = Annotated[
    str,
    typer.Option(
        "--draft",
        "-d",
        help="Draft model (a catalog name, a directory or a GGUF file), or 'none' to check the target's "
        "plain and lookup decoding only.",
    ),
]


@with_options(options={"draft": CheckDraftOpt})
def check(
    *,
    models: ModelSettings,
    methods: Annotated[
        Optional[str],
        typer.Option(
            "--methods",
            help="Comma-separated methods to check (default: every one the pair runs).",
            show_default=False,
        ),
    ] = None,
    prompts: Annotated[
        int,
        typer.Option(
            "--prompts", help="Prompts per case (each longer than the model's longest sliding window)."
        ),
    ] = 3,
    max_new_tokens: MaxNewOpt = 32,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of a line per case.")
    ] = False,
) -> None:
    """Check that greedy output equals transformers' own generate on this pair.

    Every method, batched rows, cached prefixes, chunked prefill, a chat turn, deterministic
    mode and a batch of every method at once (as a server batches its clients). Prints each
    case as identical or where it first differs; exits 1 if any differs."""
    with user_errors():
        if not 1 <= prompts <= 16:
            raise ConfigError(f"--prompts must be in 1..16, got {prompts}")
        if max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        chosen = None if methods is None else [Method.parse(m) for m in methods.split(",") if m.strip()]
        if chosen == []:
            raise ConfigError(f"--methods {methods!r} names no method; give a comma list like plain,chain")
        no_draft = models.draft.strip().lower() == NO_DRAFT
        if no_draft and chosen and any(m.needs_draft_model for m in chosen):
            raise ConfigError(
                "--draft none checks plain, lookup and suffix only; give a draft for "
                + ", ".join(m.value for m in chosen if m.needs_draft_model)
            )
        settings = replace(models, draft=None) if no_draft else models
        failed = _check(settings, chosen, prompts, max_new_tokens, as_json)
    if failed:
        raise typer.Exit(1)


def _check(settings: ModelSettings, chosen, count: int, new_tokens: int, as_json: bool) -> bool:
    from specgen.bench import check as machinery  # torch: only once the command runs
    from specgen.decoding.build import check_draft, runs_as, why_not
    from specgen.runtime.pair import load

    for method in chosen or ():  # what the --draft argument alone refuses, before the pair loads
        check_draft(settings.draft, method)
    pair = load(settings, Method.CHAIN if settings.draft else Method.PLAIN, quiet=as_json)
    cases = machinery.standard_cases(pair)
    if chosen is not None:  # as `run` reads it (chain with a head is eagle)
        chosen = list(dict.fromkeys(runs_as(pair, m) for m in chosen))
    if chosen is not None:
        covered = list(dict.fromkeys(c.method for c in cases))
        cases = [c for c in cases if c.method in chosen and c.path is not machinery.Path.MIXED]
        mixed = machinery.mixed_methods(cases)
        if len(mixed) > 1:  # the chosen methods in one batch (one method makes no mixed batch)
            cases.append(machinery.Case(mixed[0], machinery.Path.MIXED))
        missing = [m for m in chosen if m not in covered]
        if missing:
            raise ConfigError(
                why_not(pair, missing[0])
                or f"check covers {', '.join(m.value for m in covered)} on this pair, not {missing[0].value}"
            )
    prompts = machinery.check_prompts(pair, count, new_tokens)
    if not as_json:
        sys.stderr.write(
            f"checking {len(cases)} cases on {count} prompts of {min(map(len, prompts))}-"
            f"{max(map(len, prompts))} tokens, {new_tokens} new tokens each, against transformers' "
            "generate\n"
        )

    def show(result) -> None:
        if not as_json:
            mark = "ok  " if result.identical else "FAIL"
            print(
                f"{mark} {result.label:<28} {machinery.describe(result, pair, count)} "
                f"({result.seconds:.1f} s)",
                flush=True,
            )

    results = machinery.check(pair, prompts, cases, new_tokens, on_result=show)
    failed = [r for r in results if not r.identical]
    if as_json:
        print(
            json.dumps(
                {
                    "target": pair.target.name,
                    "draft": pair.draft.name if pair.draft else None,
                    "weights": pair.target.weights,
                    "dtype": str(pair.target.dtype).removeprefix("torch."),
                    "prompt_tokens": [len(p) for p in prompts],
                    "max_new_tokens": new_tokens,
                    "cases": [
                        {
                            "case": r.label,
                            "identical": r.identical,
                            "seconds": round(r.seconds, 3),
                            "mismatches": [vars(m) for m in r.mismatches],
                        }
                        for r in results
                    ],
                },
                indent=2,
            )
        )
    elif failed:
        sys.stderr.write(f"{len(failed)} of {len(results)} cases differ from transformers' generate\n")
    else:
        sys.stderr.write(f"all {len(results)} cases are identical to transformers' generate\n")
    return bool(failed)
