"""Whether drafting pays at a batch width, decided from the engine's own measured rounds.

The width cost model (length.WidthCosts) says from timed forwards how many tokens to draft at
each batch width. It leaves things out that only a running batch shows: the draft's catch-up
prefill of a joining row, a draft step's host syncs (the confidence stop), a wider first step,
the acceptance of the requests actually served. On the default pair on a 2-core CPU it promised
drafting 17% more than plain rounds at width 2 and rounds delivered 0.92-1.0x of plain
(benchmarks/README.md, issue 24).

`WidthRates` keeps, per batch width, the tokens per second that drafting rounds and plain rounds
achieved (each an exponentially weighted sum over its own rounds, HALFLIFE rounds) and answers,
before a round at a width where the cost model allows drafting:

- DRAFT while plain rounds there are unmeasured, but one round in EXPLORE is a plain round
  (EXPLORE: nothing is held back, the draft catches up the one token next round);
- once both kinds have MIN_ROUNDS rounds: DRAFT when drafting rounds delivered MARGIN more
  tokens per second than plain ones, else PLAIN (the rows are held to plain rounds as at a cap
  of 0). A tie goes to plain rounds: going back to drafting costs held rows the draft's
  catch-up prefill, which the steady rounds' rates do not show;
- at a width not measured yet, PLAIN at once when the nearest narrower measured width chose
  plain rounds: the same requests accept the same, and a wider verify costs more per token
  drafted, so drafting cannot win there either. Exploring every width costs the most where
  drafting is cheap to try and loses (prompt lookup's padded verifies in a wide batch: width by
  width, its exploring rounds cost a server 4-6% of its throughput);
- and the kind not chosen runs once in a while, so a change (other requests, another text, the
  machine's speed) is seen: a plain round after REFRESH drafting rounds (it costs at most one
  round's gain), a drafting round after RETRY plain rounds (rows held to plain rounds pay the
  draft's catch-up prefill when they draft again, and only rows with enough tokens left do).

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
RETRY = 256  # plain rounds between two drafting rounds, once plain rounds are chosen
# One row drafts the device's own k, as `specgen run` does (length.choose measured it; a served
# request alone gives what a local run gives, round for round): rates decide from two rows on.
LEAST = 2


class Choice(Enum):
    DRAFT = "draft"  # the round drafts as the width cap allows
    EXPLORE = "explore"  # one plain round to measure; rows keep their place in the draft
    PLAIN = "plain"  # drafting did not pay here: plain rounds (as a width cap of 0)


@dataclass
class _Tally:
    """Exponentially weighted tokens and seconds of one kind of round at one width."""

    tokens: float = 0.0
    seconds: float = 0.0
    rounds: int = 0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds
        self.rounds += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Width:
    draft: _Tally = field(default_factory=_Tally)
    plain: _Tally = field(default_factory=_Tally)
    since: int = 0  # rounds since the kind not chosen last ran


class WidthRates:
    """Measured throughput of drafting and plain rounds per batch width (see the module)."""

    def __init__(self, halflife: float = HALFLIFE, min_rounds: int = MIN_ROUNDS, explore: int = EXPLORE,
                 refresh: int = REFRESH, retry: int = RETRY, least: int = LEAST,
                 margin: float = MARGIN):
        self.decay = 0.5 ** (1.0 / halflife)
        self.min_rounds, self.explore, self.refresh, self.retry = min_rounds, explore, refresh, retry
        self.least, self.margin = least, margin
        self.widths: dict[int, _Width] = {}

    def choose(self, width: int) -> Choice | None:
        """The kind of the next round at `width` (where the width cap allows drafting); None
        below `least` rows: as the cap says, unmeasured."""
        if width < self.least:
            return None
        w = self.widths.setdefault(width, _Width())
        if self._inferred(width, w):
            return Choice.DRAFT if w.since + 1 >= self.retry else Choice.PLAIN
        if w.draft.rounds < self.min_rounds and w.plain.rounds >= self.min_rounds:
            return Choice.DRAFT  # plain measured first (explored while held): measure drafting too
        if w.plain.rounds < self.min_rounds:
            return Choice.EXPLORE if w.since + 1 >= self.explore else Choice.DRAFT
        if self._drafting(w):
            return Choice.EXPLORE if w.since + 1 >= self.refresh else Choice.DRAFT
        return Choice.DRAFT if w.since + 1 >= self.retry else Choice.PLAIN

    def record(self, width: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A round at `width` ran: whether any row drafted, the tokens it committed, its seconds."""
        w = self.widths.setdefault(width, _Width())
        (w.draft if drafted else w.plain).add(tokens, seconds, self.decay)
        chosen_is_draft = not self._inferred(width, w) and (w.plain.rounds < self.min_rounds or self._drafting(w))
        w.since = w.since + 1 if drafted == chosen_is_draft else 0

    def _drafting(self, w: _Width) -> bool:
        return w.draft.rate > w.plain.rate * (1 + self.margin)

    def _measured(self, w: _Width) -> bool:
        return w.draft.rounds >= self.min_rounds and w.plain.rounds >= self.min_rounds

    def _inferred(self, width: int, w: _Width) -> bool:
        """Plain rounds at `width` from a narrower width: its drafting is unmeasured here, and the
        nearest narrower width whose rounds of both kinds are measured chose plain ones."""
        if w.draft.rounds >= self.min_rounds:
            return False
        narrower = [n for n in self.widths if n < width and self._measured(self.widths[n])]
        return bool(narrower) and not self._drafting(self.widths[max(narrower)])

    def summary(self) -> dict[int, tuple[float, float]]:
        """Per width: (drafting rounds' tok/s, plain rounds' tok/s), 0 where unmeasured."""
        return {width: (w.draft.rate, w.plain.rate) for width, w in sorted(self.widths.items())}
