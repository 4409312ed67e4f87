"""The floor under every row: a row drafts only while its drafting beats plain rounds.

Drafting pays when a round's tokens cost less time than plain steps would take for them
(Leviathan et al.: E / (k c + V(k)) > 1, all in plain steps at the batch's width). What E, c and
V are for a given text on a given machine is only known by measuring, and it changes: a
translation accepts a third of what code does, a busy machine makes a draft step dearer. So each
row measures its own rounds, as they go, against the measured cost of a plain step at the
batch's current width, and lowers its draft length where drafting does not pay, down to plain
rounds (no draft tokens, no draft forward for that row). Only the draft length changes, never
what a round commits: every k gives the same greedy output and the same sampling law, so the
floor is exact whatever it measures.

* `PlainSteps` (one per engine, kept across generations): per batch width, the seconds of a
  round in which no row drafted (an exponentially weighted mean). Such rounds come for free
  where rows sit at the floor or a lookup finds no match; where every row drafts, a row that
  needs the figure asks for one (`Floor.unsure`) and the engine runs one plain round in EXPLORE
  at that width until MIN_ROUNDS are measured, and again after REFRESH rounds.
* `Floor` (one per row): its drafting rounds' tokens, round seconds and verify seconds
  (exponentially weighted over HALFLIFE rounds, at the current ceiling). After MIN_ROUNDS rounds
  it compares tokens per round against what plain steps would give in the same time:
  - with the plain step measured at this width: speed-up = tokens x plain / round seconds;
  - without it, a bound: tokens x verify seconds / round seconds is at least the speed-up (a
    verify of k + 1 tokens costs at least a plain step). Below 1 + MARGIN drafting surely
    loses; above (1 + MARGIN) x VERIFY_BOUND it surely wins; between, the row is `unsure`
    and asks for plain steps to be measured.
  A losing row halves its ceiling (a tree, which drafts whole or not at all, goes to 0). At 0
  it runs plain rounds and probes with one token after RETRY of them (the retry doubling, up to
  MAX_RETRY, each time the probe loses), so text that turns predictable gets its speed back; a
  ceiling that keeps winning for GROW rounds doubles, up to no ceiling. The first round after
  plain ones is not counted: a draft model catches up the tokens it missed then.

`--draft-tokens N` (a fixed choice, or a request's own draft length) has no floor: N is N.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HALFLIFE = 8.0  # a row's drafting rounds
MIN_ROUNDS = 4  # rounds before a comparison (drafting rounds of a row; plain rounds of a width)
MARGIN = 0.03  # drafting must deliver this much more than plain steps would
VERIFY_BOUND = 1.5  # a verify of a round's tokens costs at most this many plain steps (CPU: 1.1-1.3)
GROW = 16  # winning rounds at a ceiling before it doubles
RETRY, MAX_RETRY = 16, 256  # plain rounds at the floor before a probe; doubled after each lost probe
EXPLORE = 4  # an unsure row's width: one plain round in EXPLORE until measured
REFRESH = 64  # rounds at a width after which its plain measurement counts as stale
PLAIN_HALFLIFE = 16.0  # plain rounds of a width
NONE = 1 << 30  # no ceiling: the row's own draft-length policy decides
MAX_CEILING = 64  # a ceiling that doubles past this is none
DECAY = 0.5 ** (1.0 / HALFLIFE)


@dataclass
class _Mean:
    """An exponentially weighted mean (and how many values it has seen)."""

    decay: float
    total: float = 0.0
    weight: float = 0.0
    count: int = 0

    def add(self, value: float) -> None:
        self.total = self.total * self.decay + value
        self.weight = self.weight * self.decay + 1.0
        self.count += 1

    @property
    def value(self) -> float:
        return self.total / self.weight if self.weight else 0.0


@dataclass
class _Width:
    seconds: _Mean
    rounds: int = 0  # rounds at this width since the last plain one
    since_explore: int = 0


class PlainSteps:
    """Seconds of a plain round per batch width, measured from rounds in which no row drafted."""

    def __init__(self, halflife: float = PLAIN_HALFLIFE):
        self.decay = 0.5 ** (1.0 / halflife)
        self.widths: dict[int, _Width] = {}

    def _width(self, width: int) -> _Width:
        return self.widths.setdefault(width, _Width(_Mean(self.decay)))

    def seconds(self, width: int) -> float | None:
        """A plain round's seconds at `width`, once MIN_ROUNDS were measured and not stale."""
        w = self.widths.get(width)
        if w is None or w.seconds.count < MIN_ROUNDS or w.rounds > REFRESH:
            return None
        return w.seconds.value

    def explore(self, width: int, unsure: bool) -> bool:
        """Whether the next round at `width` is a plain one, to measure it: some row is `unsure`,
        the width's figure is missing or stale, and the last such round was EXPLORE rounds ago."""
        w = self._width(width)
        w.since_explore += 1
        if not unsure or self.seconds(width) is not None or w.since_explore < EXPLORE:
            return False
        w.since_explore = 0
        return True

    def record(self, width: int, drafted: bool, seconds: float) -> None:
        """A round at `width` ran in `seconds`; `drafted`: some row drafted in it."""
        w = self._width(width)
        if drafted:
            w.rounds += 1
            return
        if w.rounds > REFRESH:  # stale: start again from this round
            w.seconds = _Mean(self.decay)
        w.seconds.add(seconds)
        w.rounds = 0


class NoFloor:
    """A row whose draft length is the user's fixed choice: no ceiling, nothing measured."""

    unsure = False

    def limit(self) -> int:
        return NONE

    def record(self, k, tokens, seconds, verify_seconds, plain, tree=False) -> None:
        pass


NO_FLOOR = NoFloor()


@dataclass
class Floor:
    """One row's ceiling on its draft length, from its own measured rounds (see the module)."""

    ceiling: int = NONE
    unsure: bool = False  # the last comparison needs the plain step measured at this width
    probing: bool = False  # the ceiling of 1 is a probe from the floor
    retry: int = RETRY
    plain_rounds: int = 0  # rounds at the floor since it got there or last probed
    skip: bool = False  # the next drafting round follows plain ones: the draft catches up, not counted
    wins: int = 0  # comparisons won at this ceiling
    drafted: int = 0  # the most tokens the row was allowed at this ceiling (its k)
    tokens: _Mean = field(default_factory=lambda: _Mean(DECAY))
    seconds: _Mean = field(default_factory=lambda: _Mean(DECAY))
    verify: _Mean = field(default_factory=lambda: _Mean(DECAY))

    def limit(self) -> int:
        """The most tokens the row drafts this round: its ceiling, or at the floor a one-token
        probe once `retry` plain rounds went by."""
        if self.ceiling > 0:
            return self.ceiling
        self.plain_rounds += 1
        if self.plain_rounds > self.retry:
            self._restart(1)
            self.probing = self.skip = True
            return 1
        return 0

    def record(
        self,
        k: int,
        tokens: int,
        seconds: float,
        verify_seconds: float,
        plain: float | None,
        tree: bool = False,
    ) -> None:
        """A round of this row ran: it drafted, allowed `k` tokens (0: it proposed nothing, a
        plain round), and committed `tokens` in a round of `seconds` whose verify took
        `verify_seconds`; `plain`: a plain round's seconds at this width, where measured; `tree`:
        the row drafts trees (whole or not at all)."""
        if k == 0:
            return
        if self.skip:
            self.skip = False
            return
        self.drafted = max(self.drafted, k)
        self.tokens.add(tokens)
        self.seconds.add(seconds)
        self.verify.add(verify_seconds)
        if self.tokens.count < MIN_ROUNDS or self.seconds.value <= 0:
            return
        per_second = self.tokens.value / self.seconds.value
        bound = per_second * self.verify.value  # at least the speed-up: a verify costs a plain step or more
        speedup = None if plain is None else per_second * plain
        self.unsure = speedup is None and 1 + MARGIN <= bound < (1 + MARGIN) * VERIFY_BOUND
        if (bound if speedup is None else speedup) < 1 + MARGIN:
            self._lower(tree)
        elif not self.unsure:
            self._won()

    def _lower(self, tree: bool) -> None:
        if self.probing:  # the probe lost: wait longer before the next
            self.retry = min(MAX_RETRY, self.retry * 2)
        self.probing = False
        self._restart(0 if tree or self.drafted <= 1 else self.drafted // 2)

    def _won(self) -> None:
        if self.probing:
            self.probing, self.retry = False, RETRY
        self.wins += 1
        if self.wins >= GROW and self.ceiling < NONE:
            self._restart(self.ceiling * 2 if self.ceiling * 2 < MAX_CEILING else NONE)

    def _restart(self, ceiling: int) -> None:
        """A new ceiling: its rounds are measured afresh."""
        self.ceiling, self.wins, self.plain_rounds, self.unsure, self.drafted = ceiling, 0, 0, False, 0
        self.tokens, self.seconds, self.verify = _Mean(DECAY), _Mean(DECAY), _Mean(DECAY)
