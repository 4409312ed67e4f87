"""The one counter: what a generation did (acceptance, tokens per target forward, timings,
histograms, replays), folded from the engine's events, and merged for totals.

Rates are computed here and nowhere else (`rate`), for one generation, for chat's session
totals (`merge`) and for bench's pooled rows and cells. Two token rates, never one name for both:
`decode_tokens_per_second` (after prefill) and `wall_tokens_per_second` (over the whole wall time).
No torch import: renderers and the client read it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from specgen.decoding.events import Event, Finished, Joined, Origin, ReplayResult, RoundResult

MIN_TIMED_SECONDS = (
    0.05  # a decode shorter than this gives no rate worth showing (1 token in 40 us read 24963 tok/s)
)


def rate(part: float, whole: float) -> float | None:
    """part / whole, or None when there is no whole (nothing drafted, no forward, no time)."""
    return part / whole if whole else None


@dataclass
class Stats:
    method: str
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    # the first round a draft model (or head) drafted: its time is mostly the draft's read of the
    # prompt, which a draft step's cost leaves out (bench's draft step column; the floor skips it too)
    read_seconds: float = 0.0
    read_drafted: int = 0  # that round's draft tokens
    seconds: float = 0.0  # wall time from the start of prefill to the last token
    time_to_first_token: float | None = None
    first_tokens: int = 0  # tokens that arrived with the first one (a round can emit several)
    accepted_lengths: Counter = field(default_factory=Counter)
    accepted_by_origin: Counter = field(default_factory=Counter)  # accepted draft tokens by Origin value
    tree_sizes: list[int] = field(default_factory=list)  # draft nodes per tree round
    verified_windows: int = 0  # deterministic mode: replays run
    rollbacks: int = 0  # replays that discarded tokens
    rolled_back_tokens: int = 0
    replay_seconds: float = 0.0
    stop: str | None = None
    dtype: str | None = None  # the target's weight format (what --dtype auto chose)
    threads: int | None = None  # the forwards' torch threads when it finished (runtime/threads.py)
    setup_seconds: float = 0.0  # capturing and compiling fixed-shape steps (first use of a shape)
    reused_tokens: int = 0  # prompt tokens served from the caches of an earlier generation
    generations: int = 1  # how many generations these counts cover (more after `merge`)
    interrupted: int = 0  # of those, how many Ctrl-C (or a client) cut short
    declined: int = 0  # of those, how many the draft model declined to read (Joined.declined)

    # -- folding events -----------------------------------------------------------------------
    def add(self, event: Event, elapsed: float) -> None:
        """Fold one engine event in; `elapsed` is the wall time since the row's prefill started."""
        if isinstance(event, RoundResult):
            self._round(event, elapsed)
        elif isinstance(event, ReplayResult):
            self._replay(event, elapsed)
        elif isinstance(event, Joined):
            self.prompt_tokens = event.prompt_tokens
            self.reused_tokens = event.reused_tokens
            self.prefill_seconds = event.prefill_seconds
            self.declined = int(event.declined)
        elif isinstance(event, Finished):
            self.stop = event.stop or self.stop

    def _round(self, result: RoundResult, elapsed: float) -> None:
        self.rounds += 1
        self.new_tokens += len(result.emitted)
        # drafts past the stopping point (EOS or the length limit inside the accepted part)
        # were never in question: they do not count as proposed
        cut_inside = result.stop is not None and len(result.emitted) <= result.accepted
        drafted = len(result.emitted) if cut_inside else len(result.draft_tokens)
        self.drafted += drafted
        self.accepted += result.accepted_emitted
        self.draft_seconds += result.draft_seconds
        if drafted and result.origin is Origin.MODEL and not self.read_drafted:
            self.read_seconds, self.read_drafted = result.draft_seconds, drafted
        self.verify_seconds += result.verify_seconds
        if result.draft_tokens:
            self.accepted_lengths[result.accepted] += 1
            self.accepted_by_origin[result.origin.value] += result.accepted_emitted
        if not result.is_chain:
            self.tree_sizes.append(len(result.draft_tokens))
        if self.time_to_first_token is None and result.emitted:
            self.time_to_first_token = elapsed
            self.first_tokens = len(result.emitted)
        self.seconds = elapsed
        self.stop = result.stop or self.stop

    def _replay(self, replay: ReplayResult, elapsed: float) -> None:
        """A deterministic-mode replay: discarded tokens leave the count, a correction joins."""
        self.verified_windows += 1
        self.replay_seconds += replay.seconds
        if replay.rolled_back:
            self.rollbacks += 1
            self.rolled_back_tokens += len(replay.rolled_back)
            self.new_tokens -= len(replay.rolled_back)
        if replay.correction is not None:
            self.new_tokens += 1
        self.seconds = elapsed
        self.stop = replay.stop or self.stop

    def merge(self, other: "Stats") -> "Stats":
        """The totals of two (sets of) generations: counts, times and histograms added; the
        first token time and the format of the first; the method kept when both agree."""
        return replace(
            self,
            method=self.method if self.method == other.method else "mixed",
            **{name: getattr(self, name) + getattr(other, name) for name in _SUMMED},
            accepted_lengths=self.accepted_lengths + other.accepted_lengths,
            accepted_by_origin=self.accepted_by_origin + other.accepted_by_origin,
            tree_sizes=self.tree_sizes + other.tree_sizes,
            time_to_first_token=self.time_to_first_token
            if self.time_to_first_token is not None
            else other.time_to_first_token,
            first_tokens=self.first_tokens if self.time_to_first_token is not None else other.first_tokens,
            stop=other.stop or self.stop,
            dtype=self.dtype or other.dtype,
            threads=other.threads or self.threads,
        )

    # -- derived figures ------------------------------------------------------------------------
    @property
    def target_forwards(self) -> int:
        """Target forwards while decoding: one per round, plus one per replay (prefill excluded;
        a first token from the prefill counts as its round)."""
        return self.rounds + self.verified_windows

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted draft tokens; 0 when nothing was drafted."""
        return self.acceptance or 0.0

    @property
    def acceptance(self) -> float | None:
        """Accepted over drafted draft tokens; None when nothing was drafted (bench's columns,
        which tell a method that drafts nothing from one whose drafts all fail)."""
        return rate(self.accepted, self.drafted)

    @property
    def tokens_per_target_forward(self) -> float:
        return rate(self.new_tokens, self.target_forwards) or 0.0

    @property
    def decode_seconds(self) -> float:
        """Decoding alone: after prefill, without compiling and capturing steps."""
        return max(self.seconds - self.prefill_seconds - self.setup_seconds, 0.0)

    @property
    def decode_tokens_per_second(self) -> float:
        """Decode throughput: new tokens over the time after prefill (`decode_seconds`)."""
        return rate(self.new_tokens, self.decode_seconds) or 0.0

    @property
    def tokens_per_second(self) -> float:
        """The old name of `decode_tokens_per_second`, kept for one release (as the JSON's key)."""
        return self.decode_tokens_per_second

    @property
    def wall_tokens_per_second(self) -> float:
        """New tokens over the whole wall time `seconds` (prefill included): bench's tok/s."""
        return rate(self.new_tokens, self.seconds) or 0.0

    def _after_first(self) -> tuple[int, float] | None:
        """(tokens after the first arrival, seconds after it), or None before any token came."""
        if self.time_to_first_token is None:
            return None
        return self.new_tokens - self.first_tokens, self.seconds - self.time_to_first_token

    @property
    def after_first_tokens_per_second(self) -> float | None:
        """Tokens after the first arrival over the time after it (bench's decode rate, which
        every method has, a library's that reports no prefill included); None without both."""
        after = self._after_first()
        return after[0] / after[1] if after is not None and after[0] > 0 and after[1] > 0 else None

    @property
    def seconds_per_token(self) -> float | None:
        """Time per output token after the first (TPOT); None where no token followed it."""
        after = self._after_first()
        return after[1] / after[0] if after is not None and after[0] > 0 else None

    @property
    def rollback_rate(self) -> float:
        """Deterministic mode: rolled-back tokens over every token generated (kept or rolled back)."""
        return rate(self.rolled_back_tokens, self.new_tokens + self.rolled_back_tokens) or 0.0

    @property
    def mean_tree_size(self) -> float:
        return rate(sum(self.tree_sizes), len(self.tree_sizes)) or 0.0

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "target_forwards": self.target_forwards,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_target_forward": round(self.tokens_per_target_forward, 4),
            "seconds": round(self.seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
            "setup_seconds": round(self.setup_seconds, 4),
            "time_to_first_token": round(self.time_to_first_token or 0.0, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "read_seconds": round(self.read_seconds, 4),
            "read_drafted": self.read_drafted,
            # the old key of decode_tokens_per_second, kept for one release (docs/usage.md)
            "tokens_per_second": self._timed(self.decode_tokens_per_second),
            "decode_tokens_per_second": self._timed(self.decode_tokens_per_second),
            "accepted_length_histogram": histogram(self.accepted_lengths),
            # accepted draft tokens by where they came from: model, text (prompt lookup), memory
            "accepted_by_origin": dict(sorted(self.accepted_by_origin.items())),
            "tree_size_per_round": list(self.tree_sizes),
            "mean_tree_size": round(self.mean_tree_size, 3),
            "verified_windows": self.verified_windows,
            "rollbacks": self.rollbacks,
            "rolled_back_tokens": self.rolled_back_tokens,
            "replay_seconds": round(self.replay_seconds, 4),
            "stop_reason": self.stop,
            "dtype": self.dtype,
            "threads": self.threads,
            # generations whose prompt the draft model did not read (nor draft for): reading it
            # would have cost more than drafting saves (0 or 1 for one generation)
            "draft_declined": self.declined,
        }

    def _timed(self, value: float) -> float | None:
        """A decode rate as JSON carries it: None (a dash in views.speed) for a decode too short to time."""
        return round(value, 3) if self.decode_seconds >= MIN_TIMED_SECONDS else None


def from_dict(data: dict, method: str | None = None) -> Stats:
    """The Stats that `as_dict` wrote (a served run's statistics, read back by its client)."""
    stats = Stats(method=method or data.get("method") or "?")
    for name in (
        "new_tokens",
        "prompt_tokens",
        "reused_tokens",
        "rounds",
        "drafted",
        "accepted",
        "verified_windows",
        "rollbacks",
        "rolled_back_tokens",
        "read_drafted",
    ):
        setattr(stats, name, int(data.get(name) or 0))
    stats.declined = int(data.get("draft_declined") or 0)
    for name in (
        "seconds",
        "prefill_seconds",
        "setup_seconds",
        "draft_seconds",
        "verify_seconds",
        "replay_seconds",
        "read_seconds",
    ):
        setattr(stats, name, float(data.get(name) or 0.0))
    stats.time_to_first_token = data.get("time_to_first_token") or None
    stats.accepted_lengths = Counter(
        {int(k): int(v) for k, v in (data.get("accepted_length_histogram") or {}).items()}
    )
    stats.tree_sizes = [int(n) for n in data.get("tree_size_per_round") or []]
    origins = data.get("accepted_by_origin") or {}
    stats.accepted_by_origin = Counter({str(k): int(v) for k, v in origins.items()})
    stats.stop, stats.dtype = data.get("stop_reason"), data.get("dtype")
    threads = data.get("threads")
    stats.threads = threads if isinstance(threads, int) and not isinstance(threads, bool) else None
    return stats


_SUMMED = (
    "prompt_tokens",
    "new_tokens",
    "rounds",
    "drafted",
    "accepted",
    "prefill_seconds",
    "draft_seconds",
    "verify_seconds",
    "read_seconds",
    "read_drafted",
    "seconds",
    "verified_windows",
    "rollbacks",
    "rolled_back_tokens",
    "replay_seconds",
    "setup_seconds",
    "reused_tokens",
    "generations",
    "interrupted",
    "declined",
)


def histogram(counts) -> dict[str, int]:
    """{accepted length: rounds} with string keys in numeric order, as JSON carries it."""
    return {str(k): v for k, v in sorted(counts.items(), key=lambda kv: int(kv[0]))}
