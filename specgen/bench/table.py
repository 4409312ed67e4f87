"""The summary as the console shows it: its columns, each row's cells, the title and the notes
(the Rich table; html.py shows the same cells and title)."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from specgen.bench.summary import noise_lines
from specgen.decoding.stats import rate


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


COLUMNS = (
    "method",
    "category",
    "prompts",
    "tok/s",
    "speed-up",
    "range",
    "acceptance",
    "tok/fwd",
    "TTFT s",
    "draft share",
    "draft step",
    "identical",
)


def draft_share(g) -> float | None:
    """The draft's share of a group's drafting and verifying time."""
    busy = (g.draft_seconds or 0.0) + (g.verify_seconds or 0.0)
    return rate(g.draft_seconds, busy) if g.draft_seconds is not None else None


def summary_cells(g) -> list[str]:
    """A summary row's cells as the table shows them (COLUMNS), for every report."""
    identical = "–" if g.identical is None else f"{g.identical}/{g.compared}"
    spread = (
        "–" if g.speedup_min is None or g.method == "plain" else f"{g.speedup_min:.2f}-{g.speedup_max:.2f}"
    )
    return [
        g.method,
        g.category,
        str(g.prompts),
        _fmt(g.wall_tokens_per_second, ".1f"),
        _fmt(g.speedup, ".2f", "x"),
        spread,
        _fmt(g.acceptance_rate, ".0%"),
        _fmt(g.tokens_per_target_forward, ".2f"),
        _fmt(g.ttft_seconds, ".2f"),
        _fmt(draft_share(g), ".0%"),
        _fmt(g.draft_step, ".2f"),
        identical,
    ]


def title(result) -> str:
    """The report's one-line title: models, formats, threads, draft length, mode, budget."""
    env, s = result.environment, result.settings
    return (
        f"specgen bench · {env['target']['name']}"
        + (f" + {env['draft']['name']}" if env.get("draft") else "")
        + f" · {env['target']['dtype']}"
        + (" + int8 linears" if env["target"].get("weights") == "int8" else "")
        + (
            f" ({env['cpu_format']['reason']})"
            if env.get("cpu_format")
            and env["target"]["device"] == "cpu"
            and env["cpu_format"]["dtype"] == env["target"]["dtype"]
            else ""
        )
        + f" · threads={env['torch_threads']} · k={s['draft_tokens']}"
        + (" (device default)" if str(s.get("draft_tokens_choice", "")).startswith("device") else "")
        + (f", stop below {s['draft_confidence']:g}" if s.get("draft_confidence") else "")
        + " · "
        f"{'greedy' if result.greedy else 'sampling'} · {s['max_new_tokens']} new tokens · "
        f"median of {s['repeats']}" + (" · INTERRUPTED" if result.interrupted else "")
    )


def notes(result) -> list[str]:
    """What the table's caption says: warm-up times, columns that failed."""
    warm = result.settings.get("warmup_seconds") or {}
    lines = (
        [
            "warm-up (compilation, capture; not in any figure): "
            + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in warm.items())
        ]
        if warm
        else []
    )
    return (
        lines
        + noise_lines(result.noise, result.prompts, result.settings.get("repeats", 1))
        + [f"{f.method} failed: {f.error}" for f in result.failures]
    )


def table(result):
    """Per method: the `all` row (bold), then one row per category."""
    caption = "\n".join(notes(result)) or None
    t = Table(
        title=escape(title(result)),
        title_justify="left",
        header_style="bold",
        caption=escape(caption) if caption else None,
        caption_justify="left",
    )
    for name in COLUMNS:
        t.add_column(name, justify="left" if name in ("method", "category") else "right")
    rows = result.summary
    for i, g in enumerate(rows):
        first = g.category == "all"
        cells = summary_cells(g)
        last = i + 1 == len(rows) or rows[i + 1].method != g.method
        t.add_row(
            *(escape(c) for c in [cells[0] if first else ""] + cells[1:]),
            style="bold" if first else None,
            end_section=last,
        )
    for f in result.failures:  # a column that stopped: its line is in the caption, no figures here
        t.add_row(escape(f.method), "failed", *["–"] * (len(COLUMNS) - 2), style="bold red", end_section=True)
    return t
