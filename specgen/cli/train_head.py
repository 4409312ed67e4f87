"""`specgen train-head`: train an EAGLE-3 head for a target (the work is in specgen/train/)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer

from specgen.cli.groups import DeviceOpt, DtypeOpt, TargetOpt, TargetQuantOpt
from specgen.cli.options import given, sigterm_as_ctrl_c, user_errors
from specgen.config import ModelSettings
from specgen.errors import ConfigError
from specgen.models.catalog import DEFAULT_TARGET

MAX_INTERMEDIATE = 1 << 16  # the head's MLP width: past the widest target's (a 70B's 28,672) twice over


def train_head(
    ctx: typer.Context,
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="Directory for the head (config.json, model.safetensors), its data and checkpoint; a rerun "
            "resumes.",
        ),
    ],
    target: TargetOpt = DEFAULT_TARGET,
    prompts: Annotated[
        str,
        typer.Option(
            "--prompts",
            help="'code' (instructions from installed Python packages' functions, answered with their "
            "source; offline) or a prompt set / JSONL file answered by the target itself "
            "(self-distillation).",
        ),
    ] = "code",
    tokens: Annotated[int, typer.Option("--tokens", help="Training tokens to make and record.")] = 100_000,
    answer_tokens: Annotated[
        int, typer.Option("--answer-tokens", help="With a prompt set: the target's answer length per prompt.")
    ] = 256,
    minutes: Annotated[
        float,
        typer.Option(
            "--minutes",
            help="Train this many minutes more (on top of a checkpoint's), as many passes over the data as "
            "fit; 0: until --epochs are done.",
        ),
    ] = 0.0,
    epochs: Annotated[int, typer.Option("--epochs", help="Passes over the data.")] = 1,
    steps: Annotated[
        int,
        typer.Option("--ttt-steps", help="Draft steps unrolled in training (EAGLE-3's training-time test)."),
    ] = 3,
    draft_vocab: Annotated[
        int, typer.Option("--draft-vocab", help="Draft vocabulary: the most frequent target answers.")
    ] = 32000,
    intermediate: Annotated[
        int, typer.Option("--intermediate", help="The head's MLP width (0: the target's).")
    ] = 0,
    lr: Annotated[float, typer.Option("--lr", help="AdamW learning rate.")] = 3e-4,
    layers: Annotated[
        Optional[str],
        typer.Option(
            "--layers",
            help="Comma-separated target layers to read (default vLLM's: 2, L/2, L-3).",
            show_default=False,
        ),
    ] = None,
    fmt: Annotated[
        str, typer.Option("--format", help="original (EAGLE-3 / SpecForge layout) or speculators (vLLM's).")
    ] = "original",
    bf16: Annotated[
        bool,
        typer.Option("--bf16/--fp32", help="bfloat16 products while training (CPUs with native bf16, GPUs)."),
    ] = False,
    checkpoint_minutes: Annotated[
        float, typer.Option("--checkpoint-minutes", help="Minutes between checkpoints.")
    ] = 5.0,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    target_quant: TargetQuantOpt = "auto",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")] = False,
) -> None:
    """Train an EAGLE-3 draft head for the target, written in the public format.

    `--draft DIR` then drafts with it (method eagle). The target's features are recorded once;
    training can be stopped (Ctrl-C) and resumed."""
    sigterm_as_ctrl_c()  # `kill`, a job scheduler's stop: the checkpoint and the head as trained so far
    with user_errors():
        # the trainer (torch): only once the command runs
        from specgen.models.eagle_format import FORMATS
        from specgen.train.loop import Settings

        if tokens < 64:
            raise ConfigError(f"--tokens must be at least 64, got {tokens}")
        if not 1 <= steps <= 8:
            raise ConfigError(f"--ttt-steps must be in 1..8, got {steps}")
        if draft_vocab < 16:
            raise ConfigError(f"--draft-vocab must be at least 16, got {draft_vocab}")
        if fmt not in FORMATS:
            raise ConfigError(f"--format {fmt!r}: choose {', '.join(FORMATS)}")
        if not (math.isfinite(minutes) and minutes >= 0):
            raise ConfigError(f"--minutes must be a number >= 0, got {minutes}")
        if epochs < 1:
            raise ConfigError(f"--epochs must be >= 1, got {epochs}")
        if minutes and given(ctx, "epochs"):
            raise ConfigError(
                "--minutes trains for a time (as many passes as fit), --epochs for a number of "
                "passes: give one of them"
            )
        for name, value in (("--lr", lr), ("--checkpoint-minutes", checkpoint_minutes)):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a number > 0, got {value}")
        if not 0 <= intermediate <= MAX_INTERMEDIATE:
            raise ConfigError(f"--intermediate must be in 0..{MAX_INTERMEDIATE}, got {intermediate}")
        if answer_tokens < 1:
            raise ConfigError(f"--answer-tokens must be >= 1, got {answer_tokens}")
        try:
            chosen = tuple(int(x) for x in layers.split(",")) if layers else ()
        except ValueError:
            raise ConfigError(f"--layers {layers!r}: comma-separated layer numbers") from None
        settings = ModelSettings(
            target=target,
            draft=None,
            device=device,
            dtype=dtype,
            draft_quant="none",
            compile="off",
            target_quant=target_quant,
        )
        train = Settings(
            steps=steps,
            draft_vocab=draft_vocab,
            lr=lr,
            epochs=epochs,
            minutes=minutes,
            checkpoint_minutes=checkpoint_minutes,
            intermediate=intermediate,
            fmt=fmt,
            bf16=bf16,
            layers=chosen,
        )
        from specgen.train.data import CODE
        from specgen.train.head import train_head as work

        texts = None
        if prompts != CODE:
            from specgen.bench.prompts import load_prompts

            texts = [list(p.messages) if p.messages else p.text for p in load_prompts(prompts)]
        try:
            record = work(settings, out, prompts, tokens, answer_tokens, train, quiet, texts)
        except KeyboardInterrupt:
            typer.echo(f"stopped: {_kept(out)}", err=True)
            raise typer.Exit(130) from None
    acceptance = record["heldout_acceptance_per_position"]
    typer.echo(
        f"head written to {out}: {record['tokens_trained']} tokens trained in {record['seconds']:.0f} s; "
        f"held-out acceptance per draft position {acceptance} "
        f"(~{record['expected_tokens_per_round']} tokens per round)"
    )


def _kept(out: Path) -> str:
    """What a stopped run leaves in `out`, as it is (Ctrl-C may come before anything was)."""
    if (out / "checkpoint.pt").is_file():
        return f"the checkpoint and the head as trained so far are in {out}; rerun to resume"
    if any((out / "data").glob("shard-*.safetensors")):
        return f"the features recorded so far are in {out}; rerun to record the rest and train"
    return f"nothing was recorded yet; a rerun with --out {out} starts afresh"
