"""Bench reports: JSON, CSV and the plot, each output file checked before a run and written
atomically after it (the console's table and the page's cells: table.py). No measuring here
(measure.py) and no Typer (cli/bench.py)."""

from __future__ import annotations

import csv
import json
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console

from specgen.errors import ConfigError
from specgen.files import atomic_write
from specgen.status import error_line


# -- output files ----------------------------------------------------------------------------
def check_not_read(paths: dict, reads: list[Path]) -> None:
    """No output option names a file the run reads (its prompts): the report would replace it."""
    read = {Path(p).expanduser().resolve() for p in reads}
    for option, path in paths.items():
        if path is not None and Path(path).expanduser().resolve() in read:
            raise ConfigError(f"{option} {path} is the prompt file this run reads; give another file")


def check_outputs(paths: dict) -> None:
    """Fail before minutes of measuring if an output file cannot be written: its folder is made
    (as the writers would) and must take a file, the path must not be a folder, and no two
    options may name the same file."""
    seen: dict[Path, str] = {}
    for option, path in paths.items():
        if path is None:
            continue
        path = Path(path)
        try:
            key = path.expanduser().resolve()
            is_dir = path.is_dir()
        except OSError as exc:  # a name too long for the file system, a loop of links
            raise ConfigError(f"cannot write {option} {path}: {exc.strerror or exc}") from None
        if key in seen:
            raise ConfigError(f"{seen[key]} and {option} both name {path}; give them different files")
        seen[key] = option
        if is_dir:
            raise ConfigError(f"{option} {path} is a directory; give a file name")
        folder = next((p for p in path.parents if p.exists()), None)
        if folder is not None and not folder.is_dir():
            raise ConfigError(f"cannot write {option} {path}: {folder} is a file, not a folder")
        if option == "--plot":
            _check_plot_format(path)
        if path.exists() and not path.is_file():  # a device or a pipe: written in place (files.atomic_write)
            if not os.access(path, os.W_OK):
                raise ConfigError(f"cannot write {option} {path}: permission denied")
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # os.access says yes to root even on a read-only mount; only a real write tells
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"):
                pass
        except OSError as exc:
            raise ConfigError(f"cannot write {option} {path}: {exc.strerror or exc}") from None


def plot_kind(path) -> str:
    """The image format named by the file's extension; png without one."""
    return Path(path).suffix.lstrip(".").lower() or "png"


def _check_plot_format(path: Path) -> None:
    from matplotlib.figure import Figure  # the optional `plot` extra

    kinds = Figure().canvas.get_supported_filetypes()
    kind = plot_kind(path)
    if kind not in kinds:
        raise ConfigError(
            f"--plot {path}: matplotlib cannot write '.{kind}' files; use one of: "
            + ", ".join(f".{k}" for k in sorted(kinds))
        )


def save(option: str, path: Path, write, fallback: bool) -> bool:
    """Write one output atomically; on failure say so in one line and, for data files, where the
    data went instead (a file in the temp directory). True if `path` was written."""
    path = Path(path)
    try:
        atomic_write(path, write)
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
        where = ""
        if fallback:
            spare = (
                Path(tempfile.gettempdir())
                / f"specgen-bench-{os.getpid()}-{time.time_ns()}{path.suffix or '.out'}"
            )
            try:
                atomic_write(spare, write)
                where = f"; the data went to {spare} instead"
            except (OSError, ValueError):
                where = "; no copy could be written either, only the table above is left"
        error_line(f"cannot write {option} {path}: {reason}{where}")
        return False
    # soft_wrap: a long path stays one line that a user can copy, whatever the terminal's width
    Console(emoji=False, stderr=True, highlight=False, soft_wrap=True).print(
        f"wrote {path}", style="dim", markup=False
    )
    return True


# -- reports ---------------------------------------------------------------------------------
# JSON keys kept for one release beside their new names, old -> new (benchmarks/methodology.md)
OLD_KEYS = {
    "tokens_per_second": "wall_tokens_per_second",
    "decode_tokens_per_second": "after_first_tokens_per_second",  # the name `run`'s stats use otherwise
}


# bench's JSON and CSV row of a generation (runners.Generation.record), in this order
RECORD_FIELDS = (
    "prompt_id",
    "category",
    "method",
    "repeat",
    "prompt_tokens",
    "new_tokens",
    "seconds",
    "prefill_seconds",
    "ttft_seconds",
    "wall_tokens_per_second",  # and its old key, tokens_per_second, for one release (OLD_KEYS)
    "after_first_tokens_per_second",  # and its old key, decode_tokens_per_second, for one release
    "acceptance_rate",
    "tokens_per_target_forward",
    "target_forwards",
    "drafted",
    "accepted",
    "accepted_length_histogram",
    "draft_seconds",
    "verify_seconds",
    "read_seconds",
    "read_drafted",
    "peak_memory_bytes",
    "stop_reason",
    "token_ids",
)


def to_json(result) -> dict:
    return {
        "schema": "specgen-bench/1",
        "environment": result.environment,
        "settings": result.settings,
        "methods": result.methods,
        "interrupted": result.interrupted,
        "failures": [asdict(f) for f in result.failures],  # columns that stopped: method, where, one line
        "noise": asdict(result.noise) if result.noise is not None else None,  # plain against plain
        "summary": [with_old_keys(asdict(g)) for g in result.summary],
        "prompts": [with_old_keys(asdict(p)) for p in result.prompts],
        "measurements": [m.record() for m in result.measurements],
    }


def with_old_keys(record: dict) -> dict:
    """A record with the keys kept for one release beside their new names (OLD_KEYS),
    each where it stood: `tokens_per_second` just before `wall_tokens_per_second`."""
    out = {}
    for key, value in record.items():
        out.update({old: record[new] for old, new in OLD_KEYS.items() if new == key})
        out[key] = value
    return out


def write_json(result, path: Path) -> None:
    """Indented, except that each per-prompt record and measurement sits on one line."""
    data = to_json(result)
    parts = []
    for key, value in data.items():
        if key in ("prompts", "measurements"):
            rows = ",\n  ".join(json.dumps(v) for v in value)
            parts.append(f" {json.dumps(key)}: [\n  {rows}\n ]" if value else f" {json.dumps(key)}: []")
        else:
            parts.append(f" {json.dumps(key)}: " + json.dumps(value, indent=1).replace("\n", "\n "))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{\n" + ",\n".join(parts) + "\n}\n", encoding="utf-8")


# The CSV's columns: a measurement's record (the keys kept for one release included), then its
# prompt's verdict and speed-up, then the line of a column that stopped
CSV_COLUMNS = [
    *(key for key in with_old_keys(dict.fromkeys(RECORD_FIELDS)) if key != "token_ids"),
    "identical_to_plain",
    "speedup_prompt",
    "token_ids",
    "error",
]


def histogram_text(histogram: dict[str, int] | None) -> str:
    """{"0": 3, "4": 12} -> "0:3 4:12" (accepted length : rounds)."""
    return "" if not histogram else " ".join(f"{k}:{v}" for k, v in histogram.items())


def write_csv(result, path: Path) -> None:
    """One row per measurement; the per-prompt exactness and speed-up are repeated on its rows.
    A column that stopped adds one row where it stopped, its line under `error` (repeat empty:
    in the warm-up)."""
    by_prompt = {(p.prompt_id, p.method): p for p in result.prompts}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for m in result.measurements:
            row = m.record()
            summary = by_prompt[(m.prompt_id, m.method)]
            row["accepted_length_histogram"] = histogram_text(m.accepted_length_histogram)
            row["token_ids"] = " ".join(map(str, m.token_ids))
            row["identical_to_plain"] = summary.identical_to_plain
            row["speedup_prompt"] = summary.speedup
            writer.writerow({k: _cell(row.get(k)) for k in CSV_COLUMNS})
        for failure in result.failures:
            row = asdict(failure)
            writer.writerow({k: _cell(row.get(k)) for k in CSV_COLUMNS})


def _cell(value):
    """A CSV cell; text a spreadsheet would run as a formula (an id like `=cmd|...`) is quoted
    with a leading apostrophe, as OWASP advises."""
    if value is None:
        return ""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401 (the optional `plot` extra, imported only for --plot)
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib, which is not installed",
            hint="pip install 'specgen[plot]' or pip install matplotlib",
        ) from None


def write_plot(result, path: Path, kind: str | None = None) -> None:
    """Two panels, speed-up over plain (geometric mean) and tokens per target forward: bars per
    method, grouped by category (`all` first)."""
    require_matplotlib()
    import matplotlib  # the optional `plot` extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = list(dict.fromkeys(g.category for g in result.summary))
    methods = [m for m in result.methods if m != "plain"]
    cells = {(g.method, g.category): g for g in result.summary}
    width = 0.8 / max(len(methods), 1)
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 1.2 * len(categories) + 3), 7.5), sharex=True)
    for panel, (attr, label) in zip(
        axes,
        [
            ("speedup", "speed-up over plain (geo mean)"),
            ("tokens_per_target_forward", "tokens per target forward"),
        ],
    ):
        for i, method in enumerate(methods):
            values = [getattr(cells[(method, c)], attr) if (method, c) in cells else None for c in categories]
            xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(categories))]
            panel.bar(xs, [v or 0.0 for v in values], width, label=method)
        panel.axhline(1.0, color="black", linewidth=0.8)
        panel.set_ylabel(label)
    axes[1].set_xticks(range(len(categories)), categories, rotation=20, ha="right")
    env = result.environment
    draft = env["draft"]["name"] if env.get("draft") else "-"
    fig.suptitle(
        f"{env['target']['name']} / {draft} · {env['target']['dtype']} · threads={env['torch_threads']}",
        fontsize="medium",
    )
    if methods:  # plain alone (or every other column failed): nothing to tell apart
        fig.legend(
            *axes[0].get_legend_handles_labels(),
            loc="lower center",
            ncol=min(len(methods), 4),
            fontsize="small",
            frameon=False,
        )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, format=kind or plot_kind(path))
    plt.close(fig)
