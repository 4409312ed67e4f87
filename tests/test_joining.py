"""Rows joining between rounds: requests that arrive while others prefill join before the
round; the server's width caps hold a draft model's rows, and a request that set its own draft
length keeps it; greedy outputs stay those of plain decoding."""

from __future__ import annotations

from collections import Counter, deque

from tiny import batch_ids, engine_with

from specgen.config import GenerationConfig, Method
from specgen.decoding.events import Finished, Joined, RoundResult
from specgen.decoding.feed import Request
from specgen.decoding.policy import MAX_DRAFT, capped
from specgen.decoding.widths import WidthCaps
from specgen.runtime.pair import Pair
from specgen.serve.metrics import Metrics
from specgen.serve.scheduler import Scheduler

PROMPTS = [
    [257, 84, 82, 68, 81, 198, 71, 127, 102, 258, 198, 257, 64],
    [257, 84, 82],
    [71, 127, 102, 258, 198, 64],
    [198, 71, 127, 102],
]


class Arriving:
    """A feed whose second request arrives while the first one prefills."""

    def __init__(self, prompts):
        config = GenerationConfig(method=Method.CHAIN, max_new_tokens=12, draft_tokens=3)
        self.waiting = deque(Request(p, i, config) for i, p in enumerate(prompts))
        self.takes = 0

    def take(self, room: int) -> list:
        self.takes += 1
        return [self.waiting.popleft()] if room and self.waiting else []

    def dropped(self) -> set[int]:
        return set()


def test_requests_that_arrive_during_a_prefill_join_before_the_round(tiny_pair):
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=12, draft_tokens=3)
    engine = engine_with(tiny_pair, config)
    events = list(engine.drive(Arriving(PROMPTS[:3]), batch_size=4))
    tokens = Counter()  # a row's first token comes from its prefill, the second from a round
    for i, r in enumerate(events):
        tokens[r.index] += isinstance(r.event, RoundResult)
        if tokens[r.index] == 2:
            break
    assert (
        len({r.index for r in events[:i] if isinstance(r.event, Joined)}) == 3
    )  # all joined before the round
    finished = {r.index: r.state.ids for r in events if isinstance(r.event, Finished)}
    plain = GenerationConfig(method=Method.PLAIN, max_new_tokens=12)
    assert [finished[i] for i in range(3)] == batch_ids(engine_with(tiny_pair, plain), PROMPTS[:3], plain, 1)


def test_the_server_caps_a_draft_model_s_rows_unless_the_request_set_its_length(tiny_pair):
    """One engine serves every method: its width caps hold the rows that draft with the draft
    model (trees and chains), never a lookup or plain row, nor one whose request set its own
    draft length (its floor is off: k is what it asked for). The caps count a chain's tokens: a
    tree keeps to them where they say plain rounds, and drafts its whole tree elsewhere (its
    own floor cuts it)."""
    scheduler = Scheduler(Pair(*tiny_pair, "off"), 8, 8, Metrics(), caps=WidthCaps({1: 4, 2: 2, 3: 0}))
    policy = scheduler.build(GenerationConfig(method=Method.CHAIN, draft_tokens=4)).policy
    for method in (m for m in Method if m is not Method.EAGLE):  # eagle needs a head (tests/test_eagle.py)
        config = GenerationConfig(method=method, floor=True)
        assert capped(config) == method.needs_draft_model, method
        want = [2, 0, 0] if capped(config) else [MAX_DRAFT] * 3
        if capped(config) and method.is_tree:
            want = [MAX_DRAFT, 0, 0]
        assert [policy.width_cap(w, config) for w in (2, 3, 9)] == want, method
        own = GenerationConfig(method=method, floor=False)  # the request set its draft length
        assert not capped(own) and policy.width_cap(9, own) == MAX_DRAFT, method
    uncapped = Scheduler(Pair(*tiny_pair, "off"), 8, 8, Metrics()).build(GenerationConfig()).policy
    assert uncapped.width_cap(9, GenerationConfig(method=Method.CHAIN, floor=True)) == MAX_DRAFT
