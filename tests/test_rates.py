"""Drafting only where measured rounds say it pays (decoding/rates.py), and requests that arrive
while others prefill joining before the round; greedy outputs stay those of plain decoding."""

from __future__ import annotations

from collections import Counter, deque

from tiny import batch_ids, engine_with

from specgen.config import GenerationConfig, Method, SamplingConfig
from specgen.decoding.engine import MAX_DRAFT
from specgen.decoding.events import Finished, Joined, RoundResult
from specgen.decoding.feed import Request
from specgen.decoding.rates import Choice, Pick, WidthRates
from specgen.decoding.rows import RESUME_TOKENS
from specgen.runtime.pair import Pair
from specgen.serve.metrics import Metrics
from specgen.serve.scheduler import Scheduler

PROMPTS = [
    [257, 84, 82, 68, 81, 198, 71, 127, 102, 258, 198, 257, 64],
    [257, 84, 82],
    [71, 127, 102, 258, 198, 64],
    [198, 71, 127, 102],
]


def rounds(
    rates: WidthRates,
    width: int,
    n: int,
    draft,
    plain: tuple[int, float],
    cap: int = 3,
    ks: list[int] | None = None,
) -> list[Choice]:
    """`n` rounds at `width` with made-up (tokens, seconds) per kind; `draft` is one pair for
    every draft length or a dict by draft length. The choices made (and their ks in `ks`)."""
    out = []
    for _ in range(n):
        pick = rates.choose(width, cap)
        out.append(pick.kind)
        if ks is not None:
            ks.append(pick.k)
        drafts = pick.kind is Choice.DRAFT
        tokens, seconds = (draft[pick.k] if isinstance(draft, dict) else draft) if drafts else plain
        rates.record(width, pick.k if drafts else 0, tokens, seconds)
    return out


def test_plain_rounds_are_explored_then_the_faster_kind_wins():
    rates = WidthRates(min_rounds=3, explore=4, refresh=10, retry=20)
    # drafting pays (8 tokens in 0.3 s against 2 in 0.1 s): a plain round in 4 until measured, then
    # one in `refresh`
    ks = []
    seen = rounds(rates, 2, 40, draft=(8, 0.3), plain=(2, 0.1), ks=ks)
    assert seen[:12] == [Choice.DRAFT] * 3 + [Choice.EXPLORE] + [Choice.DRAFT] * 3 + [Choice.EXPLORE] + [
        Choice.DRAFT
    ] * 3 + [Choice.EXPLORE]
    assert seen[12:].count(Choice.EXPLORE) == 2 and Choice.PLAIN not in seen
    assert {k for k, c in zip(ks, seen) if c is Choice.DRAFT} == {3}  # the cap's k, which won
    # at another width drafting does not pay at any k (5 tokens in 0.3 s): k = 3, then 1, measured
    # in turn, then plain rounds, retried (one token) after `retry`
    ks = []
    seen = rounds(rates, 3, 60, draft=(5, 0.3), plain=(3, 0.1), ks=ks)
    assert ks[:15] == [3, 3, 3, 0] * 3 + [1, 1, 1] and seen[15] is Choice.PLAIN
    assert seen[15:].count(Choice.DRAFT) == 2 and {
        ks[i] for i in range(15, 60) if seen[i] is Choice.DRAFT
    } == {1}
    arm, drafting, plain = rates.summary()[3]
    assert arm == 0 and set(drafting) == {1, 3} and max(drafting.values()) < plain
    # a tie (within the margin) goes to plain rounds
    seen = rounds(
        WidthRates(min_rounds=3, explore=4, refresh=10, retry=20), 4, 20, draft=(8, 0.2), plain=(4, 0.1)
    )
    assert seen[15:] == [Choice.PLAIN] * 5


def test_a_shorter_draft_is_measured_when_the_cap_loses():
    """The cap's k loses to plain rounds, half of it wins: the width drafts that (the cost model's
    k at width 2 on a 2-core CPU was 3 where 1 paid)."""
    rates = WidthRates(min_rounds=3, explore=4, refresh=10, retry=20)
    ks = []
    seen = rounds(rates, 2, 40, draft={3: (5, 0.3), 1: (4, 0.15)}, plain=(2, 0.1), ks=ks)
    assert ks[:15] == [3, 3, 3, 0] * 3 + [1, 1, 1]
    assert Choice.PLAIN not in seen and {k for k, c in zip(ks[15:], seen[15:]) if c is Choice.DRAFT} == {1}
    assert rates.summary()[2][0] == 1
    # a wider width starts from there: at most one token, measured against plain rounds
    assert rounds(rates, 4, 4, draft={1: (6, 0.2)}, plain=(4, 0.12), ks=(ks := [])) == [Choice.DRAFT] * 3 + [
        Choice.EXPLORE
    ] and ks[:3] == [1, 1, 1]


def test_a_wider_batch_than_one_where_drafting_lost_starts_plain():
    """Drafting that lost at a width loses at wider ones (the same acceptance, a costlier verify):
    no exploring there, only the retry; a narrower width where drafting won still explores."""
    rates = WidthRates(min_rounds=3, explore=4, refresh=10, retry=20)
    rounds(rates, 2, 30, draft=(5, 0.3), plain=(2, 0.1))  # drafting loses at width 2
    seen = rounds(rates, 4, 45, draft=(9, 0.5), plain=(4, 0.12))
    assert (
        seen[:19] == [Choice.PLAIN] * 19 and seen[19] is Choice.DRAFT and seen[20:39] == [Choice.PLAIN] * 19
    )
    assert 3 not in rates.summary()  # never seen, nothing explored
    rates = WidthRates(min_rounds=3, explore=4, refresh=10, retry=20)
    rounds(rates, 2, 30, draft=(8, 0.3), plain=(2, 0.1))  # drafting wins at width 2
    assert rounds(rates, 4, 4, draft=(9, 0.5), plain=(4, 0.12)) == [Choice.DRAFT] * 3 + [Choice.EXPLORE]


def test_a_width_measured_plain_first_measures_drafting_too():
    rates = WidthRates(min_rounds=2)
    for _ in range(3):  # rows held to plain rounds (k = 0) while drafting was allowed
        rates.record(4, 0, 4, 0.1)
    assert rates.choose(4, 3) == Pick(Choice.DRAFT, 3)


DRAFT, EXPLORE, PLAIN = Pick(Choice.DRAFT, 3), Pick(Choice.EXPLORE), Pick(Choice.PLAIN)


class Scripted(WidthRates):
    """Choices from a script, cycled: exactness must not depend on what was measured."""

    def __init__(self, script: list[Pick]):
        super().__init__()
        self.script, self.i = script, 0
        self.made: list[Choice] = []

    def choose(self, width: int, cap: int) -> Pick:
        pick = self.script[self.i % len(self.script)]
        self.i += 1
        self.made.append(pick.kind)
        return pick


def test_greedy_outputs_equal_plain_whatever_the_rates_choose(tiny_pair):
    prompts = PROMPTS * 2
    plain = GenerationConfig(method=Method.PLAIN, max_new_tokens=40)
    expected = batch_ids(engine_with(tiny_pair, plain), prompts, plain, 3)
    for method in (Method.CHAIN, Method.LOOKUP_CHAIN, Method.LOOKUP, Method.RSD_S):
        config = GenerationConfig(method=method, max_new_tokens=40, draft_tokens=3)
        rates = Scripted([DRAFT, EXPLORE, Pick(Choice.DRAFT, 1), PLAIN, PLAIN, Pick(Choice.DRAFT, 2), DRAFT])
        engine = engine_with(tiny_pair, config, rates=rates)
        assert batch_ids(engine, prompts, config, 3) == expected, method
        assert {Choice.DRAFT, Choice.EXPLORE, Choice.PLAIN} <= set(rates.made)


def first_token_then_rounds(engine, config) -> list[int]:
    """Tokens drafted per round of one long prompt, after its first token (from the prefill)."""
    results = [r.event for r in engine.generate([PROMPTS[0]], config) if isinstance(r.event, RoundResult)]
    assert len(PROMPTS[0]) > engine.policy.prompt_catch_up and not results[0].draft_tokens
    return [len(r.draft_tokens) for r in results[1:]]


def test_an_explored_plain_round_holds_no_row_back(tiny_pair):
    """After an EXPLORE round the rows draft again at once (a PLAIN round holds them back)."""
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=40, draft_tokens=3)
    engine = engine_with(tiny_pair, config, rates=Scripted([DRAFT, EXPLORE]))
    drafted = first_token_then_rounds(engine, config)
    assert drafted[1] == 0 and drafted[2] > 0 and drafted[3] == 0
    engine = engine_with(tiny_pair, config, rates=Scripted([DRAFT, PLAIN, DRAFT]))
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=RESUME_TOKENS - 2, draft_tokens=3)
    drafted = first_token_then_rounds(engine, config)
    assert drafted[1] == 0 and drafted[2] == 0  # held back until RESUME_TOKENS are left


class Arriving:
    """A feed whose second request arrives while the first one prefills."""

    def __init__(self, prompts):
        self.waiting = deque(Request(p, i, SamplingConfig(), 12) for i, p in enumerate(prompts))
        self.takes = 0

    def take(self, room: int) -> list:
        self.takes += 1
        return [self.waiting.popleft()] if room and self.waiting else []

    def dropped(self) -> set[int]:
        return set()


def test_requests_that_arrive_during_a_prefill_join_before_the_round(tiny_pair):
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=12, draft_tokens=3)
    engine = engine_with(tiny_pair, config)
    events = list(engine.drive(Arriving(PROMPTS[:3]), config, batch_size=4))
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


def test_the_server_lets_measured_rounds_decide_for_every_speculative_method(tiny_pair):
    """Every speculative method drafts only where its rounds pay (prompt lookup too: at a wide
    batch its padded verify can cost more than it gives); a draft model's k also follows the
    width caps; a request that set its own draft length keeps it."""
    scheduler = Scheduler(Pair(*tiny_pair, "off"), 8, 8, Metrics(), caps={1: 4, 2: 2, 3: 0})
    for method in (m for m in Method if m is not Method.EAGLE):  # eagle needs a head (tests/test_eagle.py)
        engine = scheduler.build(GenerationConfig(method=method, draft_tokens=4))
        policy = engine.policy
        assert (policy.rates is not None) == (method is not Method.PLAIN), method
        capped = method.needs_draft_model
        assert [policy.width_cap(w) for w in (2, 3, 9)] == ([2, 0, 0] if capped else [MAX_DRAFT] * 3), method
        own = scheduler.build(GenerationConfig(method=method, draft_tokens=4), capped=False).policy
        assert own.rates is None and own.width_cap(9) == MAX_DRAFT
