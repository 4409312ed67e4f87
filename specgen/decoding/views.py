"""A generation as text: what renderers (the terminal, a server's relay) are shown.

Each round's committed tokens are pushed once through an incremental `TextStream`, so the text
is never re-decoded as a whole. Host data only (no torch import): a client reads it alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from specgen.decoding.events import ReplayResult, RoundResult, TokenLogprob
from specgen.decoding.stats import MIN_TIMED_SECONDS, Stats
from specgen.text import TextStream, TokenBytes


@dataclass(frozen=True)
class RoundView:
    """One round (events.RoundResult) as text: a piece per emitted token, pushed through the
    text stream (accepted draft pieces, then the target's), the discarded drafts' own texts, and
    for a tree round each node's text beside the round's shape (what a terminal draws; a
    client of the server, which sees no ids, gets the same)."""

    accepted: list[str]
    target: str
    rejected: list[str] = field(default_factory=list)
    pending: bool = False  # deterministic mode: not yet verified by a replay
    target_emitted: bool = True  # False when the round was cut (EOS, length) before the target's token
    nodes: list[str] = field(default_factory=list)  # a tree round: each node's text, the root first; else empty
    parents: tuple[int, ...] = ()  # a tree round: node j's parent is parents[j - 1] (RoundResult's)
    path: frozenset[int] = frozenset()  # a tree round: the accepted nodes
    tried: frozenset[int] = frozenset()  # a tree round: the nodes tried and rejected
    # the row's last round: what the stream held back, now text (a character cut short, bytes
    # that form none); it completes the last token that is not special, this round's or earlier
    tail: str = ""

    @property
    def is_tree(self) -> bool:
        return bool(self.nodes)

    @property
    def pieces(self) -> list[str]:
        """A piece per emitted token, in order (an empty one for a token that completes no
        character yet, or a special token): what a replay's rollback, counted in tokens, cuts."""
        return self.accepted + ([self.target] if self.target_emitted else [])


@dataclass(frozen=True)
class ReplayView:
    """A replay closed the pending tokens: the last `len(rolled_back)` were discarded."""

    rolled_back: list[str]
    correction: str | None  # the replay's own token at the first mismatch
    tail: str = ""  # the replay that ended the row: what the stream held back (RoundView.tail)


@dataclass
class Outcome:
    text: str
    token_ids: list[int]
    stats: Stats
    interrupted: bool = False
    extra: dict = field(default_factory=dict)
    state: object = field(default=None, repr=False)  # the engine's DecodeState, for the next turn


class Renderer(Protocol):
    """Shows one generation: entered before the prefill, a call per round and per replay, exited
    when decoding ends (also on Ctrl-C), then `finish` with the outcome."""

    def __enter__(self): ...

    def __exit__(self, *exc): ...

    def on_round(self, view: RoundView, stats: Stats) -> None: ...

    def on_replay(self, view: ReplayView, stats: Stats) -> None: ...

    def finish(self, outcome: Outcome) -> None: ...


class Silent:
    """A renderer that shows nothing (warm-ups, measurements)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def on_round(self, view: RoundView, stats: Stats) -> None:
        pass

    def on_replay(self, view: ReplayView, stats: Stats) -> None:
        pass

    def finish(self, outcome: Outcome) -> None:
        pass


def round_view(result: RoundResult, stream: TextStream, pending: bool = False) -> RoundView:
    """Text for one round: each committed token pushed once through the stream. The row's last
    round also flushes what the stream held back (its `tail`), so every renderer ends with the
    same text."""
    pieces = [stream.push(t) for t in result.emitted]
    # in deterministic mode the end is final only once the replay says so (replay_view)
    tail = stream.flush() if result.stop is not None and not pending else ""
    accepted = pieces[: result.accepted_emitted]
    target = pieces[-1] if result.target_emitted else ""
    rejected = [stream.token_text(t) for t in result.rejected]
    view = RoundView(accepted, target, rejected, pending=pending, target_emitted=result.target_emitted, tail=tail)
    if result.is_chain:
        return view
    return replace(view, nodes=[stream.token_text(t) for t in result.tokens], parents=result.parents,
                   path=frozenset(result.path), tried=frozenset(result.tried))


def replay_view(replay: ReplayResult, stream: TextStream) -> ReplayView:
    """Roll the text stream back past discarded tokens, then push the correction."""
    rolled = [stream.token_text(t) for t in replay.rolled_back]
    correction = None
    if replay.rolled_back:
        stream.truncate(len(stream.ids) - len(replay.rolled_back))
    if replay.correction is not None:
        correction = stream.push(replay.correction)
    return ReplayView(rolled, correction, stream.flush() if replay.stop is not None else "")


def logprob_entries(tokens: list[int], logprobs: list[TokenLogprob], token_bytes: TokenBytes) -> list[dict]:
    """Committed tokens with their log-probabilities, as JSON output carries them: id, text
    (the token's bytes as UTF-8, a replacement character for part of a character), exact
    bytes, log-probability and the most likely tokens at its position."""
    def item(token: int, value: float) -> dict:
        raw = token_bytes(token)
        return {"id": token, "token": raw.decode("utf-8", errors="replace"), "bytes": list(raw), "logprob": value}

    # None: a token nothing predicts (an echoed prompt's first)
    return [{**item(token, None), "top": None} if lp is None else
            {**item(token, lp.logprob), "top": [item(t, v) for t, v in lp.top]} for token, lp in zip(tokens, logprobs)]


def speed(stats) -> str:
    """The decode rate as shown: `12.3 tok/s`, or `– tok/s` where decoding took too little time to
    time (one token, which the prefill gives; a first round): 1 token in 40 us read 24963 tok/s."""
    return f"{stats.tokens_per_second:.1f} tok/s" if stats.decode_seconds >= MIN_TIMED_SECONDS else "– tok/s"


def summary_line(outcome: Outcome) -> str:
    """One line for a finished generation: plain output's stderr, the server's log."""
    s = outcome.stats
    note = " (interrupted)" if outcome.interrupted else ""
    accept = f", acceptance {s.acceptance_rate:.1%}" if s.drafted else ""
    return (f"[{s.method}] {s.new_tokens} tokens in {s.rounds} rounds{accept}, "
            f"{s.tokens_per_target_forward:.2f} tokens/target forward, {speed(s)}{note}")
