"""`specgen bench --html FILE`: the bench as one self-contained page, to keep or share.

It holds the table as the terminal shows it, and three plots drawn as inline SVG (no script, no
library, nothing fetched): speed-up over plain per method and category with each group's range
over its prompts, acceptance per draft position, and the draft's share of decode time. Below
them, each method's first token that differs from plain, prompt by prompt (greedy runs). The
figures come from the same summary the table and --json show (table.summary_cells)."""

from __future__ import annotations

from html import escape
from pathlib import Path

from specgen.bench import table
from specgen.bench.summary import PLAIN

# Okabe and Ito's palette: told apart with the common colour-vision deficiencies
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
WIDTH, HEIGHT, LEFT, BOTTOM, TOP = 720, 280, 56, 64, 16

STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 1rem auto; max-width: 84rem; padding: 0 0.8rem;
       color: #1b1f24; background: #fff; overflow-wrap: anywhere; }
h1 { font-size: 1.3rem; } h2 { font-size: 1.1rem; margin-top: 1.6rem; }
.table { overflow-x: auto; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; font-size: 0.9rem; }
th, td { padding: 0.2rem 0.55rem; border-bottom: 1px solid #d0d7de; text-align: right; white-space: nowrap; }
th:nth-child(-n+2), td:nth-child(-n+2) { text-align: left; }
td:first-child { white-space: normal; overflow-wrap: anywhere; max-width: 11rem; }
tr.all td { font-weight: 600; border-top: 2px solid #8c959f; }
tr.failed td { color: #a40e26; font-weight: 600; }
figure { margin: 0.6rem 0 1rem; } figcaption { color: #57606a; font-size: 0.9rem; }
svg { width: 100%; height: auto; max-width: 820px; display: block; }
svg text { font: 11px system-ui, sans-serif; fill: #1b1f24; }
.key { display: flex; flex-wrap: wrap; gap: 0.3rem 1rem; list-style: none; padding: 0; font-size: 0.9rem; }
.swatch { display: inline-block; width: 0.9em; height: 0.9em; margin-right: 0.3em; vertical-align: -0.1em; }
.note { color: #57606a; font-size: 0.9rem; }
"""


def write_html(result, path: Path) -> None:
    """The page for `result` (a BenchResult) at `path`."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(page(result), encoding="utf-8")


def page(result) -> str:
    env = result.environment
    methods = [m for m in result.methods if m != PLAIN]
    colours = {m: PALETTE[i % len(PALETTE)] for i, m in enumerate(methods)}
    machine = " · ".join(
        str(x)
        for x in (
            env.get("cpu"),
            f"torch {env.get('torch')}",
            f"specgen {env.get('specgen')}",
            env.get("date"),
        )
        if x
    )
    parts = [
        f"<h1>{escape(table.title(result))}</h1>",
        f'<p class="note">{escape(machine)}</p>',
        *(f'<p class="note">{escape(line)}</p>' for line in table.notes(result)),
        "<h2>Summary</h2>",
        _table(result),
        "<h2>Speed-up over plain</h2>",
        _key(colours),
        _speedups(result, methods, colours),
        "<h2>Acceptance per draft position</h2>",
        _positions(result, methods, colours),
        "<h2>Draft share of decode time</h2>",
        _shares(result, methods, colours),
        "<h2>First token that differs from plain</h2>",
        _mismatches(result, methods),
    ]
    return (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{escape(table.title(result))}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
        + "\n".join(parts)
        + "\n</body>\n</html>\n"
    )


def _table(result) -> str:
    head = "".join(f'<th scope="col">{escape(name)}</th>' for name in table.COLUMNS)
    rows = []
    for g in result.summary:
        cells = table.summary_cells(g)
        kind = ' class="all"' if g.category == "all" else ""
        if g.category != "all":  # the method once, on its `all` row, as the terminal's table
            cells[0] = ""
        rows.append(f"<tr{kind}>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>")
    for f in result.failures:
        rows.append(
            '<tr class="failed">'
            + f"<td>{escape(f.method)}</td><td>failed</td>"
            + "<td>–</td>" * (len(table.COLUMNS) - 2)
            + "</tr>"
        )
    body = "".join(rows)
    return f'<div class="table"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _key(colours: dict) -> str:
    items = "".join(
        f'<li><svg class="swatch" viewBox="0 0 10 10" aria-hidden="true"><rect width="10" height="10" '
        f'fill="{c}"/></svg>{escape(m)}</li>'
        for m, c in colours.items()
    )
    return f'<ul class="key" aria-label="methods">{items}</ul>'


def _frame(label: str, top: float, ticks: list[float], fmt: str, plot: str) -> str:
    """An SVG with a y axis from 0 to `top`, gridlines at `ticks`, and the plot's marks."""
    inner = HEIGHT - BOTTOM - TOP
    grid = []
    for t in ticks:
        y = TOP + inner * (1 - t / top)
        grid.append(
            f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - 8}" y2="{y:.1f}" stroke="#d0d7de"/>'
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{t:{fmt}}</text>'
        )
    return (
        f'<figure><svg viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(label)}" '
        f'xmlns="http://www.w3.org/2000/svg" data-plot="{escape(label)}">{"".join(grid)}{plot}</svg>'
        f"<figcaption>{escape(label)}</figcaption></figure>"
    )


def _y(value: float, top: float) -> float:
    return TOP + (HEIGHT - BOTTOM - TOP) * (1 - value / top)


def _groups(
    labels: list[str], series: list[str], value, colours: dict, top: float, fmt: str, extra=None
) -> str:
    """Grouped bars: a group per label, a bar per series (value(label, series) or None)."""
    span = (WIDTH - LEFT - 8) / max(len(labels), 1)
    bar = 0.8 * span / max(len(series), 1)
    marks = []
    slanted = (
        max(map(len, labels), default=0) * CHAR_PX > span - 4
    )  # all alike: one that does not fit slants them all
    for i, label in enumerate(labels):
        x0 = LEFT + i * span + 0.1 * span
        x = LEFT + (i + 0.5) * span
        marks.append(_label(label, x, slanted))
        for j, name in enumerate(series):
            v = value(label, name)
            if v is None:
                continue
            x, y = x0 + j * bar, _y(v, top)
            marks.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(bar - 2, 1):.1f}" '
                f'height="{_y(0, top) - y:.1f}" fill="{colours[name]}"><title>{escape(name)}, '
                f"{escape(label)}: {v:{fmt}}</title></rect>"
            )
            if extra is not None:
                marks.append(extra(label, name, x + (bar - 2) / 2, top))
    return "".join(marks)


CHAR_PX, SLANTED_CHARS = (
    6,
    18,
)  # an 11px character's width, about; what a slanted label's room below the axis holds


def _label(label: str, x: float, slanted: bool) -> str:
    """A group's label: level where the labels fit their groups' width, else slanted (so names do
    not run into each other) and cut to the room below the axis, the whole name in its tooltip."""
    if not slanted:
        return f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{escape(label)}</text>'
    shown = label if len(label) <= SLANTED_CHARS else label[: SLANTED_CHARS - 1] + "\u2026"
    return (
        f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 14}" text-anchor="end" '
        f'transform="rotate(-25 {x:.1f} {HEIGHT - BOTTOM + 14})"><title>{escape(label)}</title>'
        f"{escape(shown)}</text>"
    )


def _ticks(top: float, step: float) -> list[float]:
    return [round(i * step, 6) for i in range(int(top / step + 1e-9) + 1)]


def _speedups(result, methods: list[str], colours: dict) -> str:
    cells = {(g.method, g.category): g for g in result.summary}
    categories = list(dict.fromkeys(g.category for g in result.summary))
    values = [g.speedup_max or g.speedup or 0.0 for g in result.summary if g.method in methods]
    top = max([1.5, *values]) * 1.1
    step = 0.25 if top <= 2.5 else 0.5

    def value(category, method):
        g = cells.get((method, category))
        return None if g is None else g.speedup

    def whisker(category, method, x, top):  # the group's range over its prompts
        g = cells.get((method, category))
        if g is None or g.speedup_min is None:
            return ""
        low, high = _y(g.speedup_min, top), _y(g.speedup_max, top)
        return (
            f'<line x1="{x:.1f}" y1="{low:.1f}" x2="{x:.1f}" y2="{high:.1f}" stroke="#1b1f24" '
            f'stroke-width="1.5">'
            f"<title>{escape(method)}, {escape(category)}: {g.speedup_min:.2f}-{g.speedup_max:.2f}x over its "
            "prompts</title></line>"
        )

    one = _y(1.0, top)
    plot = (
        _groups(categories, methods, value, colours, top, ".2f", whisker)
        + f'<line x1="{LEFT}" y1="{one:.1f}" x2="{WIDTH - 8}" y2="{one:.1f}" stroke="#1b1f24" '
        'stroke-dasharray="4 3"><title>plain: 1.00x</title></line>'
    )
    return _frame(
        "speed-up over plain (geometric mean over prompts; whiskers: the range over prompts; dashed: plain)",
        top,
        _ticks(top, step),
        ".2f",
        plot,
    )


def _positions(result, methods: list[str], colours: dict) -> str:
    rows = {
        g.method: g.acceptance_per_position
        for g in result.summary
        if g.category == "all" and g.method in methods and g.acceptance_per_position
    }
    longest = max((len(v) for v in rows.values()), default=0)
    labels = [str(i) for i in range(1, longest + 1)]
    plot = _groups(
        labels,
        list(rows),
        lambda label, m: rows[m][int(label) - 1] if int(label) <= len(rows[m]) else None,
        colours,
        1.0,
        ".0%",
    )
    frame = _frame(
        "share of drafting rounds whose i-th draft token was accepted (i on the x axis), all prompts",
        1.0,
        _ticks(1.0, 0.25),
        ".0%",
        plot,
    )
    return (
        frame
        if rows
        else frame + '<p class="note">No method drafted (plain alone, or prompt lookup found nothing).</p>'
    )


def _shares(result, methods: list[str], colours: dict) -> str:
    shares = {
        g.method: table.draft_share(g) for g in result.summary if g.category == "all" and g.method in methods
    }
    plot = _groups(
        ["all prompts"],
        [m for m in shares if shares[m] is not None],
        lambda label, m: shares[m],
        colours,
        1.0,
        ".0%",
    )
    return _frame(
        "the draft's share of drafting and verifying time, all prompts", 1.0, _ticks(1.0, 0.25), ".0%", plot
    )


def _mismatches(result, methods: list[str]) -> str:
    if not result.greedy:
        return '<p class="note">Sampled runs: outputs are compared in distribution, not token by token.</p>'
    items = []
    for method in methods:
        differing = [p for p in result.prompts if p.method == method and p.identical_to_plain is False]
        compared = [p for p in result.prompts if p.method == method and p.identical_to_plain is not None]
        if not differing:
            items.append(
                f"<li><strong>{escape(method)}</strong>: identical to plain on {len(compared)}/"
                f"{len(compared)} prompts</li>"
            )
            continue
        where = ", ".join(f"{escape(p.prompt_id)} at token {p.first_mismatch}" for p in differing)
        items.append(
            f"<li><strong>{escape(method)}</strong>: differs from plain on {len(differing)}/{len(compared)} "
            f"prompts: {where}</li>"
        )
    return f"<ul>{''.join(items)}</ul>"
