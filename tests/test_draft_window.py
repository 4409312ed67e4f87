"""What a draft model reads of a prompt (drafters/model.py): at most a window of a long prompt
(WINDOW), its last tokens numbered from 0; and nothing, for a row whose read costs more than
its drafts can save. Proposals change, the output never does."""

from __future__ import annotations

import torch
from rich.console import Console
from test_engine import engine_for, reference_greedy, run

from specgen.cli.render import summary_table
from specgen.config import GenerationConfig, Method, SamplingConfig
from specgen.decoding.drafters.base import PerRow, ReadRule
from specgen.decoding.drafters.lookup_chain import LookupChain, Source
from specgen.decoding.drafters.mixed import Mixed
from specgen.decoding.drafters.model import WINDOW, ChainDrafter
from specgen.decoding.drafters.tree import GAIN_TREE, RSDConstant
from specgen.decoding.events import Joined, RoundResult
from specgen.decoding.stats import Stats, from_dict
from specgen.decoding.views import DECLINED, Outcome, summary_line
from specgen.runtime.prefixes import PrefixStore

LONG = [257, *range(70, 110), 198, 84, 82, 68, 81, 198, 71, 127, 102, 258, 198, 257, 64]  # 55 tokens
GREEDY = SamplingConfig(temperature=0.0)


def test_a_windowed_draft_gives_plain_decodings_output(tiny_pair):
    target, draft = tiny_pair
    reference = reference_greedy(target.model, LONG, 30)
    drafter = ChainDrafter(draft.model, draft.device, window=8)
    out, rounds = run(
        engine_for(tiny_pair, drafter), LONG, method=Method.CHAIN, max_new_tokens=30, draft_tokens=4
    )
    assert out == reference
    assert sum(len(r.draft_tokens) for r in rounds) > 0
    # the draft read the prompt's last 8 tokens and what followed, not the prompt
    assert drafter._start[0] == len(LONG) - 8
    assert drafter.cache.lengths[0] <= 8 + len(out)


def test_the_window_proposes_what_a_draft_given_only_those_tokens_proposes(tiny_pair):
    """Rotary positions: the last 8 tokens numbered from 0 draft as that text alone does."""
    _, draft = tiny_pair
    windowed = ChainDrafter(draft.model, draft.device, window=8)
    alone = ChainDrafter(draft.model, draft.device, window=0)
    windowed.join(0, LONG, None, 128)
    alone.join(0, LONG[-8:], None, 128)
    a = windowed.propose([LONG], [5], [GREEDY])[0]
    b = alone.propose([LONG[-8:]], [5], [GREEDY])[0]
    assert torch.equal(a.tokens, b.tokens)


def test_short_prompts_and_prompts_a_prefix_store_keeps_are_read_whole(tiny_pair):
    _, draft = tiny_pair
    assert ChainDrafter(draft.model, torch.device("cpu")).window == WINDOW
    short = ChainDrafter(draft.model, draft.device, window=64)
    short.join(0, LONG, None, 128)
    short.propose([LONG], [3], [GREEDY])
    assert short._start[0] == 0 and short.cache.lengths[0] >= len(LONG) - 4
    # a store that keeps prefixes (a server's): read whole, stored, and copied by the next row
    store = PrefixStore(budget=1 << 24)
    first = ChainDrafter(draft.model, draft.device, prefixes=store, window=8)
    first.join(0, LONG, None, 128)
    first.propose([LONG], [3], [GREEDY])
    assert first._start[0] == 0 and first.cache.lengths[0] >= len(LONG) - 4
    first.finished(0, LONG)
    again = ChainDrafter(draft.model, draft.device, prefixes=store, window=8)
    again.join(0, LONG + [5, 6], None, 128)
    assert again._start[0] == 0 and again.cache.lengths[0] >= len(LONG) - 4


def test_a_windowed_row_rewinds_within_its_stretch(tiny_pair):
    _, draft = tiny_pair
    drafter = ChainDrafter(draft.model, draft.device, window=8)
    drafter.join(0, LONG, None, 128)
    drafter.propose([LONG], [3], [GREEDY])
    start = drafter._start[0]
    drafter.rewind(0, start + 3)
    assert drafter.cache.lengths[0] == 3
    drafter.rewind(0, start - 5)  # before the window: nothing of it stands
    assert drafter.cache.lengths[0] == 0
    # it reads from its start again, and proposes as it did
    again = drafter.propose([LONG], [3], [GREEDY])[0]
    fresh = ChainDrafter(draft.model, draft.device, window=8)
    fresh.join(0, LONG, None, 128)
    assert torch.equal(again.tokens, fresh.propose([LONG], [3], [GREEDY])[0].tokens)


# LONG's 55 tokens at 0.05 target steps a token cost 2.75 steps to read; drafting saves GAIN
# (0.2) a token: 12 new tokens (2.4) cannot pay for the read, 20 (4.0) can
PRICE = 0.05


def test_a_row_whose_read_costs_more_than_it_can_save_reads_and_drafts_nothing(tiny_pair):
    target, draft = tiny_pair
    drafter = ChainDrafter(draft.model, draft.device, window=0, read_price=PRICE)
    settings = {"method": Method.CHAIN, "draft_tokens": 4, "floor": True}
    out, rounds = run(engine_for(tiny_pair, drafter), LONG, max_new_tokens=12, **settings)
    assert out == reference_greedy(target.model, LONG, 12)
    assert all(len(r.draft_tokens) == 0 for r in rounds)
    assert drafter.cache.lengths[0] == 0  # the draft never read the prompt
    # with room to pay the read back, the same prompt is read and drafted from
    drafter = ChainDrafter(draft.model, draft.device, window=0, read_price=PRICE)
    out, rounds = run(engine_for(tiny_pair, drafter), LONG, max_new_tokens=20, **settings)
    assert out == reference_greedy(target.model, LONG, 20)
    assert sum(len(r.draft_tokens) for r in rounds) > 0


def test_where_a_prefix_store_keeps_prompts_every_row_reads(tiny_pair):
    """A server's store: the first request's read serves the next that share its prompt, so a
    row reads even where its own answer could not pay for it."""
    target, draft = tiny_pair
    store = PrefixStore(budget=1 << 24)
    drafter = ChainDrafter(draft.model, draft.device, prefixes=store, read_price=PRICE)
    settings = {"method": Method.CHAIN, "draft_tokens": 4, "floor": True}
    out, rounds = run(engine_for(tiny_pair, drafter), LONG, max_new_tokens=12, **settings)
    assert out == reference_greedy(target.model, LONG, 12)
    assert sum(len(r.draft_tokens) for r in rounds) > 0


def test_a_fixed_draft_length_drafts_whatever_the_read_costs(tiny_pair):
    """--draft-tokens N (no floor) means N: the read rule is the floor's."""
    target, draft = tiny_pair
    drafter = ChainDrafter(draft.model, draft.device, window=0, read_price=10.0)
    out, rounds = run(
        engine_for(tiny_pair, drafter), LONG, method=Method.CHAIN, max_new_tokens=12, draft_tokens=4
    )
    assert out == reference_greedy(target.model, LONG, 12)
    assert sum(len(r.draft_tokens) for r in rounds) > 0


def _long_beside_short(tiny_pair, drafter, method: Method, draft_tokens: int):
    """LONG and a 6-token prompt in one batch under the floor, 12 tokens each: each row's draft
    tokens and statistics, once both outputs are checked against plain decoding's."""
    target, _ = tiny_pair
    short = LONG[-6:]
    config = GenerationConfig(method=method, max_new_tokens=12, draft_tokens=draft_tokens, floor=True)
    drafted, outs = {0: 0, 1: 0}, {0: [], 1: []}
    stats = {0: Stats(method.value), 1: Stats(method.value)}
    for report in engine_for(tiny_pair, drafter).generate([LONG, short], config, 2):
        stats[report.index].add(report.event, report.elapsed)
        if isinstance(report.event, RoundResult):
            outs[report.index].extend(report.event.emitted)
            drafted[report.index] += len(report.event.draft_tokens)
    assert outs[0] == reference_greedy(target.model, LONG, 12)
    assert outs[1] == reference_greedy(target.model, short, 12)
    return drafted, stats


def test_a_dear_row_beside_a_cheap_one_in_a_batch(tiny_pair):
    """The rule is per row: a short prompt reads and drafts, a long one beside it does not, and
    both give plain decoding's output. Each row's statistics say which was declined, and why."""
    _, draft = tiny_pair
    drafter = ChainDrafter(draft.model, draft.device, window=0, read_price=PRICE)
    drafted, stats = _long_beside_short(tiny_pair, drafter, Method.CHAIN, 4)
    assert drafted[0] == 0 and drafted[1] > 0
    assert (stats[0].declined, stats[1].declined) == (1, 0)
    assert DECLINED in summary_line(Outcome("", [], stats[0]))
    assert DECLINED not in summary_line(Outcome("", [], stats[1]))
    assert stats[0].as_dict()["draft_declined"] == 1 and stats[1].as_dict()["draft_declined"] == 0
    assert from_dict(stats[0].as_dict()).declined == 1  # a served run's client reads it back
    assert stats[0].merge(stats[1]).declined == 1  # chat's and bench's totals count generations


def test_the_summary_table_says_why_the_draft_read_nothing():
    console = Console(width=120, record=True)
    console.print(summary_table(Stats("chain", declined=1)))
    assert DECLINED.split(":")[0] in " ".join(console.export_text().split())
    console = Console(width=120, record=True)
    console.print(summary_table(Stats("chain")))
    assert DECLINED.split(":")[0] not in " ".join(console.export_text().split())


def test_lookup_chain_keeps_its_lookup_rounds_where_the_model_read_is_dear(tiny_pair):
    target, draft = tiny_pair
    prompt = LONG[:20] * 3  # text that repeats: lookup finds its continuations
    chain = ChainDrafter(draft.model, draft.device, window=0, read_price=10.0)
    drafter = LookupChain(chain, min_match=1)
    settings = {"method": Method.LOOKUP_CHAIN, "draft_tokens": 4, "floor": True}
    out, rounds = run(engine_for(tiny_pair, drafter), prompt, max_new_tokens=16, **settings)
    assert out == reference_greedy(target.model, prompt, 16)
    assert chain.cache.lengths[0] == 0 and drafter.extended == 0  # no model proposal to extend
    assert drafter.rounds[Source.LOOKUP] > 0 and sum(len(r.draft_tokens) for r in rounds) > 0


def test_a_mixed_batch_says_which_rows_its_drafters_declined(tiny_pair):
    """The engine asks its drafter which rows it declined; a batch of every method (Mixed) asks
    each row's own drafter, in that drafter's numbering."""
    target, draft = tiny_pair
    mixed = Mixed(lambda config: ChainDrafter(draft.model, draft.device, window=0, read_price=PRICE))
    engine = engine_for(tiny_pair, mixed)
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=12, draft_tokens=4, floor=True)
    declined = {}
    for report in engine.generate([LONG[-6:], LONG], config, 2):
        if isinstance(report.event, Joined):
            declined[report.index] = report.event.declined
    assert declined == {0: False, 1: True}


def _tree_rows(draft, price: float) -> PerRow:
    """RSD-C rows (trees of 2 nodes, then 4 below them) under a read rule at a tree's gain."""
    return PerRow(lambda: RSDConstant(draft.model, draft.device, (2, 4)), read=ReadRule(price, GAIN_TREE))


def test_a_tree_row_whose_read_costs_more_than_it_can_save_reads_and_drafts_nothing(tiny_pair):
    """Trees keep the chains' rule at their own gain (GAIN_TREE): 55 tokens at 0.05 (2.75 steps)
    cannot be paid back by 12 new tokens (1.2), can by 40 (4.0). A declined row does plain
    decoding's work, says so in its statistics, and its output is plain decoding's."""
    target, draft = tiny_pair
    settings = {"method": Method.RSD_C, "draft_tokens": 6, "floor": True}
    drafter = _tree_rows(draft, PRICE)
    engine = engine_for(tiny_pair, drafter)
    config = GenerationConfig(max_new_tokens=12, **settings)
    stats, out, drafted = Stats("rsd-c"), [], 0
    for report in engine.generate([LONG], config):
        stats.add(report.event, report.elapsed)
        if isinstance(report.event, RoundResult):
            out.extend(report.event.emitted)
            drafted += len(report.event.draft_tokens)
    assert out == reference_greedy(target.model, LONG, 12)
    assert drafted == 0 and stats.declined == 1
    assert drafter.rows[0].held() == 0  # the draft never read the prompt
    drafter = _tree_rows(draft, PRICE)
    out, rounds = run(engine_for(tiny_pair, drafter), LONG, max_new_tokens=40, **settings)
    assert out == reference_greedy(target.model, LONG, 40)
    assert sum(len(r.draft_tokens) for r in rounds) > 0


def test_a_tree_row_with_a_fixed_draft_length_reads_whatever_it_costs(tiny_pair):
    """--draft-tokens N (no floor): the tree row drafts, however dear its read."""
    target, draft = tiny_pair
    out, rounds = run(
        engine_for(tiny_pair, _tree_rows(draft, 10.0)),
        LONG,
        method=Method.RSD_C,
        max_new_tokens=12,
        draft_tokens=6,
    )
    assert out == reference_greedy(target.model, LONG, 12)
    assert sum(len(r.draft_tokens) for r in rounds) > 0


def test_a_dear_tree_row_beside_a_cheap_one_in_a_batch(tiny_pair):
    """Per row, as for chains: the long prompt's tree row drafts nothing, the short one's drafts,
    and a row that leaves takes its verdict with it."""
    _, draft = tiny_pair
    drafter = _tree_rows(draft, PRICE)
    drafted, stats = _long_beside_short(tiny_pair, drafter, Method.RSD_C, 6)
    assert drafted[0] == 0 and drafted[1] > 0
    assert (stats[0].declined, stats[1].declined) == (1, 0)
    drafter.leave([1])
    assert drafter.dear == [False] and not drafter.declines(0)
