"""Counters for a generation: acceptance, tokens per target forward, timings, histogram."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # render (and the server's client) read Stats without loading torch
    from specgen.engine import RoundResult


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
    seconds: float = 0.0  # wall time from the start of prefill to the last token
    time_to_first_token: float | None = None
    accepted_lengths: Counter = field(default_factory=Counter)
    tree_sizes: list[int] = field(default_factory=list)  # draft nodes per tree round
    verified_windows: int = 0  # deterministic mode: replays run
    rollbacks: int = 0  # replays that discarded tokens
    rolled_back_tokens: int = 0
    replay_seconds: float = 0.0
    stop: str | None = None
    dtype: str | None = None  # the target's weight format (what --dtype auto chose)
    setup_seconds: float = 0.0  # capturing and compiling fixed-shape steps (first use of a shape)

    def update(self, result: RoundResult, elapsed: float) -> None:
        """Add one round; `elapsed` is the wall time since prefill started."""
        self.rounds += 1
        self.new_tokens += len(result.emitted)
        # drafts past the stopping point (EOS or the length limit inside the accepted part)
        # were never in question: they do not count as proposed
        cut_inside = result.stop is not None and len(result.emitted) <= result.accepted
        self.drafted += len(result.emitted) if cut_inside else len(result.draft_tokens)
        self.accepted += result.accepted_emitted
        self.draft_seconds += result.draft_seconds
        self.verify_seconds += result.verify_seconds
        if result.draft_tokens:
            self.accepted_lengths[result.accepted] += 1
        if result.tree is not None:
            self.tree_sizes.append(len(result.tree.tokens) - 1)
        if self.time_to_first_token is None and result.emitted:
            self.time_to_first_token = elapsed
        self.seconds = elapsed
        self.stop = result.stop or self.stop

    def update_replay(self, replay, elapsed: float) -> None:
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

    @property
    def target_forwards(self) -> int:
        """Target forwards while decoding: one per round, plus one per replay (prefill excluded)."""
        return self.rounds + self.verified_windows

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def decode_seconds(self) -> float:
        """Decoding alone: after prefill, without compiling and capturing steps."""
        return max(self.seconds - self.prefill_seconds - self.setup_seconds, 0.0)

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: new tokens over the time after prefill."""
        return self.new_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens,
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
            "tokens_per_second": round(self.tokens_per_second, 3),
            "accepted_length_histogram": {str(k): v for k, v in sorted(self.accepted_lengths.items())},
            "tree_size_per_round": list(self.tree_sizes),
            "mean_tree_size": round(sum(self.tree_sizes) / len(self.tree_sizes), 3) if self.tree_sizes else 0.0,
            "verified_windows": self.verified_windows,
            "rollbacks": self.rollbacks,
            "rolled_back_tokens": self.rolled_back_tokens,
            "replay_seconds": round(self.replay_seconds, 4),
            "stop_reason": self.stop,
            "dtype": self.dtype,
        }
