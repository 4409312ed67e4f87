"""The engine thread: continuous batching of the server's requests.

The HTTP layer submits jobs (api.Job, one per choice) and never touches a tensor; one thread owns the models
and
runs the engine loop. Requests become rows of a running batch and leave it when they finish
or their client goes away (dropped before the next round). Each row keeps its own sampling
settings, seed, token budget and stop strings.

Requests that need the same drafting (method, draft length, tree shape, deterministic window)
share one engine and batch. The oldest waiting request decides which engine runs next: an
engine admits rows of its own kind only while no other kind has waited longer, so each kind
drains in turn and none starves. A request's event goes to its own output and, as plain data,
to its HTTP task's queue: a client that reads slowly holds nobody up.

Between requests each engine keeps its last row in the cache: a request that continues the
same conversation (a chat's next turn) prefills only its new tokens. At most MAX_ENGINES engines
(each with its K/V caches) are kept, the least recently used given up first: a request chooses
its drafting freely (`draft_confidence` is any number), and one engine per setting kept forever
would let a client fill the memory. What an engine measured of its rounds (its WidthRates)
outlives it, so a rebuilt engine starts from it.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import traceback
from collections import OrderedDict, deque
from typing import Callable

import torch

from specgen.config import GenerationConfig, Method
from specgen.decoding.build import build_engine
from specgen.decoding.engine import FRESH, Engine, Policy, no_cap
from specgen.decoding.events import Finished, Joined, RoundResult
from specgen.decoding.feed import Request
from specgen.decoding.rates import WidthRates
from specgen.decoding.rows import DecodeState
from specgen.decoding.run import fold
from specgen.decoding.staging import PREFILL_CHUNK
from specgen.errors import one_line
from specgen.runtime.pair import Pair
from specgen.serve import api
from specgen.serve.metrics import Metrics
from specgen.serve.output import Output
from specgen.text import common_prefix

MAX_ENGINES = 8  # engines kept (a drafting setting each); bench --concurrency runs up to 8 methods
MAX_RATES = 64  # drafting settings whose measured rounds are kept


class QueueFull(Exception):
    """The waiting queue holds --max-queue requests: the server answers 503."""


def drafting_key(config: GenerationConfig) -> tuple:
    """What an engine is built for: requests that agree on it can share a batch."""
    return (
        config.method,
        config.draft_tokens,
        config.draft_confidence,
        config.schedule,
        config.branching,
        config.beam_width,
        config.depth,
        config.deterministic,
        config.verify_window,
    )


def engine_key(job: api.Job) -> tuple:
    """The engine a queued job runs on: its drafting, and whether it set its own draft length."""
    return drafting_key(job.config) + (job.config.floor,)


class Scheduler:
    def __init__(
        self,
        pair: Pair,
        max_batch: int,
        max_queue: int,
        metrics: Metrics,
        log: Callable[[api.Job, object], None] = lambda job, stats: None,
        caps: dict[int, int] | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
    ):
        self.pair, self.max_batch, self.max_queue, self.metrics, self.log = (
            pair,
            max_batch,
            max_queue,
            metrics,
            log,
        )
        # model chains' draft length per batch width (costs.WidthCosts.cap); none: as requested
        self.caps = caps or {}
        self.prefill_chunk = prefill_chunk  # a long prompt's tokens per round while others decode (CPU)
        self.cond = threading.Condition()
        self.waiting: deque[api.Job] = deque()
        self.running: dict[int, Output] = {}  # by row index: each running job's answer so far (its `job`)
        self.engines: OrderedDict[tuple, Engine] = OrderedDict()  # least recently used first
        self.rates: OrderedDict[tuple, WidthRates] = OrderedDict()  # per key, kept past its engine
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
        for job in waiting:
            job.post(shutting_down())
            job.post(None)

    def submit(self, *jobs: api.Job) -> None:
        """Queue a request's jobs (one per choice, their prompts' ids and `post` set), all of them
        or, when the queue has no room for all, none (QueueFull)."""
        with self.cond:
            if len(self.waiting) + len(jobs) > self.max_queue:
                raise QueueFull()
            for job in jobs:
                self.serial += 1
                job.index, job.submitted = self.serial, time.monotonic()
                self.waiting.append(job)
            self.metrics.queue_depth.set(len(self.waiting))
            self.cond.notify_all()

    def cancel(self, job: api.Job) -> None:
        """The client went away: a waiting request is forgotten, a running row ends before its
        next round."""
        with self.cond:
            job.cancelled = True
            if job in self.waiting:  # never admitted: counted here, as a running row is when it ends
                self.waiting.remove(job)
                self.metrics.queue_depth.set(len(self.waiting))
                self.metrics.finished(job, "cancelled", None)

    def busy(self) -> bool:
        with self.cond:
            return bool(self.waiting or self.running)

    def build(self, config: GenerationConfig, capped: bool = True) -> Engine:
        """An engine for `config`'s drafting. Unless the requests set their own draft length
        (`capped` False), every speculative method drafts only at the batch widths where its own
        measured rounds beat plain ones (decoding/rates.py), and a draft model's k (a chain's, or
        a tree's permission to draft at all) also follows the measured costs of wider verifies
        (`caps`). Prompt lookup drafts for free, so only its measured rounds decide: at a wide
        batch its padded verify can cost more than its few accepted tokens give."""
        return build_engine(self.pair, config, policy=self.policy(config, capped))

    def policy(self, config: GenerationConfig, capped: bool) -> Policy:
        """How `build`'s engine schedules its rounds: the server's prefill chunk (on a CPU), and
        unless the requests set their own draft length, its width caps and measured rates."""
        if not capped or config.method is Method.PLAIN:
            return Policy(prefill_chunk=self.prefill_chunk)
        caps = self.caps

        def measured(width: int) -> int:  # past the widest measured width, the widest's cap
            return caps.get(width, caps[max(caps)])

        cap = measured if caps and config.method.needs_draft_model else no_cap
        key = drafting_key(config) + (not capped,)
        rates = self.rates.pop(key, None) or WidthRates()
        self.rates[key] = rates
        while len(self.rates) > MAX_RATES:
            self.rates.popitem(last=False)
        return Policy(cap, rates, self.prefill_chunk)

    def engine(self, key: tuple, config: GenerationConfig, capped: bool) -> Engine:
        """The engine of `key`, built if need be; the least recently used ones past MAX_ENGINES
        are given up (their caches freed)."""
        engine = self.engines.pop(key, None) or self.build(config, capped)
        self.engines[key] = engine
        while len(self.engines) > MAX_ENGINES:
            self.engines.popitem(last=False)
        return engine

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
            self._serve(engine_key(first), first.config, first.ids, first.config.floor)
            self.idle_since = time.monotonic()

    def _serve(self, key: tuple, config: GenerationConfig, first_ids: list[int], capped: bool) -> None:
        """Run the engine of `key` until nothing of its kind is left to admit or running."""
        try:
            self._drive(key, config, first_ids, capped)
        except Exception as exc:  # noqa: BLE001 - the server outlives a failed batch; its rows get the error
            error = api.ApiError(
                500, f"the engine failed: {one_line(exc, 200)}", kind="server_error", code="engine_error"
            )
            if os.environ.get("SPECGEN_DEBUG"):
                traceback.print_exc()
            else:  # one line in the server's log; SPECGEN_DEBUG=1 shows the traceback
                print(f"{time.strftime('%H:%M:%S')} error 500: {error.message}", file=sys.stderr, flush=True)
            with self.cond:
                failed = [o.job for o in self.running.values() if engine_key(o.job) == key]
                for job in failed:
                    del self.running[job.index]
                # it failed before admitting a row (building the engine, say):
                if not failed and self.waiting:
                    head = self.waiting[0].id  # the request that chose it, or it would be tried for ever
                    failed = [j for j in self.waiting if j.id == head]
                    for job in failed:
                        self.waiting.remove(job)
                    self.metrics.queue_depth.set(len(self.waiting))
            for job in failed:
                if job.choice == 0:  # one request of n choices
                    self.metrics.refused(job.endpoint or job.kind, 500)
                job.post(error)
                job.post(None)
            self.engines.pop(key, None)  # a fresh engine (and caches) for the next request

    def _drive(self, key: tuple, config: GenerationConfig, first_ids: list[int], capped: bool) -> None:
        engine = self.engine(key, config, capped)
        # a request that continues a row the engine parked resumes it: it extends that row's
        # prompt (a chat's next turn) or shares more than half of its own
        resume = max(engine.parked, key=lambda state: common_prefix(state.ids, first_ids), default=None)
        if resume is not None:
            common = common_prefix(resume.ids, first_ids)
            if common < resume.prompt_length and common <= len(first_ids) // 2:
                resume = None
        feed = _KeyFeed(self, key)
        events = engine.drive(feed, config, self.max_batch, FRESH if resume is None else resume)
        for report, stats in fold(engine, events, config.method.value):
            self._dispatch(report, stats, engine)

    def _dispatch(self, report, stats, engine: Engine) -> None:
        output = self.running.get(report.index)
        if output is None:
            return
        job, event = output.job, report.event
        if isinstance(event, Joined):
            self.metrics.joined(
                time.monotonic() - job.submitted, event.prompt_tokens, event.reused_tokens, len(self.running)
            )
            for chunk in output.add(event, stats):  # an echoed prompt
                job.post(chunk)
            return
        if isinstance(event, Finished):
            if engine.policy.rates is not None:
                self.metrics.draft_lengths(job.config.method.value, self._lengths(engine, job.config))
            self.metrics.prefixes(self.pair.target_prefixes.held, self.pair.draft_prefixes.held)
            self._finish(output, stats, report.state, event.stop)
            with self.cond:  # counted and answered first: a scheduler that is not busy has counted every row
                del self.running[report.index]
            self.metrics.batch_width.set(len(self.running))
            return
        if isinstance(event, RoundResult):
            self.metrics.round(event, stats)
        chunks = output.add(event, stats)
        for chunk in chunks:
            job.post(chunk)
        if output.stopped:  # a stop string: the row ends before its next round
            job.cancelled = True

    def _lengths(self, engine: Engine, config: GenerationConfig) -> dict[int, int]:
        """The most tokens a row drafts per batch width: the width caps of a draft model's
        methods, lowered where the engine's measured rounds chose less."""
        lengths = dict(self.caps) if config.method.needs_draft_model else {}
        lengths.update({width: k for width, (k, _, _) in engine.policy.rates.summary().items()})
        return lengths

    def _finish(self, output: Output, stats, state: DecodeState, stop: str | None) -> None:
        job = output.job
        ids = state.final_ids(job.config)
        if stop == "cancelled" and not output.stopped:  # the client left, or the server is stopping
            self.metrics.finished(job, "cancelled", stats)
            if self.stopping and not job.cancelled:
                job.post(shutting_down())
            job.post(None)
            return
        chunks = output.finish(stats, ids, stop) if job.stream else [output.response(stats, ids, stop)]
        # counted before the answer goes out: a client that reads /metrics once answered sees its request
        self.served += 1
        self.metrics.finished(job, output.reason, stats)
        for chunk in chunks:
            job.post(chunk)
        self.log(job, stats)
        job.post(None)


def shutting_down() -> api.ApiError:
    return api.ApiError(
        503,
        "the server is stopping; send the request again once it is back",
        kind="server_error",
        code="server_shutdown",
    )


class _KeyFeed:
    """The engine's view of the queue: requests of its drafting kind, while none of another
    kind has waited longer; running rows whose client left are dropped."""

    def __init__(self, scheduler: Scheduler, key: tuple):
        self.scheduler, self.key = scheduler, key

    def take(self, room: int) -> list[Request]:
        s = self.scheduler
        out = []
        with s.cond:
            while room > 0 and s.waiting and engine_key(s.waiting[0]) == self.key and not s.stopping:
                job = s.waiting.popleft()
                config = job.config
                s.running[job.index] = Output(job, s.pair.target.tokenizer, len(job.ids), job.ids)
                out.append(
                    Request(
                        job.ids,
                        job.index,
                        config.sampling,
                        config.max_new_tokens,
                        config.sampling.seed,
                        job.ignore_eos,
                        job.stop_ids,
                        job.prompt_logprobs or (job.echo_prompt and config.sampling.logprobs is not None),
                        job.prompt_top,
                    )
                )
                room -= 1
            s.metrics.queue_depth.set(len(s.waiting))
        return out

    def dropped(self) -> set[int]:
        s = self.scheduler
        with s.cond:
            ended = s.stopping and time.monotonic() >= s.stop_at
            return {i for i, o in s.running.items() if o.job.cancelled or ended}
