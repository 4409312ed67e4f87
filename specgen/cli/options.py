"""Options and error handling shared by the commands: the option groups declared once and mapped by
keyword onto ModelSettings and GenerationConfig (`with_options`), one-line errors, the signals that
end a command (reading a prompt: reading.py). No tensors here."""

from __future__ import annotations

import contextlib
import enum
import errno
import functools
import inspect
import os
import signal
import sys
import threading
from typing import Annotated, Optional

import typer

from specgen.config import (
    GenerationConfig,
    Method,
    ModelSettings,
    SamplingConfig,
    Schedule,
    parse_branching,
    parse_draft_tokens,
)
from specgen.errors import ConfigError, SpecgenError, file_error, one_line
from specgen.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specgen.runtime.threads import check_count
from specgen.status import error_line, note


class Format(str, enum.Enum):
    rich = "rich"
    plain = "plain"
    json = "json"


@contextlib.contextmanager
def user_errors():
    """Known failures become one red line and exit 1; SPECGEN_DEBUG=1 shows the traceback."""
    try:
        yield
    except SpecgenError as exc:
        if os.environ.get("SPECGEN_DEBUG"):
            raise
        error_line(str(exc), exc.hint)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:  # before the answer began (loading, reading stdin): say so, exit 130
        _interrupted()
        raise typer.Exit(130) from None
    except (typer.Exit, typer.Abort, BrokenPipeError):
        raise  # a closed pipe (`| head`): Typer exits 1 quietly, like other command-line tools
    except Exception as exc:  # an unexpected failure: still one line, with a way to see more
        if os.environ.get("SPECGEN_DEBUG"):
            raise
        if _caused_by_ctrl_c(exc):  # Ctrl-C inside an import, which wraps it in an ImportError
            _interrupted()
            raise typer.Exit(130) from None
        if isinstance(exc, OSError) and exc.errno in (
            errno.ENOSPC,
            errno.EDQUOT,
        ):  # stdout on a full disk, say
            where = f" writing {exc.filename}" if exc.filename else ""
            error_line(
                f"no space left on the device{where}: the output did not fit",
                "free some space, or send the output elsewhere",
            )
            raise typer.Exit(1) from None
        if isinstance(exc, OSError) and exc.filename:  # a path that is not what it should be
            error_line(str(file_error(exc)))
            raise typer.Exit(1) from None
        error_line(f"unexpected {one_line(exc)}", "set SPECGEN_DEBUG=1 for the traceback")
        raise typer.Exit(1) from None


def _interrupted() -> None:
    """One line for a Ctrl-C that ends the command, on a line of its own after the terminal's ^C."""
    try:
        sys.stderr.write(("\n" if sys.stderr.isatty() else "") + "interrupted\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _caused_by_ctrl_c(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def handle_signals(signums, handler) -> dict:
    """`handler` for each of `signums` (in the main thread, where Python runs handlers), except a
    SIGHUP that is ignored (under nohup a logout must stop nothing); the handlers it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {
        signum: signal.signal(signum, handler)
        for signum in signums
        if signum != signal.SIGHUP or signal.getsignal(signum) is not signal.SIG_IGN
    }


def sigterm_as_ctrl_c(hangup: bool = False) -> None:
    """SIGTERM (what `kill`, a job scheduler or a container stop sends) ends the command as Ctrl-C
    does: its summary line, and what was finished kept. With `hangup`, SIGHUP too (a closed
    terminal): for a command that must clean up after itself elsewhere (a Ray deployment)."""
    handle_signals((signal.SIGTERM, signal.SIGHUP) if hangup else (signal.SIGTERM,), _interrupt)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def ending_signals() -> list[int]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt, as Ctrl-C, and are noted in the list returned:
    for a command whose Ctrl-C does not end it (an interactive chat), which must tell a kill or a
    closed terminal from a Ctrl-C."""
    ended: list[int] = []

    def end(signum, frame) -> None:
        ended.append(signum)
        raise KeyboardInterrupt

    handle_signals((signal.SIGTERM, signal.SIGHUP), end)
    return ended


# -- the option groups, declared once ------------------------------------------------------------
TargetOpt = Annotated[
    str, typer.Option("--target", "-t", help="Target model: directory, .gguf file, catalog name or HF id.")
]
DraftOpt = Annotated[
    str,
    typer.Option(
        "--draft",
        "-d",
        help="Draft model: a catalog name, a directory or a GGUF file. Another tokenizer than the target's "
        "works for chain and lookup-chain (it drafts text).",
    ),
]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu, cuda (all GPUs) or cuda:N.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto, bfloat16, float16 or float32.")]
TargetQuantOpt = Annotated[
    str,
    typer.Option(
        "--target-quant",
        help="The target's weights on the CPU: auto (int8 for a GGUF target when --dtype is auto), none, "
        "int8. Speculative output stays exact with respect to the target as quantized.",
    ),
]
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", "-n", help="Stop after this many new tokens.")]

# ModelSettings' fields, by keyword: (the option, its default)
MODEL_OPTIONS = {
    "target": (TargetOpt, DEFAULT_TARGET),
    "draft": (DraftOpt, DEFAULT_DRAFT),
    "device": (DeviceOpt, "auto"),
    "draft_device": (
        Annotated[
            Optional[str],
            typer.Option(
                "--draft-device",
                help="Device for the draft model (default: chosen with the target's placement).",
            ),
        ],
        None,
    ),
    "dtype": (DtypeOpt, "auto"),
    "draft_quant": (
        Annotated[
            str,
            typer.Option(
                "--draft-quant",
                help="A cheaper draft (CPU): auto (int8+prune for a draft on the CPU in bf16/fp16 or in the "
                "format --dtype auto chose, else none), none, int8, int8-wo, prune, int8+prune. The "
                "target is untouched; output stays exact.",
            ),
        ],
        "auto",
    ),
    "target_quant": (TargetQuantOpt, "auto"),
    "compile": (
        Annotated[
            str,
            typer.Option(
                "--compile",
                help="Fixed-shape steps: auto (inductor on CUDA, off on the CPU), on, off, graphs (CUDA "
                "graphs of eager kernels), inductor (compiled decoder layers, then CUDA graphs).",
            ),
        ],
        "auto",
    ),
    "threads": (
        Annotated[
            Optional[int],
            typer.Option(
                "--threads",
                envvar="SPECGEN_THREADS",
                help="torch threads for the forwards on the CPU (also $SPECGEN_THREADS). Default: one per "
                "core that other processes leave free, looked at again every second.",
            ),
        ],
        None,
    ),
}

# generation_config's keywords: (the option, its default)
GENERATION_OPTIONS = {
    "method": (
        Annotated[
            str,
            typer.Option(
                "--method",
                "-m",
                help="plain, chain, lookup, lookup-chain, rsd-c, rsd-s, multi-draft, or eagle (with an "
                "EAGLE-3 head as --draft; chain means eagle there).",
            ),
        ],
        "chain",
    ),
    "max_new_tokens": (MaxNewOpt, 256),
    "draft_tokens": (
        Annotated[
            str,
            typer.Option(
                "--draft-tokens",
                "-k",
                help="Draft tokens per round: N (fixed: every round drafts N), 'auto' (adaptive, up to 8) "
                "or 'device' (default: the k best for this device's measured costs; 4 on a GPU). Under "
                "'device' and 'auto' a row drafts less, down to none, where its rounds show it does not pay.",
            ),
        ],
        "device",
    ),
    "draft_schedule": (
        Annotated[
            Optional[str],
            typer.Option(
                "--draft-schedule",
                help="fixed, additive or expected-gain (draft length per round, up to --draft-tokens).",
            ),
        ],
        None,
    ),
    "draft_confidence": (
        Annotated[
            Optional[float],
            typer.Option(
                "--draft-confidence",
                help="chain and lookup-chain: stop a draft early when the draft's top probability falls "
                "below this (0: off; default: 0.5 with --draft-tokens device for a draft on the CPU, "
                "else off).",
                show_default=False,
            ),
        ],
        None,
    ),
    "deterministic": (
        Annotated[
            bool,
            typer.Option(
                "--deterministic",
                help="Replay every window at a fixed shape; output independent of method, draft and batch.",
            ),
        ],
        False,
    ),
    "verify_window": (
        Annotated[
            int, typer.Option("--verify-window", help="Deterministic mode: tokens per replayed window.")
        ],
        32,
    ),
    "temperature": (
        Annotated[float, typer.Option("--temperature", help="0 is greedy; >0 samples (lossless).")],
        0.0,
    ),
    "top_k": (Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0: off).")], 0),
    "top_p": (Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (1: off).")], 1.0),
    "seed": (Annotated[Optional[int], typer.Option("--seed", help="Seed for every random draw.")], None),
    "branching": (
        Annotated[
            str, typer.Option("--branching", help="rsd-c/multi-draft: children per depth, e.g. 2,2,1.")
        ],
        "2,2,1",
    ),
    "beam_width": (Annotated[int, typer.Option("--beam-width", help="rsd-s: beam width W.")], 3),
    "depth": (Annotated[int, typer.Option("--depth", help="rsd-s: tree depth L.")], 4),
}


def model_args(settings: ModelSettings) -> list[str]:
    """The command-line options that give `settings` (a detached server's own command line)."""
    args = []
    for name in MODEL_OPTIONS:  # each option is named after its field: --draft-device, draft_device
        value = getattr(settings, name)
        if value is not None:
            args += ["--" + name.replace("_", "-"), str(value)]
    return args


def with_options(defaults: dict | None = None, options: dict | None = None, fixed: dict | None = None):
    """A command's option groups, declared once above: its parameter `models: ModelSettings`
    becomes the MODEL_OPTIONS and `generation: GenerationConfig` the GENERATION_OPTIONS (in
    their place, for --help), and the command is called with the objects they make, mapped by
    keyword (a bad value is one error line, as in the command's body).

    `defaults`: another default for an option (bench's --max-new-tokens); `options`: another
    help for one (check's --draft); `fixed`: a generation keyword given without its option
    (bench's method, plain)."""
    defaults, options, fixed = defaults or {}, options or {}, fixed or {}
    groups = {"models": MODEL_OPTIONS, "generation": GENERATION_OPTIONS}

    def wrap(command):
        signature = inspect.signature(command, eval_str=True)
        parameters, members = [], {}
        for parameter in signature.parameters.values():
            if parameter.name not in groups:
                parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY))
                continue
            members[parameter.name] = [name for name in groups[parameter.name] if name not in fixed]
            for name in members[parameter.name]:
                annotation, default = groups[parameter.name][name]
                parameters.append(
                    inspect.Parameter(
                        name,
                        inspect.Parameter.KEYWORD_ONLY,
                        annotation=options.get(name, annotation),
                        default=defaults.get(name, default),
                    )
                )

        @functools.wraps(command)
        def run(**values):
            with user_errors():
                taken = {
                    group: {name: values.pop(name) for name in names} for group, names in members.items()
                }
                if "models" in taken:
                    taken["models"]["threads"] = check_count(taken["models"]["threads"])
                    values["models"] = ModelSettings(**taken["models"])
                if "generation" in taken:
                    values["generation"] = generation_config(**taken["generation"], **fixed)
            return command(**values)

        run.__signature__ = signature.replace(parameters=parameters)  # Typer passes every option by name
        return run

    return wrap


# a drafting option's keyword here -> its GenerationConfig name (Method.options)
DRAFTING_OPTIONS = {
    "draft_tokens": "draft_tokens",
    "draft_schedule": "schedule",
    "draft_confidence": "draft_confidence",
    "branching": "branching",
    "beam_width": "beam_width",
    "depth": "depth",
}


def given(ctx, name: str) -> bool:
    """Was option `name` given on the command line (or by an environment variable)?"""
    source = ctx.get_parameter_source(name) if ctx is not None else None
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT", "PROMPT")


def note_unused(ctx, config: GenerationConfig) -> None:
    """A note per drafting option given on the command line that this run does not read
    (`--branching` with chain, `--verify-window` without `--deterministic`): it is not refused,
    as chat's /set may switch to a method that reads it, but never ignored silently."""
    for name in [name for name in (*DRAFTING_OPTIONS, "verify_window") if given(ctx, name)]:
        flag = "--" + name.replace("_", "-")
        if name == "verify_window":
            if not config.deterministic:
                note(
                    f"specgen: {flag} sets deterministic mode's window; without --deterministic it is unused"
                )
            continue
        if DRAFTING_OPTIONS[name] not in config.method.options:
            users = [m.value for m in Method if DRAFTING_OPTIONS[name] in m.options]
            note(f"specgen: {flag} is unused by {config.method.value} (it applies to {', '.join(users)})")


def generation_config(
    *,
    method="chain",
    max_new_tokens=256,
    draft_tokens="device",
    temperature=0.0,
    top_k=0,
    top_p=1.0,
    seed=None,
    branching="2,2,1",
    beam_width=3,
    depth=4,
    deterministic=False,
    verify_window=32,
    draft_schedule=None,
    draft_confidence=None,
    logprobs=None,
):
    """Options -> a validated GenerationConfig (shared by run, chat and bench). Which drafter a
    method gets on the loaded pair (chain with an EAGLE-3 head is eagle) is decoding/build's."""
    k, auto = parse_draft_tokens(draft_tokens)
    try:
        chosen = Schedule(draft_schedule) if draft_schedule else (auto or Schedule.FIXED)
    except ValueError:
        raise ConfigError(
            f"unknown --draft-schedule '{draft_schedule}'; use fixed, additive or expected-gain"
        ) from None
    chosen_method = Method.parse(method)
    return GenerationConfig(
        method=chosen_method,
        max_new_tokens=max_new_tokens,
        draft_tokens=k,
        schedule=chosen,
        device_draft_tokens=str(draft_tokens).strip().lower() == "device",
        floor=chosen is not Schedule.FIXED,  # and the device's k (decoding/build.resolve_draft_length)
        sampling=SamplingConfig(
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, logprobs=logprobs
        ),
        branching=parse_branching(branching),
        beam_width=beam_width,
        depth=depth,
        deterministic=deterministic,
        verify_window=verify_window,
        draft_confidence=0.0 if draft_confidence is None else draft_confidence,
        device_confidence=draft_confidence is None,
    )
