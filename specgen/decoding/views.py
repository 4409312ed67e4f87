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

    def on_round(self, result: RoundResult, stats: Stats) -> None: ...

    def on_replay(self, replay: ReplayResult, stats: Stats) -> None: ...

    def finish(self, outcome: Outcome) -> None: ...


class Silent:
    """A renderer that shows nothing (warm-ups, measurements)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def on_round(self, result: RoundResult, stats: Stats) -> None:
        pass

    def on_replay(self, replay: ReplayResult, stats: Stats) -> None:
        pass

    def finish(self, outcome: Outcome) -> None:
        pass


def round_text(
    result: RoundResult, stream: TextStream, pending: bool = False, drafts: bool = True
) -> RoundResult:
    """The round with its text: each committed token pushed once through the stream. The row's
    last round also flushes what the stream held back (its `tail`), so every renderer ends with
    the same text. `drafts`: also the texts only a live view draws (rejected drafts, a tree's
    nodes), a decode per token; a server answering without the live view leaves them out."""
    pieces = tuple(stream.push(t) for t in result.emitted)
    # in deterministic mode the end is final only once the replay says so (replay_text)
    tail = stream.flush() if result.stop is not None and not pending else ""
    if not drafts:
        return replace(result, pieces=pieces, pending=pending, tail=tail)
    nodes = () if result.is_chain else tuple(stream.token_text(t) for t in result.tokens)
    return replace(
        result,
        pieces=pieces,
        rejected_texts=tuple(stream.token_text(t) for t in result.rejected),
        node_texts=nodes,
        pending=pending,
        tail=tail,
    )


def replay_text(replay: ReplayResult, stream: TextStream) -> ReplayResult:
    """The replay with its text: the stream rolled back past the discarded tokens, then the
    correction pushed."""
    rolled = tuple(stream.token_text(t) for t in replay.rolled_back)
    correction = None
    if replay.rolled_back:
        stream.truncate(len(stream.ids) - len(replay.rolled_back))
    if replay.correction is not None:
        correction = stream.push(replay.correction)
    return replace(
        replay,
        rolled_back_texts=rolled,
        correction_text=correction,
        tail=stream.flush() if replay.stop is not None else "",
    )


def logprob_entries(tokens: list[int], logprobs: list[TokenLogprob], token_bytes: TokenBytes) -> list[dict]:
    """Committed tokens with their log-probabilities, as JSON output carries them: id, text
    (the token's bytes as UTF-8, a replacement character for part of a character), exact
    bytes, log-probability and the most likely tokens at its position."""

    def item(token: int, value: float) -> dict:
        raw = token_bytes(token)
        return {
            "id": token,
            "token": raw.decode("utf-8", errors="replace"),
            "bytes": list(raw),
            "logprob": value,
        }

    # None: a token nothing predicts (an echoed prompt's first)
    return [
        {**item(token, None), "top": None}
        if lp is None
        else {**item(token, lp.logprob), "top": [item(t, v) for t, v in lp.top]}
        for token, lp in zip(tokens, logprobs)
    ]


def speed(stats) -> str:
    """The decode rate as shown: `12.3 tok/s`, or `– tok/s` where decoding took too little time to
    time (one token, which the prefill gives; a first round): 1 token in 40 us read 24963 tok/s."""
    return (
        f"{stats.decode_tokens_per_second:.1f} tok/s"
        if stats.decode_seconds >= MIN_TIMED_SECONDS
        else "– tok/s"
    )


DECLINED = (
    "the draft model did not read this prompt: reading it would cost more than drafting can save "
    "over this many tokens (a fixed --draft-tokens N drafts anyway)"
)


def declined_note(stats) -> str:
    """Why a drafting method drafted nothing with its model, where that is why (Stats.declined)."""
    return DECLINED if stats.declined else ""


def summary_line(outcome: Outcome) -> str:
    """One line for a finished generation: plain output's stderr, the server's log."""
    s = outcome.stats
    note = " (interrupted)" if outcome.interrupted else ""
    accept = f", acceptance {s.acceptance_rate:.1%}" if s.drafted else ""
    declined = f"; {declined_note(s)}" if s.declined else ""
    return (
        f"[{s.method}] {s.new_tokens} tokens in {s.rounds} rounds{accept}, "
        f"{s.tokens_per_target_forward:.2f} tokens/target forward, {speed(s)}{note}{declined}"
    )
