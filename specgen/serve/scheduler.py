"""The engine thread: continuous batching of the server's requests.

The HTTP layer submits a request's tickets (`Ticket`: a choice of an api.ApiRequest, a row
each) and never touches a tensor; one thread owns the models and runs the engine loop.
Requests become rows of one running batch and leave it when they finish or their client goes
away (dropped before the next round). Each row keeps its own sampling settings, seed, token
budget, stop strings and drafting: plain, lookup, chain, a tree or a head, its draft length and
its deterministic window (drafters/mixed.py), so requests of every kind share one batch and one
target forward per round, in the order they came. A request's event goes to its own output and,
as plain data, to its HTTP task's queue: a client that reads slowly holds nobody up.

Between requests the engine keeps its last row in the cache: a request that continues the same
conversation (a chat's next turn) prefills only its new tokens. Each row measures its own
drafting against plain steps at the batch's width and drafts less where it does not pay
(decoding/floor.py); a draft model's rows also keep to the width caps measured once per machine
(`caps`: the most tokens such a row drafts at each width, and the fewest such rows that draft in
one round).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

import torch

from specgen.config import SEED_MAX, GenerationConfig
from specgen.decoding.build import build_engine
from specgen.decoding.engine import FRESH, Engine
from specgen.decoding.events import Finished, Joined, RoundResult
from specgen.decoding.feed import Request
from specgen.decoding.policy import Policy, capped, no_cap
from specgen.decoding.rows import DecodeState
from specgen.decoding.run import fold
from specgen.decoding.staging import PREFILL_CHUNK
from specgen.decoding.widths import WidthCaps
from specgen.errors import one_line
from specgen.runtime.pair import Pair
from specgen.serve import api
from specgen.serve.metrics import Metrics
from specgen.serve.output import Output
from specgen.text import common_prefix


class QueueFull(Exception):
    """The waiting queue holds --max-queue requests: the server answers 503."""


@dataclass(eq=False)
class Ticket:
    """A choice of a request, in the scheduler's queue and then a row of its batch: which choice
    (its prompt, and the seed it samples with), its prompt's ids and where its answer goes, set by
    the HTTP layer (`tickets`); its place in the queue, when it came and whether it was given up,
    set by the scheduler. Two tickets are the same only if they are one object (the queue finds
    a ticket by identity)."""

    request: api.ApiRequest
    choice: int  # its index among the answer's choices: prompt p's choice c is p * n + c
    config: GenerationConfig  # the request's, with this choice's seed
    ids: list[int]  # the prompt's token ids
    post: Callable[[object], None]  # hands a chunk, an answer, an ApiError or None (the end) to HTTP
    index: int = 0  # its serial number in the queue (its row's index in the engine's events): `submit`
    cancelled: bool = False  # the client went away, or a stop string ended the answer
    submitted: float = 0.0  # time.monotonic() when it was queued

    @property
    def prompt(self) -> api.Prompt:
        return self.request.prompts[self.choice // self.request.n]


def tickets(
    request: api.ApiRequest, ids: list[list[int]], post: Callable[[int], Callable[[object], None]]
) -> list[Ticket]:
    """A ticket per choice of `request`: each prompt (`ids`: each one's token ids) `n` times, each
    its own row, indexed as OpenAI does (prompt p's choice c is p * n + c; `post(choice)` takes its
    items); with a `seed`, choice c samples with seed + c (as a prompt set's prompt i does; past
    SEED_MAX it wraps to 0), so the choices differ and a rerun gives them again. Greedy choices are
    all the same answer."""
    sampling = request.config.sampling
    configs = [
        replace(request.config, sampling=replace(sampling, seed=(sampling.seed + c) % (SEED_MAX + 1)))
        if c and sampling.seed is not None
        else request.config
        for c in range(request.n)
    ]
    n = request.n
    return [
        Ticket(request, p * n + c, configs[c], prompt_ids, post(p * n + c))
        for p, prompt_ids in enumerate(ids)
        for c in range(n)
    ]


class Scheduler:
    def __init__(
        self,
        pair: Pair,
        max_batch: int,
        max_queue: int,
        metrics: Metrics,
        log: Callable[[Ticket, object], None] = lambda ticket, stats: None,
        caps: WidthCaps | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
    ):
        self.pair, self.max_batch, self.max_queue, self.metrics, self.log = (
            pair,
            max_batch,
            max_queue,
            metrics,
            log,
        )
        # a draft model's rows per batch width: their draft length, how many draft together
        # (widths.WidthCaps); empty: as requested
        self.caps = caps or WidthCaps()
        metrics.drafting_together(self.caps.least)
        self.prefill_chunk = prefill_chunk  # a long prompt's tokens per round while others decode (CPU)
        self.cond = threading.Condition()
        self.waiting: deque[Ticket] = deque()
        self.running: dict[int, tuple[Ticket, Output]] = {}  # by row index: each running row's answer so far
        self.engine: Engine | None = None  # built on the first request (or the warm-up)
        self.serial = 0
        self.served = 0  # requests answered (not counting those whose client left)
        self.stopping = False
        self.stop_at = math.inf  # stopping: running rows end at this time.monotonic() (a drain's end)
        self.idle_since = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="specgen-engine", daemon=True)

    # -- the HTTP side --------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self, grace: float = 0.0) -> None:
        """No more rows: every request still queued is answered that the server is stopping (a
        stream's last event); running ones may finish within `grace` seconds, then end before
        their next round with the same answer."""
        with self.cond:
            self.stopping = True
            self.stop_at = min(self.stop_at, time.monotonic() + grace)
            waiting = list(self.waiting)
            self.waiting.clear()
            self.cond.notify_all()
        for ticket in waiting:
            ticket.post(shutting_down())
            ticket.post(None)

    def submit(self, *tickets: Ticket) -> None:
        """Queue a request's tickets (one per choice), all of them or, when the queue has no room
        for all, none (QueueFull)."""
        with self.cond:
            if len(self.waiting) + len(tickets) > self.max_queue:
                raise QueueFull()
            for ticket in tickets:
                self.serial += 1
                ticket.index, ticket.submitted = self.serial, time.monotonic()
                self.waiting.append(ticket)
            self.metrics.queue_depth.set(len(self.waiting))
            self.cond.notify_all()

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: a waiting request is forgotten, a running row ends before its
        next round."""
        with self.cond:
            ticket.cancelled = True
            if ticket in self.waiting:  # never admitted: counted here, as a running row is when it ends
                self.waiting.remove(ticket)
                self.metrics.queue_depth.set(len(self.waiting))
                self.metrics.finished(ticket, "cancelled", None)

    def busy(self) -> bool:
        with self.cond:
            return bool(self.waiting or self.running)

    def build(self, config: GenerationConfig) -> Engine:
        """The server's engine, checked for `config`'s method: every row of every method shares
        its batch; a draft model's rows draft at most the measured width caps (`caps`), and only
        with enough such rows beside them, unless their request set its own draft length."""
        caps = self.caps

        def measured(width: int, config: GenerationConfig) -> int:
            if not (caps and capped(config)):
                return no_cap(width, config)
            cap = caps.at(width)  # past the widest measured width, the widest's cap
            # the caps count a chain's tokens: a tree row keeps to them only where they say plain
            # rounds (its own floor cuts its tree where its rounds lose)
            return no_cap(width, config) if config.method.is_tree and cap > 0 else cap

        policy = Policy(width_cap=measured, together=caps.together, prefill_chunk=self.prefill_chunk)
        return build_engine(self.pair, config, policy=policy)

    def ready(self, config: GenerationConfig) -> Engine:
        """The engine, built if need be (the warm-up's, then every request's)."""
        if self.engine is None:
            self.engine = self.build(config)
        return self.engine

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        # flush-to-zero is a per-thread CPU flag: load_pair set it on the loading thread, and
        # without it subnormal activations take x86's slow path (norms several times slower)
        torch.set_flush_denormal(True)
        while True:
            with self.cond:
                while not self.waiting and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    return
                first = self.waiting[0]
            self._serve(first.config, first.ids)
            self.idle_since = time.monotonic()

    def _serve(self, config: GenerationConfig, first_ids: list[int]) -> None:
        """Run the engine until nothing is left to admit or running."""
        try:
            self._drive(config, first_ids)
        except Exception as exc:  # noqa: BLE001 - the server outlives a failed batch; its rows get the error
            error = api.ApiError(
                500, f"the engine failed: {one_line(exc, 200)}", kind="server_error", code="engine_error"
            )
            if os.environ.get("SPECGEN_DEBUG"):
                traceback.print_exc()
            else:  # one line in the server's log; SPECGEN_DEBUG=1 shows the traceback
                print(f"{time.strftime('%H:%M:%S')} error 500: {error.message}", file=sys.stderr, flush=True)
            with self.cond:
                failed = [ticket for ticket, _ in self.running.values()]
                for ticket in failed:
                    del self.running[ticket.index]
                # it failed before admitting a row (building the engine, say):
                if not failed and self.waiting:
                    head = self.waiting[0].request  # the request that chose it, or it would be tried for ever
                    failed = [t for t in self.waiting if t.request is head]
                    for ticket in failed:
                        self.waiting.remove(ticket)
                    self.metrics.queue_depth.set(len(self.waiting))
            for ticket in failed:
                if ticket.choice == 0:  # one request of n choices
                    self.metrics.refused(ticket.request.endpoint, 500)
                ticket.post(error)
                ticket.post(None)
            self.engine = None  # a fresh engine (and caches) for the next request

    def _drive(self, config: GenerationConfig, first_ids: list[int]) -> None:
        engine = self.ready(config)
        # a request that continues a row the engine parked resumes it: it extends that row's
        # prompt (a chat's next turn) or shares more than half of its own
        resume = max(engine.parked, key=lambda state: common_prefix(state.ids, first_ids), default=None)
        if resume is not None:
            common = common_prefix(resume.ids, first_ids)
            if common < resume.prompt_length and common <= len(first_ids) // 2:
                resume = None
        events = engine.drive(_Queue(self), self.max_batch, FRESH if resume is None else resume)
        for report, stats in fold(engine, events):
            self._dispatch(report, stats)

    def _dispatch(self, report, stats) -> None:
        if report.index not in self.running:
            return
        (ticket, output), event = self.running[report.index], report.event
        if isinstance(event, Joined):
            self.metrics.joined(
                time.monotonic() - ticket.submitted,
                event.prompt_tokens,
                event.reused_tokens,
                len(self.running),
            )
            for chunk in output.add(event, stats):  # an echoed prompt
                ticket.post(chunk)
            return
        if isinstance(event, Finished):
            self.metrics.threads.set(self.engine.threads.count)
            width, state = min(len(self.running), self.max_batch), report.state
            k = min(state.draft_length(), self.engine.policy.width_cap(width, state.config))
            self.metrics.draft_lengths(ticket.config.method.value, {width: k})
            self.metrics.prefixes(self.pair.target_prefixes.held, self.pair.draft_prefixes.held)
            self._finish(ticket, output, stats, report.state, event.stop)
            with self.cond:  # counted and answered first: a scheduler that is not busy has counted every row
                del self.running[report.index]
            self.metrics.batch_width.set(len(self.running))
            return
        if isinstance(event, RoundResult):
            self.metrics.round(event, stats)
        chunks = output.add(event, stats)
        for chunk in chunks:
            ticket.post(chunk)
        if output.stopped:  # a stop string: the row ends before its next round
            ticket.cancelled = True

    def _finish(self, ticket: Ticket, output: Output, stats, state: DecodeState, stop: str | None) -> None:
        ids = state.final_ids()
        if stop == "cancelled" and not output.stopped:  # the client left, or the server is stopping
            self.metrics.finished(ticket, "cancelled", stats)
            if self.stopping and not ticket.cancelled:
                ticket.post(shutting_down())
            ticket.post(None)
            return
        stream = ticket.request.stream
        chunks = output.finish(stats, ids, stop) if stream else [output.response(stats, ids, stop)]
        # counted before the answer goes out: a client that reads /metrics once answered sees its request
        self.served += 1
        self.metrics.finished(ticket, output.reason, stats)
        for chunk in chunks:
            ticket.post(chunk)
        self.log(ticket, stats)
        ticket.post(None)


def shutting_down() -> api.ApiError:
    return api.ApiError(
        503,
        "the server is stopping; send the request again once it is back",
        kind="server_error",
        code="server_shutdown",
    )


class _Queue:
    """The engine's view of the queue: requests in the order they came, whatever their
    drafting; running rows whose client left are dropped."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def take(self, room: int) -> list[Request]:
        s = self.scheduler
        out = []
        with s.cond:
            while room > 0 and s.waiting and not s.stopping:
                ticket = s.waiting.popleft()
                request, config, ids = ticket.request, ticket.config, ticket.ids
                output = Output(request, ticket.prompt, s.pair.target.tokenizer, len(ids), ids)
                s.running[ticket.index] = (ticket, output)
                out.append(
                    Request(
                        ids,
                        ticket.index,
                        config,
                        config.sampling.seed,
                        request.ignore_eos,
                        request.stop_ids,
                        request.prompt_logprobs is not None
                        or (request.echo_prompt and config.sampling.logprobs is not None),
                        request.prompt_logprobs or 0,
                    )
                )
                room -= 1
            s.metrics.queue_depth.set(len(s.waiting))
        return out

    def dropped(self) -> set[int]:
        s = self.scheduler
        with s.cond:
            ended = s.stopping and time.monotonic() >= s.stop_at
            return {i for i, (ticket, _) in s.running.items() if ticket.cancelled or ended}
