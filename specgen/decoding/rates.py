"""How many tokens to draft at a batch width, decided from the engine's own measured rounds.

The width cost model (costs.WidthCosts) says from timed forwards how many tokens to draft at
each batch width. It leaves things out that only a running batch shows: the draft's catch-up
prefill of a joining row, a draft step's host syncs (the confidence stop), a wider first step,
the acceptance of the requests actually served, and a verify whose cost is flat up to some
number of tokens and then climbs. On the default pair on a 2-core CPU it promised drafting 17%
more than plain rounds at width 2 (k = 3) and rounds delivered 0.92-1.0x of plain, while k = 1
there gave 1.08x in-process (benchmarks/server.md, "Draft lengths per width").

`WidthRates` keeps, per batch width, the tokens per second that plain rounds and drafting rounds
at each draft length ("arm") achieved (each an exponentially weighted sum over its own rounds,
HALFLIFE rounds), and answers, before a round at a width where the cap allows drafting, a `Pick`:

- DRAFT at the width's arm (it starts at the cap) while plain rounds there are unmeasured, but
  one round in EXPLORE is a plain round (EXPLORE: nothing is held back, the draft catches up the
  one token next round);
- once plain rounds and the arm have MIN_ROUNDS rounds each: the arm stays while its rounds
  deliver MARGIN more tokens per second than plain ones, else it is halved (3 -> 1 -> 0), and
  the halved arm is measured in turn. At 0 the rows are held to plain rounds (PLAIN, as at a cap
  of 0). A tie goes to plain rounds: going back to drafting costs held rows the draft's catch-up
  prefill, which the steady rounds' rates do not show;
- a width not measured yet starts at the arm of the nearest narrower width that decided (its
  arm won, or it went down to plain rounds): the same requests accept the same, and a wider
  verify costs more per token drafted, so a longer draft cannot win there. Exploring every width
  costs the most where drafting is cheap to try and loses (prompt lookup's padded verifies in a
  wide batch: width by width, its exploring rounds cost a server 4-6% of its throughput);
- and the kind not chosen runs once in a while, so a change (other requests, another text, the
  machine's speed) is seen: a plain round after REFRESH drafting rounds (it costs at most one
  round's gain), a one-token drafting round after RETRY plain rounds; once those have
  MIN_ROUNDS rounds and win, the width drafts one token again. A retry is dear with a draft
  model: every held row with enough tokens left pays the draft's catch-up of its whole text
  (0.3-0.4 s each on the 2-core CPU: at 2 rows and a retry every 256 rounds, 2-3% of the
  throughput), so retries are rare.

Only the draft length changes, never what a round commits: every k gives the same greedy output
and the same sampling law (length.py), so the choice is exact whatever it measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

HALFLIFE = 16.0  # rounds of one kind at one width
MIN_ROUNDS = 4  # rounds of each kind before their rates are compared
MARGIN = 0.05  # drafting rounds must deliver this much more than plain ones to be chosen
EXPLORE = 4  # while plain rounds are unmeasured: one round in EXPLORE is plain
REFRESH = 48  # drafting rounds between two plain rounds, once drafting is chosen
RETRY = 1024  # plain rounds between two drafting rounds, once plain rounds are chosen
# One row drafts the device's own k, as `specgen run` does (costs.choose measured it; a served
# request alone gives what a local run gives, round for round): rates decide from two rows on.
LEAST = 2
UNSET = 1 << 30  # a width's arm before its cap is known: the cap


class Choice(Enum):
    DRAFT = "draft"  # the round drafts up to the pick's k
    EXPLORE = "explore"  # one plain round to measure; rows keep their place in the draft
    PLAIN = "plain"  # drafting did not pay here: plain rounds (as a width cap of 0)


@dataclass(frozen=True)
class Pick:
    """The kind of the next round and, for DRAFT, the most tokens a row drafts in it."""

    kind: Choice
    k: int = 0


@dataclass
class _Width:
    """One batch width's rounds: per draft length drafted (0: plain rounds) its exponentially
    weighted tokens and seconds and how many rounds ran; the arm in use, and the rounds since
    the kind not chosen last ran."""

    tokens: dict[int, float] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)
    rounds: dict[int, int] = field(default_factory=dict)
    arm: int = UNSET  # the draft length in use (0: plain rounds)
    since: int = 0  # rounds since the kind not chosen last ran

    def add(self, k: int, tokens: int, seconds: float, decay: float) -> None:
        self.tokens[k] = self.tokens.get(k, 0.0) * decay + tokens
        self.seconds[k] = self.seconds.get(k, 0.0) * decay + seconds
        self.rounds[k] = self.rounds.get(k, 0) + 1

    def ran(self, k: int) -> int:
        """Rounds of draft length k (0: plain rounds) at this width."""
        return self.rounds.get(k, 0)

    def rate(self, k: int) -> float:
        """Tokens per second of the rounds of draft length k (0: plain rounds), 0 unmeasured."""
        seconds = self.seconds.get(k, 0.0)
        return self.tokens[k] / seconds if seconds > 0 else 0.0


class WidthRates:
    """Measured throughput of plain rounds and of each draft length per batch width (see the
    module)."""

    def __init__(
        self,
        halflife: float = HALFLIFE,
        min_rounds: int = MIN_ROUNDS,
        explore: int = EXPLORE,
        refresh: int = REFRESH,
        retry: int = RETRY,
        least: int = LEAST,
        margin: float = MARGIN,
    ):
        self.decay = 0.5 ** (1.0 / halflife)
        self.min_rounds, self.explore, self.refresh, self.retry = min_rounds, explore, refresh, retry
        self.least, self.margin = least, margin
        self.widths: dict[int, _Width] = {}

    def choose(self, width: int, cap: int) -> Pick | None:
        """The next round at `width`, where the width cap allows `cap` (> 0) draft tokens; None
        below `least` rows: as the cap says, unmeasured."""
        if width < self.least:
            return None
        w = self.widths.setdefault(width, _Width())
        arm = self._arm(width, w, cap)
        if arm == 0:
            return Pick(Choice.DRAFT, 1) if w.since + 1 >= self.retry else Pick(Choice.PLAIN)
        if w.ran(0) < self.min_rounds:
            return Pick(Choice.EXPLORE) if w.since + 1 >= self.explore else Pick(Choice.DRAFT, arm)
        if self._measured(w, arm) and w.since + 1 >= self.refresh:
            return Pick(Choice.EXPLORE)
        return Pick(Choice.DRAFT, arm)

    def record(self, width: int, k: int, tokens: int, seconds: float) -> None:
        """A round at `width` ran: the pick's k if any row drafted (else 0), the tokens it
        committed, its seconds."""
        w = self.widths.setdefault(width, _Width())
        w.add(k, tokens, seconds, self.decay)
        if w.ran(0) >= self.min_rounds:
            if self._measured(w, w.arm) and not self._wins(w, w.arm):
                w.arm //= 2  # measured and lost: half the draft (at 0, plain rounds)
            elif w.arm == 0 and self._measured(w, k) and self._wins(w, k):
                w.arm = k  # a retry won again
        w.since = w.since + 1 if (k > 0) == (w.arm > 0) else 0

    def _measured(self, w: _Width, k: int) -> bool:
        """Drafting rounds of length k (> 0) ran MIN_ROUNDS times at this width."""
        return k > 0 and w.ran(k) >= self.min_rounds

    def _wins(self, w: _Width, k: int) -> bool:
        return w.rate(k) > w.rate(0) * (1 + self.margin)

    def _decided(self, w: _Width) -> bool:
        """The width's arm is measured: it won, or its arms went down to plain rounds."""
        return w.ran(0) >= self.min_rounds and (
            w.arm == 0 or (self._measured(w, w.arm) and self._wins(w, w.arm))
        )

    def _arm(self, width: int, w: _Width, cap: int) -> int:
        """The width's draft length: at most the cap and, until this width measured its own,
        the nearest narrower decided width's."""
        w.arm = min(w.arm, cap)
        if not self._measured(w, w.arm):
            narrower = [n for n, v in self.widths.items() if n < width and self._decided(v)]
            if narrower:
                w.arm = min(w.arm, self.widths[max(narrower)].arm)
        return w.arm

    def summary(self) -> dict[int, tuple[int, dict[int, float], float]]:
        """Per width: (its draft length, tok/s of the drafting rounds of each length tried,
        plain rounds' tok/s, 0 where unmeasured)."""
        return {
            width: (
                0 if w.arm == UNSET else w.arm,
                {k: w.rate(k) for k in sorted(w.rounds) if k > 0},
                w.rate(0),
            )
            for width, w in sorted(self.widths.items())
        }
