"""One batch for every method (decoding/drafters/mixed.py): rows of different drafting share one
batch and one target forward per round, and each row gives what it gives alone: plain decoding's
tokens under greedy decoding (plain + chain, lookup + a tree, a head + plain, a deterministic row
beside a normal one, every method at once), the target's law under sampling (a chi-square test
with a negative control)."""

from __future__ import annotations

import dataclasses
from collections import deque

import pytest
import torch
from test_statistical import (
    CONTROL_GENERATIONS,
    ENGINE_PROMPT,
    ENGINE_SAMPLING,
    SMALL_ALPHA,
    assert_pairs_follow,
    gof_pvalue,
    rule_without_residual,
)
from tiny import save_tiny

from specgen.config import GenerationConfig, Method
from specgen.decoding.build import build_engine, mixed
from specgen.decoding.drafters.mixed import Mixed
from specgen.decoding.engine import Engine
from specgen.decoding.events import Finished, RoundResult
from specgen.decoding.feed import Request
from specgen.decoding.policy import Policy
from specgen.runtime.pair import Pair

PROMPTS = [
    [257, 84, 82, 68, 81, 198, 71, 127, 102, 258, 198, 257, 64],
    [71, 127, 102, 258, 198, 64, 84, 82, 68, 71, 127, 102, 258],
    [198, 71, 127, 102, 84, 82, 198, 71, 127, 102, 84, 82, 198],
    [40, 41, 42, 43, 40, 41, 42, 43, 40, 41, 42, 43, 40],
    [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112],
]


class Feed:
    """Requests of their own configs, all waiting at the start (or joining `stagger` at a time)."""

    def __init__(self, configs: list[GenerationConfig], prompts: list[list[int]], stagger: int = 0):
        self.waiting = deque(
            Request(list(p), i, c, c.sampling.seed) for i, (c, p) in enumerate(zip(configs, prompts))
        )
        self.stagger = stagger

    def take(self, room: int) -> list[Request]:
        room = min(room, self.stagger) if self.stagger else room
        return [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]

    def dropped(self) -> set[int]:
        return set()


def greedy(method: Method, n: int = 24, **fields) -> GenerationConfig:
    return GenerationConfig(**{"method": method, "max_new_tokens": n, "draft_tokens": 3, **fields})


def run(
    engine, configs, prompts, batch_size=8, stagger=0
) -> tuple[dict[int, list[int]], dict[int, set[int]]]:
    """Each row's final tokens, and each round's batch width as its rows saw it."""
    finals, widths = {}, {}
    live: set[int] = set()
    for report in engine.drive(Feed(configs, prompts, stagger), batch_size):
        if isinstance(report.event, Finished):
            finals[report.index] = report.state.final_ids()
        elif isinstance(report.event, RoundResult):
            live.add(report.index)
            widths.setdefault(report.index, set()).add(report.state.cache.rows)
    return finals, widths


def alone(pair: Pair, config: GenerationConfig, prompt: list[int]) -> list[int]:
    plain = dataclasses.replace(config, method=Method.PLAIN, deterministic=False)
    finals, _ = run(build_engine(pair, plain), [plain], [prompt])
    return finals[0]


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return Pair(*tiny_pair, "off")


MIXES = {
    "plain+chain": [greedy(Method.PLAIN), greedy(Method.CHAIN)],
    "lookup+tree": [greedy(Method.LOOKUP), greedy(Method.RSD_C, branching=(2, 2, 1))],
    "deterministic+normal": [greedy(Method.CHAIN, deterministic=True, verify_window=8), greedy(Method.CHAIN)],
    "every method": [
        greedy(Method.PLAIN),
        greedy(Method.CHAIN, draft_confidence=0.3),
        greedy(Method.LOOKUP),
        greedy(Method.LOOKUP_CHAIN),
        greedy(Method.SUFFIX),
        greedy(Method.RSD_C, branching=(2, 1)),
        greedy(Method.RSD_S, beam_width=2, depth=2),
        greedy(Method.MULTI_DRAFT, branching=(2, 2)),
        greedy(Method.CHAIN, deterministic=True, verify_window=6, draft_tokens=2),
    ],
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_rows_of_every_method_share_a_batch_and_each_gives_plain_decoding_s_tokens(pair, mix):
    configs = MIXES[mix]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(configs))]
    engine = build_engine(pair, configs[0])
    finals, widths = run(engine, configs, prompts, batch_size=len(configs))
    for i, (config, prompt) in enumerate(zip(configs, prompts)):
        assert finals[i] == alone(pair, config, prompt), f"{mix}: row {i} ({config.method.value})"
    assert all(len(configs) in w for w in widths.values())  # one batch: every row saw all of them
    assert isinstance(engine.drafter, Mixed)
    kinds = {key[0] for key in engine.drafter.drafters}
    assert kinds == {c.method for c in configs}


def drafted_by_row(engine, configs, prompts) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Each row's final tokens, and how many tokens it had drafted over its rounds."""
    finals, drafted = {}, {}
    for report in engine.drive(Feed(configs, prompts), len(configs)):
        if isinstance(report.event, Finished):
            finals[report.index] = report.state.final_ids()
        elif isinstance(report.event, RoundResult):
            drafted[report.index] = drafted.get(report.index, 0) + len(report.event.draft_tokens)
    return finals, drafted


def test_rows_that_draft_with_the_model_wait_for_company_where_the_policy_asks(pair):
    """A server's policy may let a round's draft-model rows draft only where enough of them do
    (widths.WidthCosts.least): the model's step holds up every row. A chain row beside a plain
    one then runs plain rounds; two chain rows draft together, but a chain row and a
    lookup-chain row, which take draft steps of their own, do not; a row whose request set its
    own draft length drafts anyway (N is N); and every row still gives plain decoding's tokens."""
    asked = []

    def together(width: int, drafting: int) -> bool:
        asked.append((width, drafting))
        return drafting >= 2

    policy = Policy(together=together)
    floored = greedy(Method.CHAIN, floor=True)
    cases = {
        "alone beside plain": ([greedy(Method.PLAIN), floored], [0, 0]),
        "two together": ([floored, floored], [None, None]),
        # rows drafted otherwise take draft steps of their own: each alone
        "two apart": ([floored, greedy(Method.LOOKUP_CHAIN, floor=True)], [0, 0]),
        "own length": ([greedy(Method.PLAIN), greedy(Method.CHAIN, floor=False)], [0, None]),
    }
    for name, (configs, want) in cases.items():
        asked.clear()
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(configs))]
        finals, drafted = drafted_by_row(build_engine(pair, configs[0], policy=policy), configs, prompts)
        for i, (config, prompt) in enumerate(zip(configs, prompts)):
            assert finals[i] == alone(pair, config, prompt), f"{name}: row {i}"
            if want[i] == 0:
                assert drafted.get(i, 0) == 0, f"{name}: row {i} drafted"
            else:
                assert drafted[i] > 0, f"{name}: row {i} never drafted"
        # asked only about rows that keep to the caps, and only where some wanted to draft
        floored_rows = sum(c.floor and c.method.needs_draft_model for c in configs)
        assert bool(asked) == bool(floored_rows), (name, asked)
        assert all(0 < n <= floored_rows for _, n in asked), (name, asked)
        assert all(width == len(configs) for width, _ in asked), (name, asked)


def test_rows_joining_and_leaving_a_mixed_batch_keep_their_drafters(pair):
    """Rows of other methods join as others finish (two at a time, budgets of every length): each
    row's drafter keeps its own rows, numbered as it expects, whatever leaves around it."""
    methods = [Method.CHAIN, Method.PLAIN, Method.RSD_C, Method.LOOKUP, Method.LOOKUP_CHAIN, Method.CHAIN]
    configs = [greedy(m, n=6 + 5 * i) for i, m in enumerate(methods)] * 2
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(configs))]
    finals, _ = run(build_engine(pair, configs[0]), configs, prompts, batch_size=3, stagger=2)
    for i, (config, prompt) in enumerate(zip(configs, prompts)):
        assert finals[i] == alone(pair, config, prompt), f"row {i} ({config.method.value})"


def test_a_reused_row_changes_its_drafter(pair):
    """A generation's spare row is taken by a row drafted otherwise: it leaves its old drafter."""
    engine = build_engine(pair, greedy(Method.CHAIN))
    for method in (Method.CHAIN, Method.RSD_C, Method.PLAIN, Method.LOOKUP_CHAIN, Method.CHAIN):
        config = greedy(method)
        finals, _ = run(engine, [config], [PROMPTS[0]])
        assert finals[0] == alone(pair, config, PROMPTS[0]), method


def test_tree_rows_of_another_confidence_stop_get_their_own_drafter(pair):
    """The stop on a tree's depth is the drafter's: a tree row that asks for none never drafts
    with the drafter of an earlier row that had one (a server keeps idle drafters by setting)."""
    from specgen.decoding.drafters.mixed import drafting_key

    stopped, whole = greedy(Method.RSD_C, draft_confidence=0.99), greedy(Method.RSD_C)
    assert drafting_key(stopped) != drafting_key(whole)
    engine = build_engine(pair, whole)
    sizes = {}
    for config in (stopped, whole, stopped):
        drafted, final = sizes.setdefault(config.draft_confidence, set()), None
        for report in engine.drive(Feed([config], [PROMPTS[0]]), 8):
            if isinstance(report.event, RoundResult) and report.event.draft_tokens:
                drafted.add(len(report.event.draft_tokens))
            elif isinstance(report.event, Finished):
                final = report.state.final_ids()
        assert final == alone(pair, config, PROMPTS[0])
    # a random tiny draft is never 99% sure: one level of 2 under the stop, the whole tree without
    # (smaller trees only near the end of the budget: one token left to draft is one node)
    assert 2 in sizes[0.99] <= {1, 2} and max(sizes[0.0]) == whole.tree_budget


LAYERS = 6


@pytest.fixture(scope="module")
def head_pair(tmp_path_factory):
    """A 6-layer tiny target with a random EAGLE-3 head, loaded as run loads them."""
    from specgen.models.eagle_format import save_head
    from specgen.models.eagle_head import Eagle3Head, HeadConfig, default_layers
    from specgen.models.load import load_pair

    root = tmp_path_factory.mktemp("mixed-head")
    save_tiny(root / "target", seed=1, layers=LAYERS)
    torch.manual_seed(0)
    head = Eagle3Head(HeadConfig(64, 4, 2, 16, 128, 259, 200, default_layers(LAYERS)))
    for param in head.parameters():
        torch.nn.init.normal_(param, std=0.2)
    save_head(head, root / "head", "original", "tiny", LAYERS)
    target, draft = load_pair(
        str(root / "target"), str(root / "head"), device="cpu", dtype="float32", quiet=True
    )
    return Pair(target, draft, "off")


def test_a_head_s_rows_share_a_batch_with_plain_rows(head_pair):
    configs = [
        greedy(Method.EAGLE),
        greedy(Method.PLAIN),
        greedy(Method.RSD_C, branching=(2, 1)),
        greedy(Method.EAGLE),
    ]
    prompts = PROMPTS[:4]
    finals, widths = run(build_engine(head_pair, configs[0]), configs, prompts)
    for i, (config, prompt) in enumerate(zip(configs, prompts)):
        assert finals[i] == alone(head_pair, config, prompt), f"row {i} ({config.method.value})"
    assert all(4 in w for w in widths.values())


# -- sampling: a mixed batch keeps the target's law -------------------------------------------------

SAMPLED = [Method.CHAIN, Method.PLAIN, Method.RSD_C, Method.LOOKUP]


def mixed_first_two_tokens(pair: Pair, generations: int, seed: int) -> dict[Method, torch.Tensor]:
    """The first two tokens of `generations` rows decoded together, the rows' methods taking
    turns (SAMPLED), each its own seed; by method."""
    configs = [
        GenerationConfig(
            method=SAMPLED[i % len(SAMPLED)],
            max_new_tokens=2,
            draft_tokens=3,
            branching=(2, 1),
            sampling=dataclasses.replace(ENGINE_SAMPLING, seed=seed + i),
        )
        for i in range(generations)
    ]
    target = pair.target  # no stop ids: every generation yields exactly 2 tokens
    engine = Engine(target.model, target.device, frozenset(), target.context_length, mixed(pair), pair.vocab)
    finals, _ = run(engine, configs, [ENGINE_PROMPT] * generations, batch_size=400)
    out: dict[Method, list] = {}
    for i, config in enumerate(configs):
        out.setdefault(config.method, []).append(finals[i])
    return {m: torch.tensor(v) for m, v in out.items()}


@pytest.fixture(scope="module")
def target_law(tiny_pair):
    from tiny import two_token_law

    return two_token_law(tiny_pair[0].model, ENGINE_PROMPT, ENGINE_SAMPLING)


@pytest.mark.statistical
def test_sampled_rows_of_a_mixed_batch_follow_the_target_s_law(pair, target_law):
    """1600 rows, four methods taking turns in one batch: each method's pairs of first tokens ~
    q0(t1) q1(t2 | t1), each test failing by chance with alpha = 1e-3."""
    by_method = mixed_first_two_tokens(pair, 1600, seed=4242)
    assert set(by_method) == set(SAMPLED)
    for tokens in by_method.values():
        assert_pairs_follow(tokens, target_law)


@pytest.mark.statistical
def test_control_a_mixed_batch_without_the_residual_fails(pair, target_law, monkeypatch):
    import specgen.decoding.verify as verify

    monkeypatch.setattr(verify, "speculative_sampling", rule_without_residual)
    by_method = mixed_first_two_tokens(pair, CONTROL_GENERATIONS * 2, seed=9100)
    q0, _ = target_law
    pvalue = gof_pvalue(by_method[Method.CHAIN][:, 0], q0)
    assert pvalue < SMALL_ALPHA, f"the broken batch passed: p-value {pvalue:.3g}"
