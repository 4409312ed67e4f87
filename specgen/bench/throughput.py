"""Throughput of batched decoding, and what deterministic mode costs: `specgen bench batch`.

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

`BatchCell` is one method at one batch size in one mode; `bench serve`'s cells are
bench/concurrency.py's `ClientsCell`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from rich.markup import escape
from rich.table import Table

from specgen.bench.methods import in_turn
from specgen.bench.report import with_old_keys
from specgen.config import GenerationConfig, Method
from specgen.decoding.build import build_engine
from specgen.decoding.run import run_prompts
from specgen.decoding.stats import Stats, rate
from specgen.errors import ConfigError, one_line

OFF = "off"


@dataclass
class BatchCell:
    """One method at one batch size in one mode (deterministic mode off, or a verify window):
    the whole prompt set decoded, its totals, its speed-up over plain (batch 1, off) and its
    tokens compared with the mode's reference."""

    method: str
    batch_size: int
    mode: str  # "off", or "window N" in deterministic mode
    prompts: int  # how many prompts it decodes
    # the prompts' Stats merged, over the cell's wall time (first prefill to last token) and the
    # new tokens of its outputs; empty for a cell not measured
    totals: Stats = field(default_factory=lambda: Stats(method="", generations=0))
    speedup: float | None = None  # over plain, batch 1, off
    deterministic_cost: float | None = None  # this tok/s / the same method and batch size, off
    differs: int | None = None  # prompts whose tokens differ from the mode's reference
    skipped: str | None = None  # why the cell was not measured
    interrupted: bool = False  # Ctrl-C came before (or while) this cell was measured
    failed: bool = False  # its method raised: `skipped` says what; the other cells go on
    outputs: list[list[int]] | None = None

    @property
    def new_tokens(self) -> int:
        return self.totals.new_tokens

    @property
    def seconds(self) -> float:
        return self.totals.seconds

    @property
    def wall_tokens_per_second(self) -> float:
        return self.totals.wall_tokens_per_second

    @property
    def drafted(self) -> int:
        return self.totals.drafted

    @property
    def accepted(self) -> int:
        return self.totals.accepted

    @property
    def acceptance_rate(self) -> float | None:
        return self.totals.acceptance

    @property
    def replays(self) -> int:
        return self.totals.verified_windows

    @property
    def rollbacks(self) -> int:
        return self.totals.rollbacks

    @property
    def rolled_back_tokens(self) -> int:
        return self.totals.rolled_back_tokens

    @property
    def rollback_rate(self) -> float | None:
        """Rolled-back tokens over every token generated; a deterministic cell's only."""
        return None if self.mode == OFF or self.skipped is not None else self.totals.rollback_rate

    def record(self) -> dict:
        """The cell as `bench batch`'s JSON writes it (RECORD_FIELDS, and the keys kept for a release)."""
        return with_old_keys({name: getattr(self, name) for name in RECORD_FIELDS})


# a cell's JSON fields, in this order
RECORD_FIELDS = (
    "method",
    "batch_size",
    "mode",
    "prompts",
    "new_tokens",
    "seconds",
    "wall_tokens_per_second",  # and its old key, tokens_per_second, for one release (report.OLD_KEYS)
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
)


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
) -> list[BatchCell]:
    """The grid methods x batch sizes x modes, plain first; a warm-up cell is run and dropped.

    The methods of one batch size and mode run next to each other, every other time in reverse
    order (plain, chain, chain, plain, ...), so that drift in the machine's speed costs every
    method the same instead of landing on the methods measured last; the cells come back
    method by method. Ctrl-C keeps the cells measured so far; the others are returned skipped
    and `interrupted`. A cell whose method raises is returned `failed`, with its line; the
    others are measured.
    """
    modes: list[int | None] = ([None] if include_off else []) + list(windows)
    names = ["plain"] + [m for m in methods if m != "plain"]
    engine_methods = {m.value: m for m in Method}
    unknown = [m for m in names if m not in engine_methods]
    if unknown:
        raise ConfigError(f"bench batch measures specgen's own methods; '{unknown[0]}' is not one")
    grid = [
        (name, size, window)
        for turn, (size, window) in enumerate((size, window) for size in batch_sizes for window in modes)
        for name in in_turn(names, turn)
    ]
    cells: list[BatchCell] = []
    try:
        decode_all(
            pair, Method.PLAIN, prompts[:1], replace(config, max_new_tokens=min(8, config.max_new_tokens)), 1
        )
        for name, size, window in grid:
            try:
                cell = _measure_cell(pair, engine_methods[name], name, size, window, prompts, config)
            except Exception as exc:  # noqa: BLE001 - one cell's failure is its line, never the others' loss
                cell = BatchCell(
                    name, size, _mode(window), len(prompts), skipped=f"failed: {one_line(exc)}", failed=True
                )
            cells.append(cell)
            if on_cell is not None:
                on_cell(cell)
    except KeyboardInterrupt:
        for name, size, window in grid[len(cells) :]:
            cells.append(
                BatchCell(name, size, _mode(window), len(prompts), skipped="interrupted", interrupted=True)
            )
    cells.sort(key=lambda c: names.index(c.method))  # stable: by size and mode within a method
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
) -> BatchCell:
    run_config = replace(
        config, deterministic=window is not None, verify_window=window or config.verify_window
    )
    outputs, seconds, stats = decode_all(pair, method, prompts, run_config, size)
    totals = replace(stats, new_tokens=sum(len(o) for o in outputs), seconds=seconds)  # over the wall time
    return BatchCell(name, size, _mode(window), len(prompts), totals, outputs=outputs)


def _mode(window: int | None) -> str:
    return OFF if window is None else f"window {window}"


def _compare(cells: list[BatchCell], greedy: bool = True) -> None:
    """Speed-ups, deterministic mode's cost, and the tokens each cell shares with its mode's
    reference: greedy, or in a deterministic window (keyed draws); sampled rounds outside one
    draw by method and batch, so there nothing is compared (differs stays None)."""
    measured = [c for c in cells if c.skipped is None]
    base = next((c for c in measured if (c.method, c.batch_size, c.mode) == ("plain", 1, OFF)), None)
    references = {}  # each mode's reference: plain at the smallest batch, else its first cell
    for cell in sorted(measured, key=lambda c: (c.method != "plain", c.batch_size)):
        references.setdefault(cell.mode, cell)
    offs = {(c.method, c.batch_size): c for c in measured if c.mode == OFF}
    for cell in measured:
        if base is not None:
            cell.speedup = rate(cell.wall_tokens_per_second, base.wall_tokens_per_second)
        off = offs.get((cell.method, cell.batch_size))
        if cell.mode != OFF and off is not None:
            cell.deterministic_cost = rate(cell.wall_tokens_per_second, off.wall_tokens_per_second)
        reference = references[cell.mode]
        if greedy or cell.mode != OFF:
            cell.differs = sum(a != b for a, b in zip(cell.outputs, reference.outputs))


def table(cells: list[BatchCell], title: str):
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
                c.method,
                str(c.batch_size),
                c.mode,
                "–",
                "–",
                "–",
                "–",
                "–",
                "–",
                "–",
                c.skipped,
                end_section=last,
            )
            continue
        t.add_row(
            c.method,
            str(c.batch_size),
            c.mode,
            f"{c.wall_tokens_per_second:.2f}",
            _fmt(c.speedup, ".2f", "x"),
            _fmt(c.deterministic_cost, ".2f", "x"),
            _fmt(c.acceptance_rate, ".0%"),
            str(c.replays) if c.mode != OFF else "–",
            str(c.rollbacks) if c.mode != OFF else "–",
            _fmt(c.rollback_rate, ".1%"),
            "–" if c.differs is None else f"{c.differs}/{c.prompts}",
            end_section=last,
        )
    return t


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"
