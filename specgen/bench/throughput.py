"""Throughput of batched decoding, and what deterministic mode costs: `specgen bench --batch-sizes`.

One cell decodes the WHOLE prompt set with one (method, batch size, mode) and reports the
aggregate throughput (all new tokens over the wall time from the first prefill to the last
token). Batch size 1 runs the prompts one after another through the Engine (every method);
larger batches run the same engine with dynamic batching (every method). Modes:
`off` (deterministic mode off) and one deterministic cell per verify window.

Per cell it reports: the speed-up over plain at batch size 1 (off), the cost of deterministic
mode (its throughput over the same method and batch size with the mode off), the rollback rate
(rolled-back tokens over tokens generated), and how many prompts' tokens differ from the
reference of the same mode: plain at batch 1, off, for `off` cells (how often batching or the
method changes the output when nothing enforces it) and the first deterministic cell of plain
at batch 1 with the same window for deterministic cells (which must be 0).

`Cell` is also the --concurrency mode's (bench/concurrency.py): a method at a number of clients.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace

from rich.markup import escape
from rich.table import Table

from specgen.config import GenerationConfig, Method
from specgen.decoding.build import build_engine
from specgen.decoding.run import run_prompts
from specgen.decoding.stats import Stats, rate
from specgen.errors import ConfigError, one_line

OFF = "off"


class Width(enum.Enum):
    """What a cell's width counts."""

    BATCH = "batch"  # rows that one engine decodes together: --batch-sizes
    CLIENTS = "clients"  # streaming clients of one server: --concurrency


@dataclass
class Cell:
    """One method measured at one width: its new tokens over the wall time and its speed-up over
    plain. A BATCH cell decodes the whole prompt set in one mode (deterministic mode off, or a
    verify window) and compares its tokens with the mode's reference; a CLIENTS cell holds the
    requests of one run against a server, or of its runs pooled, with their time to the first
    token and per token."""

    method: str
    width: Width
    size: int  # the batch size, or the number of clients
    count: int  # BATCH: the prompts it decodes; CLIENTS: the requests answered
    tokens: int
    seconds: float
    tokens_per_second: float
    speedup: float | None = None  # BATCH: over plain, batch 1, off; CLIENTS: over plain, the same clients
    drafted: int = 0
    accepted: int = 0
    # BATCH cells
    mode: str = OFF  # "off", or "window N" in deterministic mode
    deterministic_cost: float | None = None  # this tok/s / the same method and batch size, off
    replays: int = 0
    rollbacks: int = 0
    rolled_back_tokens: int = 0
    rollback_rate: float | None = None  # rolled-back tokens / (kept + rolled-back) tokens
    differs: int | None = None  # prompts whose tokens differ from the mode's reference
    skipped: str | None = None  # why the cell was not measured
    interrupted: bool = False  # Ctrl-C came before (or while) this cell was measured
    failed: bool = False  # its method raised: `skipped` says what; the other cells go on
    outputs: list[list[int]] | None = None
    # CLIENTS cells
    ttft_p50: float = 0.0
    ttft_p95: float = 0.0
    tpot_p50: float = 0.0  # seconds per output token after the first, per request
    tpot_p95: float = 0.0
    errors: list[str] = field(default_factory=list)  # failed requests, one line each
    runs: list[float] = field(default_factory=list)  # each run's tok/s, in order: the machine's drift shows
    timings: list[Stats] = field(
        default_factory=list
    )  # each request's Stats, as its client saw it (not written)

    @property
    def acceptance_rate(self) -> float | None:
        return rate(self.accepted, self.drafted)

    def record(self) -> dict:
        """The cell as the JSON of its mode writes it (RECORD_FIELDS)."""
        return {name: getattr(self, _RENAMED.get(name, name)) for name in RECORD_FIELDS[self.width]}


# each mode's JSON fields of a cell, in this order, and those the cell names otherwise
RECORD_FIELDS = {
    Width.BATCH: (
        "method",
        "batch_size",
        "mode",
        "prompts",
        "new_tokens",
        "seconds",
        "tokens_per_second",
        "speedup",
        "deterministic_cost",
        "drafted",
        "accepted",
        "replays",
        "rollbacks",
        "rolled_back_tokens",
        "rollback_rate",
        "differs",
        "skipped",
        "interrupted",
        "failed",
        "outputs",
    ),
    Width.CLIENTS: (
        "method",
        "concurrency",
        "requests",
        "tokens",
        "seconds",
        "tokens_per_second",
        "ttft_p50",
        "ttft_p95",
        "tpot_p50",
        "tpot_p95",
        "acceptance_rate",
        "speedup",
        "errors",
        "runs",
    ),
}
_RENAMED = {
    "batch_size": "size",
    "concurrency": "size",
    "prompts": "count",
    "requests": "count",
    "new_tokens": "tokens",
}


MAX_SIZE = 1024  # a batch width, a window or a number of concurrent clients


def parse_sizes(text: str | None, what: str) -> list[int]:
    if text is None or not text.strip():
        return []
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{what} takes a comma list of integers, got '{text}'") from None
    if not values or any(not 1 <= v <= MAX_SIZE for v in values):
        raise ConfigError(f"{what} values must be in 1..{MAX_SIZE}, got '{text}'")
    return list(dict.fromkeys(values))


def decode_all(
    pair, method: Method, prompts: list[list[int]], config: GenerationConfig, batch_size: int
) -> tuple[list[list[int]], float, Stats]:
    """Every prompt's new tokens (input order), the wall time, and the prompts' Stats merged.
    Batch size 1 runs the prompts one after another through the same loop."""
    config = replace(config, method=method)
    pair.memories.clear()  # a suffix memory holds no other cell's text
    engine = build_engine(pair, config)
    outputs: list[list[int]] = []
    total = Stats(method=method.value, generations=0)
    started = time.perf_counter()
    for _, outcome in run_prompts(engine, pair.target.tokenizer, prompts, config, batch_size):
        if outcome.interrupted:  # run_prompts kept Ctrl-C to itself; a cut cell is no measurement
            raise KeyboardInterrupt
        outputs.append(outcome.token_ids)
        total = total.merge(outcome.stats)
    return outputs, time.perf_counter() - started, total


def run_throughput(
    pair,
    methods: list[str],
    prompts: list[list[int]],
    config: GenerationConfig,
    batch_sizes: list[int],
    windows: list[int],
    include_off: bool = True,
    on_cell=None,
) -> list[Cell]:
    """The grid methods x batch sizes x modes, plain first; a warm-up cell is run and dropped.

    Ctrl-C keeps the cells measured so far; the others are returned skipped and `interrupted`.
    A cell whose method raises is returned `failed`, with its line; the others are measured.
    """
    modes: list[int | None] = ([None] if include_off else []) + list(windows)
    names = ["plain"] + [m for m in methods if m != "plain"]
    engine_methods = {m.value: m for m in Method}
    unknown = [m for m in names if m not in engine_methods]
    if unknown:
        raise ConfigError(f"--batch-sizes measures specgen's own methods; '{unknown[0]}' is not one")
    grid = [(name, size, window) for name in names for size in batch_sizes for window in modes]
    cells: list[Cell] = []
    try:
        decode_all(
            pair, Method.PLAIN, prompts[:1], replace(config, max_new_tokens=min(8, config.max_new_tokens)), 1
        )
        for name, size, window in grid:
            try:
                cell = _measure_cell(pair, engine_methods[name], name, size, window, prompts, config)
            except Exception as exc:  # noqa: BLE001 - one cell's failure is its line, never the others' loss
                cell = Cell(
                    name,
                    Width.BATCH,
                    size,
                    len(prompts),
                    0,
                    0.0,
                    0.0,
                    mode=_mode(window),
                    skipped=f"failed: {one_line(exc)}",
                    failed=True,
                )
            cells.append(cell)
            if on_cell is not None:
                on_cell(cell)
    except KeyboardInterrupt:
        for name, size, window in grid[len(cells) :]:
            cells.append(
                Cell(
                    name,
                    Width.BATCH,
                    size,
                    len(prompts),
                    0,
                    0.0,
                    0.0,
                    mode=_mode(window),
                    skipped="interrupted",
                    interrupted=True,
                )
            )
    _compare(cells, config.sampling.greedy)
    return cells


def _measure_cell(
    pair,
    method: Method,
    name: str,
    size: int,
    window: int | None,
    prompts: list[list[int]],
    config: GenerationConfig,
) -> Cell:
    cell = Cell(name, Width.BATCH, size, len(prompts), 0, 0.0, 0.0, mode=_mode(window))
    run_config = replace(
        config, deterministic=window is not None, verify_window=window or config.verify_window
    )
    outputs, seconds, stats = decode_all(pair, method, prompts, run_config, size)
    new = sum(len(o) for o in outputs)
    cell.tokens, cell.seconds, cell.outputs = new, seconds, outputs
    cell.tokens_per_second = rate(new, seconds) or 0.0
    cell.drafted, cell.accepted, cell.replays = stats.drafted, stats.accepted, stats.verified_windows
    cell.rollbacks, cell.rolled_back_tokens = stats.rollbacks, stats.rolled_back_tokens
    if window is not None:
        cell.rollback_rate = rate(cell.rolled_back_tokens, new + cell.rolled_back_tokens) or 0.0
    return cell


def _mode(window: int | None) -> str:
    return OFF if window is None else f"window {window}"


def _compare(cells: list[Cell], greedy: bool = True) -> None:
    """Speed-ups, deterministic mode's cost, and the tokens each cell shares with its mode's
    reference: greedy, or in a deterministic window (keyed draws); sampled rounds outside one
    draw by method and batch, so there nothing is compared (differs stays None)."""
    measured = [c for c in cells if c.skipped is None]
    base = next((c for c in measured if (c.method, c.size, c.mode) == ("plain", 1, OFF)), None)
    references = {}
    for cell in measured:  # the first cell of each mode (plain, the smallest batch) is the reference
        references.setdefault(cell.mode, cell)
    offs = {(c.method, c.size): c for c in measured if c.mode == OFF}
    for cell in measured:
        if base is not None:
            cell.speedup = rate(cell.tokens_per_second, base.tokens_per_second)
        off = offs.get((cell.method, cell.size))
        if cell.mode != OFF and off is not None:
            cell.deterministic_cost = rate(cell.tokens_per_second, off.tokens_per_second)
        reference = references[cell.mode]
        if greedy or cell.mode != OFF:
            cell.differs = sum(a != b for a, b in zip(cell.outputs, reference.outputs))


def table(cells: list[Cell], title: str):
    t = Table(title=escape(title), title_justify="left", header_style="bold")
    for name in (
        "method",
        "batch",
        "mode",
        "tok/s",
        "vs plain b1",
        "det. cost",
        "acceptance",
        "replays",
        "rollbacks",
        "rollback rate",
        "differs",
    ):
        t.add_column(name, justify="left" if name in ("method", "mode") else "right")
    for i, c in enumerate(cells):
        last = i + 1 == len(cells) or cells[i + 1].method != c.method
        if c.skipped:
            t.add_row(
                c.method, str(c.size), c.mode, "–", "–", "–", "–", "–", "–", "–", c.skipped, end_section=last
            )
            continue
        t.add_row(
            c.method,
            str(c.size),
            c.mode,
            f"{c.tokens_per_second:.2f}",
            _fmt(c.speedup, ".2f", "x"),
            _fmt(c.deterministic_cost, ".2f", "x"),
            _fmt(c.acceptance_rate, ".0%"),
            str(c.replays) if c.mode != OFF else "–",
            str(c.rollbacks) if c.mode != OFF else "–",
            _fmt(c.rollback_rate, ".1%"),
            "–" if c.differs is None else f"{c.differs}/{c.count}",
            end_section=last,
        )
    return t


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"
