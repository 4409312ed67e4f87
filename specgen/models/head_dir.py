"""Whether a directory is an EAGLE-3 head (its config.json), without importing torch: the
command line asks before it decides whether to load anything (eagle_format.py loads it)."""

from __future__ import annotations

from pathlib import Path

from specgen.text import json_value


def read_config(path: str | Path) -> dict | None:
    """The head's config.json when `path` is an EAGLE-3 head directory, else None."""
    file = Path(path) / "config.json"
    if not Path(path).is_dir() or not file.is_file():
        return None
    try:
        config = json_value(file.read_bytes())
    except (OSError, ValueError):  # not JSON: loading it as a model says what is wrong
        return None
    if not isinstance(config, dict):
        return None
    if config.get("speculators_model_type") == "eagle3":
        return config
    architectures = config.get("architectures")
    names = (
        " ".join(a for a in architectures if isinstance(a, str)) if isinstance(architectures, list) else ""
    )
    if "Eagle3" in names or ("draft_vocab_size" in config and config.get("num_hidden_layers") == 1):
        return config
    return None


def is_head(path: str | Path | None) -> bool:
    return path is not None and read_config(path) is not None
