"""Options and error handling shared by the commands: the option groups (groups.py) mapped by
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

import typer

from specgen.cli.groups import GENERATION_OPTIONS, MEMORY_OPTIONS, MODEL_OPTIONS
from specgen.config import (
    DEFAULT_METHOD,
    GenerationConfig,
    MemorySettings,
    Method,
    ModelSettings,
    SamplingConfig,
    Schedule,
    parse_branching,
    parse_draft_tokens,
)
from specgen.errors import ConfigError, SpecgenError, file_error, one_line
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


def model_args(settings: ModelSettings) -> list[str]:
    """The command-line options that give `settings` (a detached server's own command line)."""
    args = []
    named = [(name, getattr(settings, name)) for name in MODEL_OPTIONS]
    named += [(name, getattr(settings.memory, name)) for name in MEMORY_OPTIONS]
    for name, value in named:  # each option is named after its field: --draft-device, draft_device
        if value is not None:
            args += ["--" + name.replace("_", "-"), str(value)]
    return args


def with_options(defaults: dict | None = None, options: dict | None = None, fixed: dict | None = None):
    """A command's option groups, declared once above: its parameter `models: ModelSettings`
    becomes the MODEL_OPTIONS and the MEMORY_OPTIONS (its `memory`), and `generation:
    GenerationConfig` the GENERATION_OPTIONS (in
    their place, for --help), and the command is called with the objects they make, mapped by
    keyword (a bad value is one error line, as in the command's body).

    `defaults`: another default for an option (bench's --max-new-tokens); `options`: another
    help for one (check's --draft); `fixed`: a generation keyword given without its option
    (bench's method, plain)."""
    defaults, options, fixed = defaults or {}, options or {}, fixed or {}
    groups = {"models": {**MODEL_OPTIONS, **MEMORY_OPTIONS}, "generation": GENERATION_OPTIONS}

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
                    models = taken["models"]
                    models["threads"] = check_count(models["threads"])
                    memory = MemorySettings(**{name: models.pop(name) for name in MEMORY_OPTIONS})
                    values["models"] = ModelSettings(**models, memory=memory)
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
    method=DEFAULT_METHOD.value,
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
