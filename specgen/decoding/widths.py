"""How many tokens to draft at each batch width (the server): `width_costs` measures a verify of
1 and of 5 tokens per row and a draft step at WIDTH_ROWS rows once per machine and pair, cached
beside the device's draft length (costs.py); `WidthCosts.cap` gives each width the k with the
best expected throughput, down to 0 (plain rounds), as a verify of width x (k+1) tokens stops
being memory-bound. Each row's floor (floor.py) then checks that estimate against what its
rounds deliver.

A draft model's step is the batch's: the rows that draft nothing wait through it. So where only a
few of a wide batch's rows would draft with the model, their tokens may never repay what the
step costs the rest, however well they draft: on a 2-core Xeon with AMX a lone drafting row
among four held the round 60% longer for under one more token (benchmarks/floor.md).
`WidthCosts.least` gives each width the fewest rows that must draft with the model together for
the round to pay at all (rows that share a drafter, and so its steps: engine.py's `_company`);
`WidthCaps` holds both tables for the server."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch

from specgen.decoding.costs import ACCEPTANCE, MAX_K, STOP_EXTRA, cached, pair_key
from specgen.decoding.probes import Probe

WIDTH_ROWS = (1, 4, 16)  # batch widths measured; others are interpolated (and extrapolated past 16)
WIDTH_REPEATS = 3
WIDTH_MARGIN = 0.1  # the expected gain over plain rounds below which a batch does not draft


@dataclass(frozen=True)
class WidthCosts:
    """Measured forward costs at the batch widths of WIDTH_ROWS, relative to one single-row
    target step: a target verify of 1 and of 5 tokens per row, and a draft step."""

    verify_one: dict[int, float]  # rows -> cost
    verify_five: dict[int, float]
    draft: dict[int, float]

    def cap(
        self,
        width: int,
        k_max: int = MAX_K + STOP_EXTRA,
        acceptance: float = ACCEPTANCE,
        drafting: int | None = None,
    ) -> int:
        """The draft length with the best expected throughput at `width` rows, of which `drafting`
        draft with the draft model (all of them by default; the others commit their one token a
        round, waiting through the draft's steps); 0 unless drafting promises WIDTH_MARGIN more
        than plain rounds (a verify of width x (k+1) tokens is no longer memory-bound, or too few
        rows share the draft's step). The margin covers what the model leaves out: per-round host
        work that grows with the width, a draft's catching up on tokens it missed, and requests
        whose acceptance is below `acceptance`."""
        rows = width if drafting is None else drafting
        one, five, draft = _at(self.verify_one, width), _at(self.verify_five, width), _at(self.draft, rows)
        best_k, best = 0, width / one * (1 + WIDTH_MARGIN)
        for k in range(1, k_max + 1):
            tokens = (1 - acceptance ** (k + 1)) / (1 - acceptance)
            # the verify's extra tokens: k of each drafting row, against the 4 of every row at `five`
            rate = (width + rows * (tokens - 1)) / (k * draft + one + (five - one) * k * rows / (4 * width))
            if rate > best:
                best_k, best = k, rate
        return best_k

    def least(self, width: int) -> int:
        """The fewest of `width` rows that must draft with the draft model in one round for it to
        pay (`cap` above 0, under the same margin); width + 1 where no number of them does."""
        return next((rows for rows in range(1, width + 1) if self.cap(width, drafting=rows)), width + 1)

    def as_dict(self) -> dict:
        return {
            name: {str(r): v for r, v in getattr(self, name).items()}
            for name in ("verify_one", "verify_five", "draft")
        }


def _at(table: dict[int, float], rows: int) -> float:
    """The table's value at `rows`: linear between measured widths, extended past the last."""
    points = sorted(table)
    if len(points) == 1:
        return table[points[0]]
    low, high = points[0], points[1]
    for low, high in zip(points, points[1:]):
        if rows <= high:
            break
    return table[low] + (table[high] - table[low]) * (rows - low) / (high - low)


@dataclass(frozen=True)
class WidthCaps:
    """A server's caps on the rows that draft with its draft model, per batch width: `k`, the
    most tokens such a row drafts; `least`, the fewest such rows that draft in one round (fewer
    draft nothing that round). Empty: no caps (no draft model, or an EAGLE-3 head, whose step
    is a small fraction of a target step at any width). Past the widest width in a table, the
    widest's entry holds."""

    k: dict[int, int] = field(default_factory=dict)
    least: dict[int, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.k)

    def at(self, width: int) -> int:
        return self.k.get(width, self.k[max(self.k)])

    def together(self, width: int, drafting: int) -> bool:
        """Whether `drafting` rows of `width` may draft with the draft model this round."""
        if not self.least:
            return True
        return drafting >= self.least.get(width, self.least[max(self.least)])


def width_costs(pair) -> WidthCosts:
    """The pair's costs at WIDTH_ROWS (measured once per machine and pair, then cached)."""

    def measure() -> WidthCosts:
        with torch.inference_mode():
            return _measure_widths(pair)

    return cached(
        "width " + pair_key(pair),
        _width_entry,
        measure,
        WidthCosts.as_dict,
        "the batch-width costs cached in {path} are not valid; measuring them again",
    )


def _width_entry(entry) -> WidthCosts | None:
    """A cached WidthCosts, if this version wrote it: each table maps a positive whole number of
    rows (WIDTH_ROWS' first among them) to a finite positive cost. Anything else is None."""
    if not isinstance(entry, dict):
        return None
    tables = []
    for name in ("verify_one", "verify_five", "draft"):
        table = entry.get(name)
        if not isinstance(table, dict) or not table:
            return None
        try:
            rows = {int(r): v for r, v in table.items()}
        except ValueError:
            return None
        if (
            WIDTH_ROWS[0] not in rows
            or min(rows) < 1
            or not all(type(v) in (int, float) and math.isfinite(v) and v > 0 for v in rows.values())
        ):
            return None
        tables.append({r: float(v) for r, v in rows.items()})
    return WidthCosts(*tables)


def _measure_widths(pair) -> WidthCosts:
    base = Probe(pair.target.model, 1)
    tables = ({}, {}, {})
    for rows in WIDTH_ROWS:
        probes = (
            Probe(pair.target.model, 1, rows=rows, keep=0),
            Probe(pair.target.model, 5, rows=rows, keep=0),
            Probe(pair.draft.model, 1, exact=False, rows=rows),
        )
        ratios = ([], [], [])
        for _ in range(WIDTH_REPEATS):
            unit = base.seconds()
            for probe, out in zip(probes, ratios):
                out.append(probe.seconds() / unit)
        for table, out in zip(tables, ratios):
            table[rows] = statistics.median(out)
    return WidthCosts(*tables)
