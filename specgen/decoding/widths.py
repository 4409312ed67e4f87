"""How many tokens to draft at each batch width (the server): `width_costs` measures a verify of
1 and of 5 tokens per row and a draft step at WIDTH_ROWS rows once per machine and pair, cached
beside the device's draft length (costs.py); `WidthCosts.cap` gives each width the k with the
best expected throughput, down to 0 (plain rounds), as a verify of width x (k+1) tokens stops
being memory-bound. `rates.py` then checks that estimate against what rounds deliver."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

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

    def cap(self, width: int, k_max: int = MAX_K + STOP_EXTRA, acceptance: float = ACCEPTANCE) -> int:
        """The draft length with the best expected throughput at `width` rows; 0 unless drafting
        promises WIDTH_MARGIN more than plain rounds (a verify of width x (k+1) tokens is no
        longer memory-bound). The margin covers what the model leaves out: per-round host work
        that grows with the width, and requests whose acceptance is below `acceptance`."""
        one, five, draft = (_at(table, width) for table in (self.verify_one, self.verify_five, self.draft))
        best_k, best = 0, width / one * (1 + WIDTH_MARGIN)
        for k in range(1, k_max + 1):
            tokens = (1 - acceptance ** (k + 1)) / (1 - acceptance)
            rate = width * tokens / (k * draft + one + (five - one) * k / 4)
            if rate > best:
                best_k, best = k, rate
        return best_k

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
