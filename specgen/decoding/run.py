"""The one driver: prompts -> engine events -> Stats -> outcomes. Every front end (run, chat,
bench, the server) drives a generation through these functions, so there is one place that
folds events into statistics and one place that says which tokens are final.

* `fold`: the engine's events, each with its row's Stats brought up to date;
* `generate`: one prompt into a renderer (each round with its text, `views.round_text`); Ctrl-C ends it early
and
  keeps what was made; with `state` a chat turn continues its caches;
* `run_prompts`: many prompts (dynamic batching), outcomes in input order; Ctrl-C keeps the
  finished ones and marks the rest unfinished;
* `finished_rows`: the same decoding, each outcome as soon as its row finishes.
"""

from __future__ import annotations

import time
from typing import Iterator

from specgen.config import GenerationConfig
from specgen.decoding.engine import FRESH, Engine, RowEvent
from specgen.decoding.events import Finished, Joined, ReplayResult, RoundResult
from specgen.decoding.rows import DecodeState
from specgen.decoding.stats import Stats
from specgen.decoding.views import Outcome, Renderer, logprob_entries, replay_text, round_text
from specgen.runtime import fp32
from specgen.text import TextStream, TokenBytes, text_of


def weight_format(engine: Engine) -> str:
    """The target's weight dtype, as the statistics name it."""
    return str(fp32.compute_dtype(engine.model)).removeprefix("torch.")


def fold(
    engine: Engine, events: Iterator[RowEvent], label: str | None = None
) -> Iterator[tuple[RowEvent, Stats]]:
    """The engine's events (from `generate` or `drive`), each with its row's Stats (labelled
    `label`, else its own method) updated to include it. A row's Stats is dropped once it
    finished."""
    dtype = weight_format(engine)
    stats: dict[int, Stats] = {}
    setup: dict[int, float] = {}
    for report in events:
        if report.index not in stats:
            stats[report.index] = Stats(method=label or report.state.config.method.value, dtype=dtype)
        row = stats[report.index]
        row.add(report.event, report.elapsed)
        if isinstance(report.event, Joined):
            setup[report.index] = engine.setup_seconds()
        elif isinstance(report.event, RoundResult):
            row.setup_seconds = engine.setup_seconds() - setup[report.index]
        elif isinstance(report.event, Finished):
            row.threads = engine.threads.count
            del stats[report.index], setup[report.index]
        yield report, row


def generate(
    engine: Engine,
    tokenizer,
    prompt_ids: list[int],
    config: GenerationConfig,
    renderer: Renderer,
    state: DecodeState | None = None,
    label: str | None = None,
) -> Outcome:
    """Run one generation into `renderer`; Ctrl-C ends it early and keeps what was made.

    With `state` (from a previous Outcome of this engine) the caches are reused where the new
    prompt agrees with what they hold; the returned Outcome carries the state for the next turn.
    """
    stats = Stats(
        method=label or config.method.value, prompt_tokens=len(prompt_ids), dtype=weight_format(engine)
    )
    stream = TextStream(tokenizer)
    interrupted, logprobs = False, []
    with renderer:
        try:
            events = engine.generate([prompt_ids], config, resume=FRESH if state is None else state)
            for report, stats in fold(engine, events, label or config.method.value):
                state, event = report.state, report.event
                if isinstance(event, RoundResult):
                    logprobs += event.logprobs
                    renderer.on_round(round_text(event, stream, pending=config.deterministic), stats)
                elif isinstance(event, ReplayResult):
                    renderer.on_replay(replay_text(event, stream), stats)
        except KeyboardInterrupt:
            interrupted = True
    ids = stream.ids
    if config.deterministic and state is not None and state.verified - len(prompt_ids) < len(ids):
        stream.truncate(max(state.verified - len(prompt_ids), 0))  # only replay-verified tokens are final
        ids = stream.ids
    ids = list(ids)
    stats.interrupted = int(interrupted)
    outcome = Outcome(
        text_of(tokenizer, ids, stream),
        ids,
        stats,
        interrupted,
        state=state,
        extra=_logprobs(tokenizer, ids, logprobs, config),
    )
    renderer.finish(outcome)
    return outcome


def _logprobs(tokenizer, ids: list[int], logprobs: list, config: GenerationConfig) -> dict:
    """An outcome's `logprobs` (views.logprob_entries) when its config asks for them."""
    if config.sampling.logprobs is None:
        return {}
    return {"logprobs": logprob_entries(ids, logprobs, TokenBytes(tokenizer))}


def run_prompts(
    engine: Engine, tokenizer, prompts: list[list[int]], config: GenerationConfig, batch_size: int = 1
) -> Iterator[tuple[int, Outcome]]:
    """Yield (index, Outcome) in input order; the engine itself finishes rows in any order.

    Ctrl-C (raised while decoding, or thrown in at a yield by the caller) ends the decoding; the
    rows finished so far are still yielded in order, every other row as `unfinished`.
    """
    done, next_index = {}, 0
    try:
        for index, outcome in finished_rows(engine, tokenizer, prompts, config, batch_size):
            done[index] = outcome
            while next_index in done:
                yield next_index, done.pop(next_index)
                next_index += 1
    except KeyboardInterrupt:
        for index in range(next_index, len(prompts)):
            yield index, done.pop(index) if index in done else unfinished(prompts[index], config)


def finished_rows(
    engine: Engine, tokenizer, prompts: list[list[int]], config: GenerationConfig, batch_size: int = 1
) -> Iterator[tuple[int, Outcome]]:
    """Yield (index, Outcome) as each row finishes, in the order the engine finishes them (a
    prompt set written to a file as it goes). Ctrl-C is the caller's: it ends the decoding."""
    logprobs: dict[int, list] = {}
    for report, stats in fold(engine, engine.generate(prompts, config, batch_size), config.method.value):
        if isinstance(report.event, RoundResult) and report.event.logprobs:
            logprobs.setdefault(report.index, []).extend(report.event.logprobs)
        if isinstance(report.event, Finished):
            ids = report.state.final_ids()
            yield (
                report.index,
                Outcome(
                    text_of(tokenizer, ids),
                    ids,
                    stats,
                    extra=_logprobs(tokenizer, ids, logprobs.pop(report.index, []), config),
                ),
            )


def unfinished(prompt_ids: list[int], config: GenerationConfig) -> Outcome:
    """A prompt that Ctrl-C stopped before it finished: no text, marked interrupted."""
    return Outcome(
        "",
        [],
        Stats(method=config.method.value, prompt_tokens=len(prompt_ids), interrupted=1),
        interrupted=True,
    )


def timed(engine: Engine, prompt_ids: list[int], config: GenerationConfig, label: str | None = None):
    """One generation measured as bench needs it: (final token ids, Stats, wall seconds from the
    call to the last token, tokens that arrived with the first round)."""
    started = time.perf_counter()
    first_tokens, stats, state = 0, None, None
    for report, stats in fold(engine, engine.generate([prompt_ids], config), label or config.method.value):
        state = report.state
        if isinstance(report.event, RoundResult):
            first_tokens = first_tokens or len(report.event.emitted)
    return state.final_ids(), stats, time.perf_counter() - started, first_tokens
