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
  at that width until PLAIN_ROUNDS are measured, and again after REFRESH rounds (none beside a
  row whose draft length is the user's).
* `Floor` (one per row): its drafting rounds' rate, (tokens + idle) / round seconds,
  exponentially weighted over HALFLIFE rounds at the current ceiling and each weighed by its
  length, so that the mean is the rounds' tokens over their time (the row's throughput, not a
  mean of ratios that counts a short lost round as much as a long won one; a round weighs k + 1
  verifies at most, so that one stalled by another process does not outweigh the rest), with
  its standard error. Its speed-up is that rate times the plain step, less its idle rows
  (`Floor.speedup`), whichever plain step is known now:
  - the width's plain rounds, where measured;
  - else the plain step the row's narrow verifies imply (NARROW proposed tokens at most: their
    seconds over the device's price of them, costs.VerifyCost, which the probe times directly);
  - else the one its wider verifies imply at their price. That price is measured once, over one
    context, on a machine whose speed moves: on a 2-core Zen 4 a 6-node tree's verify ran 7-28%
    dearer than priced, and a tree row read 1.3x where it broke even (benchmarks/floor.md). So
    such a row asks for the width's plain rounds;
  - else a bound: tokens x verify seconds / round seconds is at least the speed-up, as a verify
    of k + 1 tokens costs at least a plain step; where the bound tells neither a loss nor a win
    the row asks for the plain rounds too.
  Plain rounds cost a row that drafts well most of a round each (a chain that commits 3.5 tokens
  a round lost 4% over 64 tokens to two of them), so a row asks for them only where the
  verifies do not tell. After MIN_ROUNDS rounds:
  - a clear loss (the speed-up plus its error below 1) halves the ceiling (a tree's ceiling
    counts its nodes: the row drafts the largest tree of its method's shape within it,
    shapes.fit_tree; on a CPU a tree row starts at a chain's longest verify, `first_ceiling`),
    or, where its last MISSES drafting rounds in a row accepted nothing, sets it to 0 at once: a
    shorter draft would commit the same one token a round at no less cost (a weak EAGLE head on
    a translation took 12 losing rounds to halve from 6 to plain rounds; four misses sent a
    chat's row to plain rounds at its hard start, 0.93x where chain ran 1.14x: floor.md);
  - a clear win (the speed-up less its error above 1; the bound's above VERIFY_BOUND, what a
    verify may cost) counts towards GROW, after which the ceiling doubles, up to none.
  A row at 0 runs plain rounds and probes with one token after RETRY of them (the retry
  doubling, up to MAX_RETRY, each time the probe loses), so text that turns predictable gets its
  speed back. A row's first drafting round, and the first after plain ones, are not counted: a
  draft model reads the prompt, or catches up the tokens it missed, then. Rounds vary (a draft
  right four times, then wrong), so only a clear loss lowers the ceiling: a row within noise of
  plain steps keeps drafting, which costs it nothing.

A row that joins beside others starts where the last row of its method that finished at that
width left off (`PlainSteps.start`, `PlainSteps.keep`): its ceiling and its wait before a
probe. Beside other rows, what a drafting round costs is mostly the batch's (the rows that
draft nothing wait through its draft steps), and a fresh floor needs a dozen rounds to go from
the device's k to plain rounds: a whole short request (benchmarks/floor.md). Alone, a row starts
afresh: what drafting gives then is its own text's.

`--draft-tokens N` (a fixed choice, or a request's own draft length) has no floor: N is N.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specgen.config import GenerationConfig
from specgen.decoding.costs import BEND, VerifyCost

HALFLIFE = 8.0  # a row's drafting rounds
MIN_ROUNDS = 4  # a row's drafting rounds before a comparison
# drafting rounds in a row that accepted nothing before a loss sends the row to plain rounds at
# once instead of halving its ceiling: at a first token's chance of 0.4, about where one draft
# token pays, 8 misses in a row come by chance 1.7% of the time, 4 misses 13%
MISSES = 8
PLAIN_ROUNDS = 2  # a width's plain rounds before its figure counts (they vary by a few percent)
VERIFY_BOUND = 1.5  # a verify of a round's tokens costs at most this many plain steps (CPU: 1.1-1.3)
GROW = 16  # winning rounds at a ceiling before it doubles
RETRY, MAX_RETRY = 16, 256  # plain rounds at the floor before a probe; doubled after each lost probe
EXPLORE = 4  # an unsure row's width: one plain round in EXPLORE until measured
REFRESH = 64  # rounds at a width after which its plain measurement counts as stale
PLAIN_HALFLIFE = 16.0  # plain rounds of a width
NONE = 1 << 30  # no ceiling: the row's own draft-length policy decides
MAX_CEILING = 64  # a ceiling that doubles past this is none
DECAY = 0.5 ** (1.0 / HALFLIFE)
# a verify of at most this many proposed tokens is priced by what the device probe times (its
# verifies of 2 and 3 tokens), and its cost moves little with the context (Zen 4: 2 tokens
# 1.00-1.04 steps, 3 tokens 1.08, over 200 and 400 cached tokens), so its seconds over its price
# are the plain step (on a Xeon with AMX, a 3-token verify priced on the line through 2 and 5
# tokens read 6% cheap, and so read its row's rounds 6% fast); wider ones move with the context
# and the machine's state (a 13-token verify priced at 1.56 steps cost 2.07-2.18 a day later; a
# 7-token one 1.16 over 200 tokens, 1.47 over 400: benchmarks/floor.md)
NARROW = 2


@dataclass
class _Mean:
    """An exponentially weighted mean of a series, its spread, and how many values it has seen.

    Each value may carry a weight of its own (`add(value, weight)`): a round's speed-up is
    weighed by the round's length, so that the mean is the rounds' tokens over their time, what
    a row's throughput is. Unweighted, a short round that loses counts as much as a long one
    that wins, and the mean of the ratios sits below the ratio of the sums: by 0.01-0.06 on
    average over the recorded rounds of four prompts (benchmarks/floor.md)."""

    decay: float
    total: float = 0.0
    squares: float = 0.0
    weight: float = 0.0
    weights: float = 0.0  # the sum of the squared weights (the effective count is weight^2 / weights)
    count: int = 0

    def add(self, value: float, weight: float = 1.0) -> None:
        self.total = self.total * self.decay + weight * value
        self.squares = self.squares * self.decay + weight * value * value
        self.weight = self.weight * self.decay + weight
        self.weights = self.weights * self.decay * self.decay + weight * weight
        self.count += 1

    @property
    def value(self) -> float:
        return self.total / self.weight if self.weight else 0.0

    @property
    def error(self) -> float:
        """The standard error of the mean (0 with fewer than two values)."""
        if self.count < 2:
            return 0.0
        variance = max(self.squares / self.weight - self.value**2, 0.0)
        return (variance * self.weights) ** 0.5 / self.weight


class PlainSteps:
    """Seconds of a plain round per batch width, measured from rounds in which no row drafted."""

    def __init__(self, halflife: float = PLAIN_HALFLIFE):
        self.decay = 0.5 ** (1.0 / halflife)
        self.widths: dict[int, _Mean] = {}  # per width, its plain rounds' seconds
        self.drafted: dict[int, int] = {}  # per width, rounds since its last plain one
        self.explored: dict[int, int] = {}  # per width, rounds since its last explore round
        # per (method, width), the ceiling and probe wait the last row that finished there had
        self.left: dict[tuple[object, int], tuple[int, int]] = {}

    def seconds(self, width: int) -> float | None:
        """A plain round's seconds at `width`, once PLAIN_ROUNDS were measured and not stale."""
        mean = self.widths.get(width)
        if mean is None or mean.count < PLAIN_ROUNDS or self.drafted.get(width, 0) > REFRESH:
            return None
        return mean.value

    def start(self, floor: "Floor | NoFloor", method: object, width: int) -> None:
        """A row of `method` joins a batch of `width` rows with `floor`: a fresh floor beside
        other rows takes the ceiling and probe wait of the last such row that finished there."""
        left = self.left.get((method, width))
        if width > 1 and left is not None and isinstance(floor, Floor) and floor.fresh:
            floor.ceiling, floor.retry = left

    def keep(self, floor: "Floor | NoFloor", method: object, width: int) -> None:
        """A row of `method` finished in a batch of `width` rows: its floor's ceiling and probe
        wait, once it measured enough rounds to have a verdict."""
        if isinstance(floor, Floor) and floor.rounds > MIN_ROUNDS:
            self.left[(method, width)] = (floor.ceiling, floor.retry)

    def explore(self, width: int, unsure: bool) -> bool:
        """Whether the next round at `width` is a plain one, to measure it: some row is `unsure`,
        the width's figure is missing or stale, and the last such round was EXPLORE rounds ago."""
        self.explored[width] = self.explored.get(width, 0) + 1
        if not unsure or self.seconds(width) is not None or self.explored[width] < EXPLORE:
            return False
        self.explored[width] = 0
        return True

    def measure(self, rows, ks, proposals, results, seconds: float, verify_seconds: float, cost) -> None:
        """After a round of `rows` (each with its `floor`): each row's floor gets its tokens
        against plain steps at this width (a row that proposed nothing had a plain round), where
        `cost` (a verify in plain steps by the tokens proposed, costs.VerifyCost; None unmeasured)
        prices its verify; then the width's plain steps, from rounds where no row drafted."""
        width, plain = len(rows), self.seconds(len(rows))
        drafting = sum(1 for p in proposals if p.size)
        idle = (width - drafting) / drafting if drafting else 0.0  # rows each drafting row holds up
        for state, k, proposal, result in zip(rows, ks, proposals, results):
            verify = None if cost is None else cost.steps(proposal.size)
            state.floor.record(
                k if proposal.size else 0,
                len(result.emitted),
                seconds,
                verify_seconds,
                plain,
                verify,
                idle=idle,
                proposed=proposal.size,
            )
        self.record(width, any(p.size for p in proposals), seconds)

    def record(self, width: int, drafted: bool, seconds: float) -> None:
        """A round at `width` ran in `seconds`; `drafted`: some row drafted in it."""
        if drafted:
            self.drafted[width] = self.drafted.get(width, 0) + 1
            return
        if width not in self.widths or self.drafted.get(width, 0) > REFRESH:  # none yet, or stale
            self.widths[width] = _Mean(self.decay)
        self.widths[width].add(seconds)
        self.drafted[width] = 0


def first_ceiling(config: GenerationConfig, verify: VerifyCost | None) -> int:
    """The ceiling a fresh row's floor starts at: none (the row's own draft length), but BEND
    nodes for a tree row where the device's verify cost was measured (a CPU), the largest verify a
    chain makes. Past it each node costs `wide`, 0.08 of a plain step on a 2-core Zen 4, and a
    whole tree of 10-12 nodes costs about three plain steps a round: started whole, RSD-C,
    RSD-S and multi-draft ran at 0.97-0.98x plain over 32 prompts, 12-15 of them below 0.97x;
    started at 6 nodes, at 1.09-1.11x, 6 below (benchmarks/floor.md). A tree that wins grows to
    the whole tree (GROW)."""
    return BEND if config.method.is_tree and verify is not None else NONE


class NoFloor:
    """A row whose draft length is the user's fixed choice: no ceiling, nothing measured."""

    unsure = False
    ceiling = NONE

    def limit(self) -> int:
        return NONE

    def record(self, k, tokens, seconds, verify_seconds, plain, verify=None, idle=0.0, proposed=None) -> None:
        pass

    def renew(self) -> None:
        pass


NO_FLOOR = NoFloor()


@dataclass
class Floor:
    """One row's ceiling on its draft length, from its own measured rounds (see the module)."""

    ceiling: int = NONE
    start: int = NONE  # where it started (`first_ceiling`), and starts again on a drafter change (`renew`)
    unsure: bool = False  # its rounds need the width's plain step measured (see the module)
    probing: bool = False  # the ceiling of 1 is a probe from the floor
    retry: int = RETRY
    plain_rounds: int = 0  # rounds at the floor since it got there or last probed
    # the next drafting round is the row's first, or follows plain ones: the draft reads what it
    # has not seen (the prompt, the tokens since), which the round's time shows; not counted
    skip: bool = True
    wins: int = 0  # comparisons won at this ceiling
    drafted: int = 0  # the most tokens the row was allowed at this ceiling (its k)
    misses: int = 0  # counted drafting rounds in a row, at any ceiling, that accepted nothing
    rounds: int = 0  # rounds of the row, drafting or plain
    rate: _Mean = field(default_factory=lambda: _Mean(DECAY))  # rounds' (tokens + idle) / seconds
    idle: _Mean = field(default_factory=lambda: _Mean(DECAY))  # idle rows per drafting row, as weighed
    # the plain step its verifies imply at their price: its narrow ones' (NARROW), its wider ones'
    narrow: _Mean = field(default_factory=lambda: _Mean(DECAY))
    implied: _Mean = field(default_factory=lambda: _Mean(DECAY))
    bound: _Mean = field(default_factory=lambda: _Mean(DECAY))  # rounds' tokens x verify / seconds

    @classmethod
    def at(cls, ceiling: int) -> "Floor":
        """A fresh floor that starts at `ceiling`."""
        return cls(ceiling=ceiling, start=ceiling)

    @property
    def fresh(self) -> bool:
        """No round ran under this floor yet."""
        return self.rounds == 0

    def limit(self) -> int:
        """The most tokens the row drafts this round: its ceiling, or at the floor a one-token
        probe once `retry` plain rounds went by."""
        self.rounds += 1
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
        verify: float | None = None,
        idle: float = 0.0,
        proposed: int | None = None,
    ) -> None:
        """A round of this row ran: it drafted, allowed `k` tokens (0: it proposed nothing, a
        plain round), and committed `tokens` in a round of `seconds` whose verify took
        `verify_seconds`; `plain`: a plain round's seconds at this width, where measured;
        `verify`: what that verify costs in plain steps, where the device's costs were measured
        (the round's verify then implies a plain step: its seconds over that cost); `idle`: rows
        of the batch that drafted nothing this round, per drafting row; `proposed`: the tokens
        it proposed (None: k).

        A round that drafts is longer than a plain step for every row of the batch: a row that
        drafted nothing (a plain request, a row at its floor) commits one token in it where it
        would have committed seconds / plain of them. Each drafting row is charged its share of
        that loss, (seconds - plain) / seconds per idle row, so its speed-up exceeds 1 only where
        the batch as a whole commits more than plain rounds would: a plain request beside a
        drafting one is never slowed for less than it gains."""
        if k == 0 or seconds <= 0:
            return
        if self.skip:
            self.skip = False
            return
        self.drafted = max(self.drafted, k)
        self.misses = self.misses + 1 if tokens <= 1 else 0  # only the target's own token: a miss
        # each round weighed by its length, so that the means are the rounds' tokens over their
        # time, the row's throughput; at most k + 1 verifies long, which k draft steps and a
        # verify stay within while a draft step costs under about 0.8 of a plain one: a round
        # stalled by something else (another process, a page fault) weighs as a long round, not
        # as a dozen
        longest = k + 1.0
        if verify_seconds > 0:
            # (a plain step costs at most the verify: charged at the verify, the bound stays one)
            self.bound.add(
                (tokens * verify_seconds - idle * max(0.0, seconds - verify_seconds)) / seconds,
                min(seconds / verify_seconds, longest),
            )
        weight = min(seconds, longest * verify_seconds) if verify_seconds > 0 else seconds
        self.rate.add((tokens + idle) / seconds, weight)
        self.idle.add(idle, weight)
        if verify is not None and verify_seconds > 0:
            narrow = (k if proposed is None else proposed) <= NARROW
            (self.narrow if narrow else self.implied).add(verify_seconds / verify)
        if self.rate.count < MIN_ROUNDS:
            return
        measured = self.speedup(plain)
        if measured is not None:
            # valued at wide verifies' price alone: right on average, not for this row's rounds
            self.unsure = plain is None and not self.narrow.count
            value, error = measured
            if value + error < 1.0:  # a clear loss
                self._lower()
            elif value - error > 1.0:  # a clear win
                self._won()
            return
        # no plain step at all: the bound (a verify costs at least a plain step) can prove a
        # loss, and a win only past what a verify may cost; neither, the row asks for plain rounds
        low, high = self.bound.value - self.bound.error, self.bound.value + self.bound.error
        self.unsure = high >= 1.0 and low < VERIFY_BOUND
        if high < 1.0:
            self._lower()
        elif low >= VERIFY_BOUND:
            self._won()

    def speedup(self, plain: float | None = None) -> tuple[float, float] | None:
        """The rounds' speed-up over plain steps of `plain` seconds (else of the plain step the
        row's narrow verifies imply, else its wider ones'), and its standard error; None with
        none of them. A round's is its tokens times plain over its seconds, less what it cost the
        idle rows beside it: plain x (tokens + idle) / seconds - idle. Kept as the rounds' rate,
        the speed-up is valued at whatever plain step is known now: the verifies' until the
        width's plain rounds are measured, then those."""
        for implied in (self.narrow, self.implied):
            if plain is None and implied.count:
                plain = implied.value
        if plain is None or not self.rate.count:
            return None
        return plain * self.rate.value - self.idle.value, plain * self.rate.error

    def renew(self) -> None:
        """The drafter changed under the row (drafters.base.Drafter.widened: its head now reaches
        ids it could not). A row whose rounds lowered its ceiling below where it started starts
        afresh there: a Chinese answer's first rounds, drafted before the head packed the
        ideographs, had lowered the ceiling to 2 or 1 for the rest of the answer. A row at or
        above its start keeps what it measured: a German answer's rare words widen the head a
        block at a time (7 times in translate-02's first 24 rounds), and a floor that started
        afresh at each never measured the MIN_ROUNDS rounds a verdict needs."""
        if self.ceiling >= self.start:
            return
        self._restart(self.start)
        self.probing, self.retry, self.skip, self.misses = False, RETRY, True, 0

    def _lower(self) -> None:
        if self.probing:  # the probe lost: wait longer before the next
            self.retry = min(MAX_RETRY, self.retry * 2)
        self.probing = False
        # nothing accepted: no shorter draft commits more than the plain round's one token either
        self._restart(0 if self.drafted <= 1 or self.misses >= MISSES else self.drafted // 2)

    def _won(self) -> None:
        if self.probing:
            self.probing, self.retry = False, RETRY
        self.wins += 1
        if self.wins >= GROW and self.ceiling < NONE:
            self._restart(self.ceiling * 2 if self.ceiling * 2 < MAX_CEILING else NONE)

    def _restart(self, ceiling: int) -> None:
        """A new ceiling: its rounds are measured afresh."""
        self.ceiling, self.wins, self.plain_rounds, self.unsure, self.drafted = ceiling, 0, 0, False, 0
        self.rate, self.idle, self.bound = _Mean(DECAY), _Mean(DECAY), _Mean(DECAY)
