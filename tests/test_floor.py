"""The floor under every row (decoding/floor.py): a row whose drafting does not pay lowers its
draft length down to plain rounds, probes again later, and keeps drafting where it pays; only
the draft length changes, so greedy output stays plain decoding's; a fixed k has no floor."""

from __future__ import annotations

import time

import pytest
import torch
from test_engine import PROMPT, ScriptedDrafter, engine_for, reference_greedy
from tiny import decode

from specgen.config import GenerationConfig, Method, Schedule
from specgen.decoding import floor
from specgen.decoding.drafters.model import ChainDrafter
from specgen.decoding.engine import Engine
from specgen.decoding.events import RoundResult
from specgen.decoding.floor import NO_FLOOR, NONE, Floor, PlainSteps
from specgen.decoding.shapes import fit_tree


def feed(row: Floor, rounds: int, k: int, tokens: int, seconds: float, verify: float, plain: float | None):
    """`rounds` rounds of a row: each asks its limit (the k it may draft) and, drafting, records."""
    seen = []
    for _ in range(rounds):
        allowed = min(k, row.limit())
        seen.append(allowed)
        row.record(allowed, tokens if allowed else 1, seconds if allowed else plain or seconds, verify, plain)
    return seen


def test_a_row_s_first_drafting_round_is_not_counted():
    """The draft reads the prompt in it: a round that slow says nothing of the next ones."""
    row = Floor()
    feed(row, 1, k=4, tokens=1, seconds=5.0, verify=0.1, plain=0.1)
    feed(row, floor.MIN_ROUNDS, k=4, tokens=3.0, seconds=0.14, verify=0.11, plain=0.1)
    assert row.ceiling == NONE and row.rate.count == floor.MIN_ROUNDS


def test_a_row_s_speed_up_is_its_tokens_over_the_plain_steps_its_rounds_took():
    """Five short rounds that lose (1 token in 1.6 plain steps) around a long one that wins (6 tokens
    in 2.4): the rounds' ratios average 0.94, but the row commits 11 tokens in 10.4 plain steps,
    1.06x. The floor measures the latter, each round weighed by its length."""
    row = Floor(skip=False)
    rounds = [(1, 0.16), (1, 0.16), (6, 0.24), (1, 0.16), (1, 0.16), (1, 0.16)]
    for tokens, seconds in rounds * 4:
        row.record(5, tokens, seconds, 0.11, 0.1)
    ratios = [tokens * 0.1 / seconds for tokens, seconds in rounds]
    assert sum(ratios) / len(ratios) < 0.95
    decays = [floor.DECAY**age for age in reversed(range(len(rounds) * 4))]
    committed = sum(d * t for d, (t, _) in zip(decays, rounds * 4))
    steps = sum(d * s / 0.1 for d, (_, s) in zip(decays, rounds * 4))
    assert row.speedup(0.1)[0] == pytest.approx(committed / steps) and row.speedup(0.1)[0] > 1.0
    assert row.ceiling == NONE


def test_a_stalled_round_weighs_as_a_long_round_not_as_many():
    """A row winning at 1.5x (3 tokens in 2 plain steps), then one round that something else
    stalled for 30 plain steps: weighed by its whole time it would outweigh the rounds before
    and read as a clear loss; it weighs k + 1 steps at most, and the row keeps drafting."""
    row = Floor(skip=False)
    for _ in range(12):
        row.record(5, 3, 0.2, 0.12, 0.1)
    row.record(5, 3, 3.0, 0.12, 0.1)
    assert row.ceiling == NONE and row.speedup(0.1)[0] > 1.0


def test_a_row_whose_drafts_lose_halves_to_plain_rounds_then_probes():
    row = Floor(skip=False)
    # 1.2 tokens per round in 0.16 s, against plain steps of 0.1 s: 0.75x plain
    halving = 3 * floor.MIN_ROUNDS  # 4, 2 and 1 tokens, MIN_ROUNDS rounds each
    seen = feed(row, halving + floor.RETRY, k=4, tokens=1.2, seconds=0.16, verify=0.11, plain=0.1)
    assert seen[:halving] == [4] * floor.MIN_ROUNDS + [2] * floor.MIN_ROUNDS + [1] * floor.MIN_ROUNDS
    assert row.ceiling == 0 and seen[halving:] == [0] * floor.RETRY  # plain rounds, no draft
    # after RETRY plain rounds a one-token probe; it loses: the next waits twice as long
    later = feed(
        row, floor.RETRY + floor.MIN_ROUNDS + 2, k=4, tokens=1.0, seconds=0.16, verify=0.11, plain=0.1
    )
    assert later.count(1) >= floor.MIN_ROUNDS and row.ceiling == 0 and row.retry == 2 * floor.RETRY


def test_a_row_whose_drafts_are_never_accepted_goes_to_plain_rounds_after_misses_in_a_row():
    """A clear loss after MISSES drafting rounds in a row with nothing accepted (a weak head on a
    translation: one token a round, a round dearer than a plain step): no shorter draft commits
    more, so the row goes to plain rounds, not to half its draft; its probe is one token as ever.
    Fewer misses (an answer's hard first rounds) halve the ceiling, as a loss with something
    accepted does, and a tree row's likewise."""
    never = Floor(skip=False)
    seen = feed(never, floor.MISSES + 3, k=6, tokens=1, seconds=0.11, verify=0.105, plain=0.1)
    first = [6] * floor.MIN_ROUNDS + [3] * (floor.MISSES - floor.MIN_ROUNDS)
    assert seen == first + [0] * 3 and never.ceiling == 0
    some = Floor(skip=False)
    seen = feed(some, floor.MIN_ROUNDS + 1, k=6, tokens=1.25, seconds=0.16, verify=0.11, plain=0.1)
    assert seen == [6] * floor.MIN_ROUNDS + [3] and some.ceiling == 3
    tree = GenerationConfig(method=Method.RSD_C, branching=(2, 2, 1), max_new_tokens=512)
    row = Floor(skip=False)
    for _ in range(floor.MISSES):
        row.record(sum(fit_tree(tree.tree_levels, row.limit())), 1, 0.3, 0.12, 0.1)
    assert row.ceiling == 0
    probe = [sum(fit_tree(tree.tree_levels, row.limit())) for _ in range(floor.RETRY + 1)]
    assert probe == [0] * floor.RETRY + [1]


def test_a_row_whose_first_rounds_miss_keeps_drafting_where_its_later_rounds_win():
    """chat-02 under lookup-chain: its first four counted rounds accepted nothing (a clear loss),
    then the draft model was right two tokens a round. The loss halves the ceiling instead of
    ending the drafting, and the rounds after it win."""
    row = Floor(skip=False)
    seen = feed(row, floor.MIN_ROUNDS, k=5, tokens=1, seconds=0.15, verify=0.1, plain=0.08)
    assert row.ceiling == 2 and row.misses == floor.MIN_ROUNDS
    seen += feed(row, 3 * floor.MIN_ROUNDS, k=5, tokens=3, seconds=0.16, verify=0.1, plain=0.08)
    assert seen[floor.MIN_ROUNDS :] == [2] * 3 * floor.MIN_ROUNDS and row.misses == 0


def test_a_drafting_row_is_charged_the_time_it_costs_the_rows_that_did_not_draft():
    """2.1 tokens in a round of 0.15 s against plain steps of 0.1 s: 1.4x plain for the row
    alone, but beside 3 rows that drafted nothing (plain requests) each of them commits one
    token where it would have committed 1.5: the batch loses, and the row goes to plain
    rounds; with every row drafting alike, it keeps drafting."""
    shared = Floor(skip=False)
    for _ in range(3 * floor.MIN_ROUNDS):
        shared.record(min(4, shared.limit()), 2.1, 0.15, 0.11, 0.1, idle=3.0)
    assert shared.ceiling < 4
    alone = Floor(skip=False)
    for _ in range(3 * floor.MIN_ROUNDS):
        alone.record(min(4, alone.limit()), 2.1, 0.15, 0.11, 0.1, idle=0.0)
    assert alone.ceiling == NONE


def test_a_row_whose_drafts_win_keeps_drafting_and_a_won_probe_restores_it():
    row = Floor(skip=False)
    seen = feed(row, 40, k=4, tokens=3.0, seconds=0.14, verify=0.11, plain=0.1)
    assert set(seen) == {4} and row.ceiling == NONE
    low = Floor(ceiling=0, skip=False)
    feed(low, floor.RETRY, k=4, tokens=1, seconds=0.1, verify=0.1, plain=0.1)
    # the text turned predictable: the probe wins, the ceiling grows back
    seen = feed(low, 80, k=4, tokens=2.5, seconds=0.13, verify=0.11, plain=0.1)
    assert seen[0] == 1 and seen[-1] == 4 and low.ceiling > 1


def test_without_a_plain_step_measured_the_verify_bounds_the_speed_up():
    """With no plain step measured and no verify priced (a GPU), the verify bounds the speed-up:
    it proves a clear loss, and a win only past VERIFY_BOUND; in between, the row asks for the
    width's plain step (`unsure`)."""
    sure_loss = Floor(skip=False)
    feed(sure_loss, floor.MIN_ROUNDS, k=3, tokens=1.5, seconds=0.3, verify=0.1, plain=None)
    assert sure_loss.ceiling == 1 and not sure_loss.unsure  # 1.5 tokens x 0.1 / 0.3: at most 0.5x
    sure_win = Floor(skip=False)
    feed(sure_win, floor.MIN_ROUNDS, k=3, tokens=4.0, seconds=0.15, verify=0.1, plain=None)
    assert sure_win.ceiling == NONE and sure_win.wins == 1 and not sure_win.unsure  # at least 2.7x
    unsure = Floor(skip=False)
    feed(unsure, floor.MIN_ROUNDS, k=3, tokens=2.0, seconds=0.16, verify=0.1, plain=None)
    assert unsure.unsure and unsure.ceiling == NONE and unsure.wins == 0  # at least 1.25x: no verdict
    measured = Floor(skip=False)
    feed(measured, floor.MIN_ROUNDS, k=3, tokens=2.0, seconds=0.16, verify=0.1, plain=0.1)
    assert not measured.unsure and measured.wins == 1  # 1.25x against the measured plain step
    plain = PlainSteps()
    asked = [plain.explore(1, unsure=True) for _ in range(3 * floor.EXPLORE)]
    assert asked.count(True) == 3  # one plain round in EXPLORE while unmeasured
    plain.record(1, drafted=False, seconds=0.1)
    assert plain.seconds(1) is None  # one plain round: not yet a figure
    for _ in range(floor.PLAIN_ROUNDS - 1):
        plain.record(1, drafted=False, seconds=0.1)
    assert plain.seconds(1) == pytest.approx(0.1) and not plain.explore(1, unsure=True)
    for _ in range(floor.REFRESH + 1):
        plain.record(1, drafted=True, seconds=0.2)
    assert plain.seconds(1) is None  # stale: measured again where a row needs it


def test_a_row_s_rounds_are_valued_at_the_measured_plain_step_once_there_is_one():
    """A tree whose verifies the device prices cheap (1.0 step for a 0.12 s verify, where plain
    rounds take 0.09 s): 1.3 tokens in 0.14 s read 1.11x at the implied step, a loss of 0.84x at
    the measured one. Kept as a rate, the same rounds give the loss as soon as the plain step is
    measured, without waiting MIN_ROUNDS more."""
    row = Floor(skip=False)
    for _ in range(floor.MIN_ROUNDS):
        row.record(min(6, row.limit()), 1.3, 0.14, 0.12, None, verify=1.0)
    assert row.ceiling == NONE and row.unsure  # within noise of a win: asks for plain rounds
    assert row.speedup()[0] == pytest.approx(1.3 * 0.12 / 0.14)
    assert row.speedup(0.09)[0] == pytest.approx(1.3 * 0.09 / 0.14)
    row.record(min(6, row.limit()), 1.3, 0.14, 0.12, 0.09, verify=1.0)
    assert row.ceiling == 3 and not row.unsure


def test_a_row_beside_idle_ones_is_charged_at_whatever_plain_step_is_known():
    """The idle rows' share, valued like the rounds: plain x (tokens + idle) / seconds - idle."""
    row = Floor(skip=False)
    for _ in range(3):
        row.record(4, 2, 0.2, 0.1, None, verify=1.0, idle=1.0)
    assert row.speedup()[0] == pytest.approx((2 * 0.1 - (0.2 - 0.1)) / 0.2)
    assert row.speedup(0.08)[0] == pytest.approx((2 * 0.08 - (0.2 - 0.08)) / 0.2)


def test_a_row_s_narrow_verifies_give_its_plain_step_and_wide_ones_ask_for_plain_rounds():
    """A verify of NARROW proposed tokens or fewer costs about a plain step anywhere: its
    seconds over its price are the plain step, and the row's wider rounds are valued at it,
    with no plain round asked for. Priced wide verifies alone leave the row unsure."""
    row = Floor(skip=False)
    for proposed, verify_seconds, price in [(1, 0.09, 1.0), (6, 0.12, 1.0)] * floor.MIN_ROUNDS:
        row.record(6, 2, 0.16, verify_seconds, None, verify=price, proposed=proposed)
    assert row.narrow.value == pytest.approx(0.09) and row.implied.value == pytest.approx(0.12)
    assert row.speedup()[0] == pytest.approx(2 * 0.09 / 0.16) and not row.unsure
    wide = Floor(skip=False)
    for _ in range(floor.MIN_ROUNDS):
        wide.record(6, 2, 0.16, 0.12, None, verify=1.0, proposed=6)
    assert wide.speedup()[0] == pytest.approx(2 * 0.12 / 0.16) and wide.unsure


def test_a_lone_row_with_wide_verifies_explores_plain_rounds_until_its_width_is_measured(
    tiny_pair, reference
):
    """Where the device's verifies are priced (a CPU), a lone row whose proposals are all wide
    (4 tokens, past NARROW) has the engine run one plain round in EXPLORE until PLAIN_ROUNDS of
    them are measured; then none: the output stays plain decoding's."""
    from specgen.decoding.costs import VerifyCost

    drafter = ScriptedDrafter(reference, len(PROMPT), right=4)
    engine = engine_for(tiny_pair, drafter)
    engine.verify_cost = VerifyCost(0.0, 0.02, 0.08)
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=60, draft_tokens=4, floor=True)
    rounds, _ = decode(engine, PROMPT, config)
    assert [t for r in rounds for t in r.emitted] == reference
    plain = [
        i for i, r in enumerate(rounds) if not r.draft_tokens and 0 < i < len(rounds) - 1
    ]  # 0: the prefill
    assert len(plain) == floor.PLAIN_ROUNDS and engine.plain.seconds(1) is not None
    assert plain[1] - plain[0] == floor.EXPLORE


def test_no_plain_round_is_explored_beside_a_row_whose_draft_length_is_fixed(tiny_pair, monkeypatch):
    """A seeded sampled row keeps its k (its draws depend on it): beside a row whose floor asks
    for plain rounds in every round, the batch explores none, and the seeded row drafts its k
    every round; two such floor rows get their plain rounds."""
    from dataclasses import replace

    from test_mixed import Feed
    from tiny import engine_with

    from specgen.config import SamplingConfig
    from specgen.decoding.costs import VerifyCost

    monkeypatch.setattr(Floor, "unsure", property(lambda self: True, lambda self, value: None), raising=False)
    measured = GenerationConfig(method=Method.CHAIN, max_new_tokens=30, draft_tokens=3, floor=True)
    seeded = replace(measured, sampling=SamplingConfig(temperature=0.8, seed=5))
    drafted = {}
    for configs in ([measured, seeded], [measured, measured]):
        engine = engine_with(tiny_pair, measured)
        engine.verify_cost = VerifyCost(0.0, 0.02, 0.08)
        rounds = {0: [], 1: []}
        for report in engine.drive(Feed(configs, [PROMPT, PROMPT[:7]]), 2):
            if isinstance(report.event, RoundResult):
                rounds[report.index].append(len(report.event.draft_tokens))
        drafted[configs[1] is seeded] = rounds
    assert all(k == 3 for k in drafted[True][1][1:-3])  # the seeded row: its k in every round
    # two floor rows: a plain round explored, both rows at once
    assert any(a == b == 0 for a, b in zip(drafted[False][0][1:-3], drafted[False][1][1:-3]))


def test_a_tree_s_budget_halves_as_a_chain_s_length_does():
    """A losing tree (10 nodes, two tokens a round in three plain steps) is cut to its largest
    shape within half its nodes (5: branching 2,1), then within 2 (a chain of two), then to one
    node, then to plain rounds; its probe is then one node, not a whole tree."""
    config = GenerationConfig(method=Method.RSD_C, branching=(2, 2, 1), max_new_tokens=512)
    row = Floor(skip=False)
    allowed = []
    for _ in range(4):
        for _ in range(floor.MIN_ROUNDS):
            k = sum(fit_tree(config.tree_levels, row.limit()))
            allowed.append(k)
            row.record(k, 2, 0.3, 0.12, 0.1)
    assert allowed == [n for n in (10, 4, 2, 1) for _ in range(floor.MIN_ROUNDS)]
    assert row.ceiling == 0
    probe = [sum(fit_tree(config.tree_levels, row.limit())) for _ in range(floor.RETRY + 1)]
    assert probe == [0] * floor.RETRY + [1]


def test_a_tree_row_starts_at_a_chain_s_longest_verify_where_verifies_are_priced():
    """On a CPU (the device's verify cost measured) a tree row's floor starts at BEND nodes, past
    which each node costs `wide`; it grows to the whole tree as it wins, and a drafter that
    changes under it (a widened head) sends it back to where it started, not to the whole tree.
    A chain row, or any row on a GPU (no verify cost), starts with no ceiling."""
    from specgen.decoding.costs import BEND, VerifyCost

    cpu = VerifyCost(0.0, 0.02, 0.08)
    tree = GenerationConfig(method=Method.RSD_S, beam_width=3, depth=4, floor=True)
    assert floor.first_ceiling(tree, cpu) == BEND and floor.first_ceiling(tree, None) == NONE
    assert floor.first_ceiling(GenerationConfig(method=Method.CHAIN, floor=True), cpu) == NONE
    row = Floor.at(floor.first_ceiling(tree, cpu))
    row.skip = False
    nodes = []
    for _ in range(floor.GROW + floor.MIN_ROUNDS):
        k = sum(fit_tree(tree.tree_levels, row.limit()))
        nodes.append(k)
        row.record(k, 3, 0.1, 0.1, 0.1)  # three tokens a plain step's time: a clear win
    assert nodes[0] == 6 and nodes[-1] == tree.tree_budget == 12
    row.renew()  # a widened draft head: a tree that grew keeps its ceiling
    assert row.ceiling == 12
    for _ in range(2 * floor.MIN_ROUNDS):  # 12 nodes, then 6, lose: the ceiling halves twice
        row.record(sum(fit_tree(tree.tree_levels, row.limit())), 1.5, 0.45, 0.1, 0.1)
    assert row.ceiling == 3
    row.renew()  # a lowered one starts again where it started
    assert row.ceiling == BEND and row.rate.count == 0


def test_a_tree_row_drafts_the_largest_tree_its_floor_and_its_remaining_tokens_allow():
    from specgen.decoding.rows import DecodeState

    for config, ceilings in (
        (GenerationConfig(method=Method.RSD_C, branching=(2, 2, 1)), {NONE: 10, 9: 6, 5: 4, 1: 1, 0: 0}),
        (GenerationConfig(method=Method.RSD_S, beam_width=3, depth=4), {NONE: 12, 8: 8, 6: 6, 3: 3, 0: 0}),
    ):
        state = DecodeState(ids=list(range(10)), cache=None, prompt_length=10, config=config, budget=100)
        for ceiling, nodes in ceilings.items():
            state.floor = Floor(ceiling=ceiling)
            assert state.wanted() == state.draft_length() == nodes
        state.floor = Floor()
        state.ids = list(range(107))  # 3 tokens left: a tree two levels deep (RSD-C's 2,1; RSD-S's
        # four nodes are a chain of four, so its largest tree two deep is a chain of two)
        tree = fit_tree(config.tree_levels, state.wanted())
        assert sum(tree) == state.wanted() and tree == ((2, 2) if config.method is Method.RSD_C else (1, 1))
        state.ids = list(range(108))  # 2 tokens left: one level deep, one node (two make a chain)
        assert state.wanted() == 1
        state.ids = list(range(109))  # 1 left: the target's token alone
        assert state.wanted() == 0


def test_a_row_joining_beside_others_starts_where_the_last_of_its_method_left_off():
    """A plain request beside a drafting one: the drafting rows' verdict (plain rounds) is the
    batch's, not the text's, so the next row of that method at that width starts from it; a row
    alone, another method or another width starts afresh, and a row that measured too little
    leaves nothing behind."""
    plain = PlainSteps()
    done = Floor(skip=False)
    feed(done, 3 * floor.MIN_ROUNDS + 1, k=4, tokens=1.2, seconds=0.16, verify=0.11, plain=0.1)
    assert done.ceiling == 0
    plain.keep(done, Method.LOOKUP_CHAIN, 4)
    short = Floor()
    feed(short, 2, k=4, tokens=3.0, seconds=0.14, verify=0.11, plain=0.1)
    plain.keep(short, Method.LOOKUP_CHAIN, 4)  # two rounds: no verdict, the last one stays
    joining = Floor()
    plain.start(joining, Method.LOOKUP_CHAIN, 4)
    assert joining.ceiling == 0 and joining.retry == done.retry
    assert feed(joining, floor.RETRY, k=4, tokens=1, seconds=0.1, verify=0.1, plain=0.1) == [0] * floor.RETRY
    assert feed(joining, 1, k=4, tokens=1, seconds=0.1, verify=0.1, plain=0.1) == [1]  # then it probes
    for method, width in ((Method.LOOKUP_CHAIN, 1), (Method.CHAIN, 4), (Method.LOOKUP_CHAIN, 3)):
        other = Floor()
        plain.start(other, method, width)
        assert other.ceiling == NONE, (method, width)
    continuing = Floor()
    feed(continuing, 1, k=4, tokens=3.0, seconds=0.14, verify=0.11, plain=0.1)
    plain.start(continuing, Method.LOOKUP_CHAIN, 4)  # a chat turn's row keeps its own
    assert continuing.ceiling == NONE


class SlowWrong(ScriptedDrafter):
    """Always wrong, and dear: each proposal takes `delay` seconds (a draft far slower than the
    target: drafting can only lose)."""

    def __init__(self, *args, delay: float = 0.02, **kwargs):
        super().__init__(*args, **kwargs)
        self.delay, self.calls = delay, 0

    def propose(self, context, k, sampling):
        self.calls += 1
        time.sleep(self.delay)
        return super().propose(context, k, sampling)


@pytest.fixture(scope="module")
def reference(tiny_pair):
    return reference_greedy(tiny_pair[0].model, PROMPT, 60)


def test_a_row_drafting_at_a_loss_stops_drafting_and_its_output_is_plain(tiny_pair, reference):
    drafter = SlowWrong(reference, len(PROMPT), right=0)
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=60, draft_tokens=4, floor=True)
    rounds, _ = decode(engine_for(tiny_pair, drafter), PROMPT, config)
    assert [t for r in rounds for t in r.emitted] == reference
    drafted = [bool(r.draft_tokens) for r in rounds]
    assert drafted[1:5] == [True] * 4 and not any(drafted[-10:])  # 4 rounds measured, then plain
    assert drafter.calls < len(rounds) // 2


def test_a_fixed_draft_length_has_no_floor(tiny_pair, reference):
    drafter = SlowWrong(reference, len(PROMPT), right=0, delay=0.002)
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=30, draft_tokens=4, floor=False)
    rounds, _ = decode(engine_for(tiny_pair, drafter), PROMPT, config)
    assert all(len(r.draft_tokens) == 4 for r in rounds[1:-5])


def test_a_row_whose_drafts_pay_keeps_drafting(tiny_pair, reference):
    drafter = ScriptedDrafter(reference, len(PROMPT), right=4)
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=60, draft_tokens=4, floor=True)
    rounds, _ = decode(engine_for(tiny_pair, drafter), PROMPT, config)
    assert [t for r in rounds for t in r.emitted] == reference
    assert sum(bool(r.draft_tokens) for r in rounds) >= len(rounds) - 4


@pytest.mark.parametrize("method", [Method.LOOKUP, Method.RSD_C, Method.LOOKUP_CHAIN])
def test_every_method_under_the_floor_equals_plain(tiny_pair, method):
    from tiny import engine_with

    target = tiny_pair[0]
    want = reference_greedy(target.model, PROMPT, 40)
    config = GenerationConfig(method=method, max_new_tokens=40, draft_tokens=3, floor=True)
    rounds, _ = decode(engine_with(tiny_pair, config), PROMPT, config)
    assert [t for r in rounds for t in r.emitted] == want


def test_the_command_line_floor_is_on_for_the_device_s_k_and_off_for_a_fixed_one():
    from specgen.cli.options import generation_config

    assert generation_config(draft_tokens="device").floor is False  # set once the device's k is known
    assert generation_config(draft_tokens="auto").floor is True
    assert generation_config(draft_tokens="3").floor is False
    assert generation_config(draft_tokens="3", draft_schedule="additive").floor is True
    assert GenerationConfig(schedule=Schedule.FIXED).floor is False


def test_resolving_the_device_s_k_turns_the_floor_on(tiny_pair):
    from specgen.decoding.build import resolve_draft_length
    from specgen.runtime.pair import Pair

    config = GenerationConfig(method=Method.LOOKUP, device_draft_tokens=True)
    resolved, _ = resolve_draft_length(Pair(tiny_pair[0], None, "off"), config)
    assert resolved.floor and not resolved.device_draft_tokens
    assert torch.get_num_threads() >= 1


def test_a_seeded_sampled_row_keeps_its_draft_length_so_its_seed_replays(tiny_pair, reference):
    """Its draws depend on its draft lengths: under the floor they would depend on timing."""
    from specgen.config import SamplingConfig

    drafter = SlowWrong(reference, len(PROMPT), right=0, delay=0.005)
    sampling = SamplingConfig(temperature=0.8, seed=5)
    config = GenerationConfig(
        method=Method.CHAIN, max_new_tokens=24, draft_tokens=3, floor=True, sampling=sampling
    )
    rounds, _ = decode(engine_for(tiny_pair, drafter), PROMPT, config)
    assert all(r.draft_tokens for r in rounds[1:-3])


def test_a_round_s_verify_is_priced_with_its_first_proposed_token_apart():
    """Where the device's verify costs were measured, a round's plain step is its verify's
    seconds over what that verify costs: with the first proposed token priced on its own (a
    2-row verify at 1.08 steps), not at the slope of the later ones (0.03), which would make the
    plain step dearer and a one-token row's speed-up read high."""
    from types import SimpleNamespace

    from specgen.decoding.costs import VerifyCost

    plain, cost = PlainSteps(), VerifyCost(first=0.08, slope=0.03)
    row = SimpleNamespace(floor=Floor(skip=False))
    proposal, result = SimpleNamespace(size=1, is_chain=True), SimpleNamespace(emitted=[7])
    for _ in range(3):  # one token proposed, rejected: the round's one token in 0.15 s, its verify 0.108 s
        plain.measure([row], [1], [proposal], [result], 0.15, 0.108, cost)
    assert row.floor.speedup()[0] == pytest.approx(0.1 / 0.15)  # the plain step: 0.108 / 1.08
    assert cost.steps(0) == 1.0 and cost.steps(5) == pytest.approx(1.2)


def test_a_drafter_that_widens_renews_its_rows_floors(tiny_pair, monkeypatch):
    """When the drafter comes to propose ids it could not (a pruned head packing a script's ids:
    Drafter.widened), every row's floor measures afresh, once per change; the output stays
    plain decoding's."""
    target, draft = tiny_pair
    renewed = []
    monkeypatch.setattr(Floor, "renew", lambda self: renewed.append(id(self)))

    class Widening(ChainDrafter):
        calls = 0

        def widened(self):
            self.calls += 1
            # widens at its 2nd and 4th round: before the rows' first verdict (the tiny draft
            # accepts nothing, so that verdict is plain rounds, and no more rounds ask it)
            return int(self.calls >= 2) + int(self.calls >= 4)

    drafter = Widening(draft.model, draft.device)
    engine = Engine(target.model, target.device, frozenset(), target.context_length, drafter)
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=24, draft_tokens=3, floor=True)
    outs = {0: [], 1: []}
    for report in engine.generate([PROMPT, PROMPT[:5]], config, 2):
        if isinstance(report.event, RoundResult):
            outs[report.index].extend(report.event.emitted)
    assert outs[0] == reference_greedy(target.model, PROMPT, 24)
    assert outs[1] == reference_greedy(target.model, PROMPT[:5], 24)
    assert len(renewed) == 4 and len(set(renewed)) == 2  # two changes, each renewing both rows


def test_renew_starts_a_lowered_floor_afresh():
    floor = Floor()
    floor.skip = False
    for _ in range(8):
        floor.record(4, 1, 1.0, 0.5, 0.4)  # each round commits 1 token in 2.5 plain steps: a loss
    assert floor.ceiling < NONE
    floor.renew()
    assert floor.ceiling == NONE and floor.skip and floor.rate.count == 0 and not floor.probing
    NO_FLOOR.renew()  # a fixed draft length has nothing to renew


def test_renew_keeps_what_a_floor_at_its_start_measured():
    """A head that widens a block at a time (a German answer's rare words) renews the floors
    every few rounds: a floor still where it started keeps its rounds, so that it can reach a
    verdict at all."""
    row = Floor()
    row.skip = False
    seen = []
    for _ in range(floor.MIN_ROUNDS):
        seen.append(row.limit())
        row.record(4, 1.5, 1.0, 0.5, 0.4)  # a clear loss, some of the draft accepted
        if row.ceiling == NONE:
            row.renew()  # a widening after every round
    assert seen == [NONE] * floor.MIN_ROUNDS and row.ceiling == 2
