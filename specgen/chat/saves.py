"""Chat save files: the conversation and its settings as JSON, written atomically and read
back with every field checked (anything wrong is one SaveFileError line)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from specgen.config import GenerationConfig, Method, SamplingConfig, Schedule, parse_draft_tokens
from specgen.errors import ConfigError, SpecgenError
from specgen.files import write_text
from specgen.text import json_value

SAVE_FORMAT = "specgen-chat"
MAX_SAVE_BYTES = 256 << 20  # far past any conversation a context holds; `--load /dev/zero` ends with a line
SAVE_VERSION = 1
ROLES = ("user", "assistant")


class SaveFileError(SpecgenError):
    """A save file that cannot be read, is not JSON, or is not a chat save of this version."""


@dataclass(frozen=True)
class SavedChat:
    """A validated save file."""

    system: str | None
    messages: list[dict]
    settings: dict  # GenerationConfig fields, flattened (see settings_dict)
    models: dict


SETTING_NAMES = (
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "max_new_tokens",
    "draft_tokens",
    "draft_schedule",
    "draft_confidence",
)
DEVICE = "device"  # a draft length (and its confidence stop) the device chooses, as `-k device`


def settings_dict(config: GenerationConfig) -> dict:
    """The settings /set shows and a save keeps, as the command line gives them: a draft length
    left to the device is "device"; a confidence stop not given is "device" (the device's stop
    with the device's draft length, none with a length of one's own, as without
    --draft-confidence). `config_from` reads them back to the same config."""
    s = config.sampling
    return {
        "method": config.method.value,
        "max_new_tokens": config.max_new_tokens,
        "draft_tokens": DEVICE if config.device_draft_tokens else config.draft_tokens,
        "draft_schedule": config.schedule.value,
        "draft_confidence": DEVICE if config.device_confidence else config.draft_confidence,
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "seed": s.seed,
        "branching": list(config.branching),
        "beam_width": config.beam_width,
        "depth": config.depth,
    }


def config_from(settings: dict, base: GenerationConfig | None = None) -> GenerationConfig:
    """A validated GenerationConfig from (some of) settings_dict's keys over `base`; a ConfigError
    names the setting (as /set and a save file call it, not the command-line option). A draft
    length of "auto" is `-k auto`'s: the expected-gain schedule up to 8."""
    base = base or GenerationConfig()
    merged = {**settings_dict(base), **settings}

    def read(name: str, convert):
        try:
            return convert(merged[name])
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid setting {name}: {exc}") from None

    sampling = dict(
        temperature=read("temperature", _float),
        top_k=read("top_k", _int),
        top_p=read("top_p", _float),
        seed=None if merged["seed"] is None else read("seed", _int),
    )
    method = read("method", lambda value: Method.parse(str(value)))
    k, auto = read("draft_tokens", _draft_tokens)
    schedule = auto or read("draft_schedule", lambda value: Schedule(str(value)))
    confidence = read("draft_confidence", lambda value: None if value == DEVICE else _float(value))
    fields = dict(
        max_new_tokens=read("max_new_tokens", _int),
        draft_tokens=k,
        schedule=schedule,
        device_draft_tokens=merged["draft_tokens"] == DEVICE,
        floor=schedule is not Schedule.FIXED,  # and the device's k (decoding/build.resolve_draft_length)
        draft_confidence=confidence or 0.0,
        device_confidence=confidence is None,
        branching=read("branching", lambda value: tuple(_int(b) for b in _list(value))),
        beam_width=read("beam_width", _int),
        depth=read("depth", _int),
    )
    try:  # keeps what /set does not name (deterministic mode)
        return replace(base, method=method, sampling=SamplingConfig(**sampling), **fields)
    except ConfigError as exc:  # the checks name the command-line options: say the setting's name
        raise ConfigError(
            re.sub(r"--([a-z-]+)", lambda hit: hit.group(1).replace("-", "_"), str(exc)), hint=exc.hint
        ) from None


def _draft_tokens(value) -> tuple[int, Schedule | None]:
    """A number, "auto" or "device", as `-k` takes them (its placeholder k for "device"); the
    schedule "auto" brings."""
    if isinstance(value, str) and value.strip().lower() in (DEVICE, "auto"):
        return parse_draft_tokens(value)
    return _int(value), None


def _int(value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected an integer, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"expected an integer, got {value!r}") from None


def _float(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a number, got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"expected a number, got {value!r}") from None


def _list(value) -> list:
    if not isinstance(value, (list, tuple)):  # a string would be read digit by digit
        raise ValueError(f"expected a list of integers, got {value!r}")
    return list(value)


def write_save(path: Path, snapshot: dict) -> None:
    """The snapshot as indented JSON, through the atomic-write helper. A file already there is
    replaced only if it is a chat save: anything else (a prompts file, notes) is someone's work."""
    _named(path)
    # an empty file (touch, mktemp) holds nothing
    if path.is_file() and path.stat().st_size and not _is_save(path):
        raise SaveFileError(f"{path} exists and is not a specgen chat save; give another file name")
    try:
        write_text(path, json.dumps(snapshot, ensure_ascii=False, indent=2) + "\n", parents=False)
    except OSError as exc:
        raise SaveFileError(f"cannot write {path}: {exc.strerror or exc}") from None


def _named(path: Path) -> Path:
    """The path, unless no file can have its name (a NUL byte: Python's ValueError otherwise)."""
    if "\0" in str(path):
        raise SaveFileError(f"{str(path)!r} is no file name: it holds a NUL byte")
    return path


def _json_file(path: Path):
    """The file's JSON value, read up to MAX_SAVE_BYTES (a SaveFileError past it); OSError,
    UnicodeDecodeError and JSONDecodeError as they come."""
    with open(path, "rb") as stream:
        raw = stream.read(MAX_SAVE_BYTES + 1)
    if len(raw) > MAX_SAVE_BYTES:
        raise SaveFileError(f"{path} holds more than {MAX_SAVE_BYTES >> 20} MiB: not a specgen chat save")
    return json_value(raw.decode("utf-8"))


def _is_save(path: Path) -> bool:
    """Whether the file at `path` reads as a chat save of any version (its "format" field)."""
    try:
        data = _json_file(path)
    except (OSError, ValueError, SaveFileError):  # unreadable, too big, not UTF-8, not JSON
        return False
    return isinstance(data, dict) and data.get("format") == SAVE_FORMAT


def read_save(path: str | Path) -> SavedChat:
    """Read and validate a save file; anything wrong is one SaveFileError line."""
    path = _named(Path(path).expanduser())
    try:
        data = _json_file(path)
    except OSError as exc:
        raise SaveFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SaveFileError(f"{path} is not a specgen chat save (not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise SaveFileError(
            f"{path} is not a specgen chat save: invalid JSON at line {exc.lineno} "
            f"column {exc.colno} ({exc.msg})"
        ) from None
    if not isinstance(data, dict) or data.get("format") != SAVE_FORMAT:
        raise SaveFileError(f'{path} is not a specgen chat save (no "format": "{SAVE_FORMAT}")')
    if type(data.get("version")) is not int or data["version"] != SAVE_VERSION:  # true and 1.0 equal 1 too
        raise SaveFileError(
            f"{path} has save format version {data.get('version')!r}; "
            f"this specgen reads version {SAVE_VERSION}"
        )
    system, messages = data.get("system"), data.get("messages")
    if system is not None and not isinstance(system, str):
        raise SaveFileError(f'{path}: "system" must be text or null')
    if not isinstance(messages, list):
        raise SaveFileError(f'{path}: "messages" must be a list')
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or m.get("role") not in ROLES
            or not isinstance(m.get("content"), str)
            or not isinstance(m.get("interrupted", False), bool)
        ):
            raise SaveFileError(f'{path}: messages[{i}] needs "role" (user or assistant) and "content" text')
    for where, text in [("system", system or "")] + [
        (f"messages[{i}]", m["content"]) for i, m in enumerate(messages)
    ]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # JSON's \ud800 escapes: no tokenizer takes a lone surrogate
            raise SaveFileError(f"{path}: {where} holds a lone surrogate, not Unicode text") from None
    settings = data.get("settings", {})
    if not isinstance(settings, dict):
        raise SaveFileError(f'{path}: "settings" must be an object')
    known = {k: v for k, v in settings.items() if k in settings_dict(GenerationConfig())}
    try:
        config_from(known)
    except ConfigError as exc:
        raise SaveFileError(f"{path}: {exc}") from None
    models = data.get("models") if isinstance(data.get("models"), dict) else {}
    return SavedChat(system or None, [dict(m) for m in messages], known, models)
