"""Dynamic batching: rows of different lengths share forwards, join and leave; in
deterministic mode a prompt's tokens do not depend on the batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from test_deterministic import ShapeSensitive, bf16_pair, generate  # noqa: F401 (fixture)
from test_engine import PROMPT, reference_greedy

from specgen.config import GenerationConfig, Method, SamplingConfig
from specgen.decoding.acceptance import ProposalKind
from specgen.decoding.build import make_drafter
from specgen.decoding.drafters.base import Proposal
from specgen.decoding.engine import Engine
from specgen.decoding.events import Finished, RoundResult
from specgen.runtime.pair import Pair

PROMPTS = [
    PROMPT,
    PROMPT[:4],
    PROMPT * 2,
    [257, 84],
    PROMPT[3:],
    PROMPT[::-1],
    [300 % 259],
    PROMPT[:9],
    PROMPT[2:7],
]


@dataclass
class Row:
    index: int
    token_ids: list[int] = field(default_factory=list)
    stop: str | None = None
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0


def row_drafters(pair, drafter, settings):
    """(drafter, method) for a name: None (plain), a method's name, or a Drafter instance."""
    if drafter is None:
        return None, Method.PLAIN
    if isinstance(drafter, str):
        method = Method(drafter)
        config = GenerationConfig(method=method, **{k: v for k, v in settings.items() if k != "method"})
        return make_drafter(Pair(*pair), config), method
    return drafter, Method.CHAIN


def batched(pair, prompts, batch_size, drafter=None, stop_ids=None, **settings):
    """Run the engine over a batch; `drafter` is None (plain), a method name, or RowDrafters."""
    target, _ = pair
    drafts, method = row_drafters(pair, drafter, settings)
    stop_ids = target.stop_ids if stop_ids is None else stop_ids
    engine = Engine(target.model, target.device, stop_ids, target.context_length, drafts)
    settings.setdefault("method", method)
    config = GenerationConfig(**settings)
    rows: dict[int, Row] = {}
    for report in engine.generate(prompts, config, batch_size):
        row = rows.setdefault(report.index, Row(report.index))
        if isinstance(report.event, Finished):
            row.token_ids = report.state.final_ids()
            row.stop = report.state.stop
        elif isinstance(report.event, RoundResult):
            row.rounds += 1
            row.drafted += len(report.event.draft_tokens)
            row.accepted += report.event.accepted_emitted
    results = list(rows.values())
    assert sorted(r.index for r in results) == list(range(len(prompts)))
    return [r.token_ids for r in sorted(results, key=lambda r: r.index)], results


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_batched_greedy_equals_each_prompt_alone(tiny_pair, batch_size):
    """fp32: batching changes nothing, including rows joining and leaving."""
    outputs, results = batched(tiny_pair, PROMPTS, batch_size, max_new_tokens=12)
    for prompt, out in zip(PROMPTS, outputs):
        assert out == reference_greedy(tiny_pair[0].model, prompt, 12)


def test_rows_leave_at_their_own_stop(tiny_pair):
    target, _ = tiny_pair
    first = reference_greedy(target.model, PROMPTS[0], 12)
    stop = frozenset({first[4]})
    _, found = batched(tiny_pair, PROMPTS[:4], 3, stop_ids=stop, max_new_tokens=12)
    results = {r.index: r for r in found}
    assert results[0].token_ids == first[:5] and results[0].stop == "eos"
    for i in (1, 2, 3):
        expected = reference_greedy(target.model, PROMPTS[i], 12, stop)
        assert results[i].token_ids == expected


@pytest.mark.statistical
def test_batched_sampling_is_reproducible(tiny_pair):
    sampling = SamplingConfig(temperature=0.9, seed=4)
    a, _ = batched(tiny_pair, PROMPTS[:5], 3, max_new_tokens=10, sampling=sampling)
    b, _ = batched(tiny_pair, PROMPTS[:5], 3, max_new_tokens=10, sampling=sampling)
    assert a == b


class RowSensitive(ShapeSensitive):
    """Logits that depend on the forward's rows and tokens, like real bf16 kernels."""

    def forward(self, input_ids, **kwargs):
        out = self.inner(input_ids=input_ids, **kwargs)
        seed = input_ids.shape[0] * 1000 + input_ids.shape[1]
        noise = torch.randn(out.logits.shape[-1], generator=torch.Generator().manual_seed(seed))
        out.logits = out.logits + self.scale * noise.to(out.logits.dtype)
        return out


@pytest.fixture(scope="module")
def row_sensitive(bf16_pair):  # noqa: F811
    from dataclasses import replace

    target, draft = bf16_pair
    return replace(target, model=RowSensitive(target.model.inner)), draft


@pytest.mark.slow  # over 10 s: the default run stays under 15 minutes
@pytest.mark.parametrize(
    "sampling", [SamplingConfig(), SamplingConfig(temperature=0.8, seed=9)], ids=["greedy", "sampling"]
)
def test_deterministic_tokens_do_not_depend_on_batch_neighbours_or_method(row_sensitive, sampling):
    prompts = PROMPTS[:8]
    settings = dict(max_new_tokens=24, sampling=sampling, deterministic=True, verify_window=8)
    by_batch = {size: batched(row_sensitive, prompts, size, **settings)[0] for size in (1, 3, 8)}
    assert by_batch[1] == by_batch[3] == by_batch[8]
    other = batched(row_sensitive, [PROMPTS[8], prompts[2], PROMPTS[0][::-1]], 3, **settings)[0]
    assert other[1] == by_batch[1][2]  # the same prompt among other neighbours
    for method in (dict(method=Method.CHAIN, draft_tokens=3), dict(method=Method.RSD_C, branching=(2, 1))):
        single, _ = generate(row_sensitive, prompts[0], **settings, **method)
        assert single == by_batch[8][0]
    for drafter, k in (("chain", 2), ("chain", 5), ("lookup", 3)):
        for size in (3, 8):
            assert (
                batched(row_sensitive, prompts, size, drafter=drafter, draft_tokens=k, **settings)[0]
                == by_batch[1]
            )


def test_without_deterministic_mode_batching_changes_outputs(row_sensitive):
    """The power check for the test above."""
    outputs = {
        tuple(map(tuple, batched(row_sensitive, PROMPTS[:8], size, max_new_tokens=24)[0]))
        for size in (1, 3, 8)
    }
    assert len(outputs) > 1


# -- batched speculative decoding ------------------------------------------------------------------


class ScriptedBatchDrafter:
    """Row r proposes the reference continuation for its first `right` tokens, then wrong ones."""

    def __init__(self, references: dict[tuple, list[int]], right_of):
        self.references, self.right_of = references, right_of
        self.rows: list[tuple] = []
        self.joined = 0
        self.kept: list[tuple[int, int]] = []

    def join(self, row, prompt_ids, generator, capacity, config):
        if row == len(self.rows):
            self.rows.append(None)
        self.rows[row] = (tuple(prompt_ids), self.joined)
        self.joined += 1

    def leave(self, keep):
        self.rows = [self.rows[i] for i in keep]

    def finished(self, row, ids):
        pass

    def propose(self, contexts, ks, samplings, features=None):
        out = []
        for row, (context, k) in enumerate(zip(contexts, ks)):
            prompt, serial = self.rows[row]
            reference, start = self.references[prompt], len(context) - len(prompt)
            right = self.right_of(serial, start)
            tokens = []
            for i in range(k):
                true = reference[start + i] if start + i < len(reference) else 0
                tokens.append(true if i < right else (true + 1) % 259)
            out.append(
                Proposal.chain(torch.tensor(tokens), ProposalKind.DETERMINISTIC) if k else Proposal.empty()
            )
        return out

    def observe(self, row, path):
        self.kept.append((row, len(path)))

    def rewind(self, row, valid):
        pass

    def setup_seconds(self):
        return 0.0

    def taps(self):
        return ()

    def declines(self, row):
        return False

    def widened(self):
        return 0


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_batched_chain_with_scripted_acceptance_equals_plain(tiny_pair, batch_size):
    """Rows accept different numbers of drafts each round (0..k): every row stays exact."""
    references = {tuple(p): reference_greedy(tiny_pair[0].model, p, 14) for p in PROMPTS}
    drafter = ScriptedBatchDrafter(references, lambda serial, start: (serial + start) % 5)
    outputs, results = batched(
        tiny_pair, PROMPTS, batch_size, drafter=drafter, max_new_tokens=14, draft_tokens=4
    )
    for prompt, out in zip(PROMPTS, outputs):
        assert out == references[tuple(prompt)]
    assert sum(r.accepted for r in results) > 0 and any(r.accepted < r.drafted for r in results)


@pytest.mark.parametrize("method", ["chain", "lookup"])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_batched_speculative_greedy_equals_each_prompt_alone(tiny_pair, method, batch_size):
    outputs, results = batched(
        tiny_pair, PROMPTS, batch_size, drafter=method, max_new_tokens=12, draft_tokens=3
    )
    for prompt, out in zip(PROMPTS, outputs):
        assert out == reference_greedy(tiny_pair[0].model, prompt, 12)
    assert sum(r.drafted for r in results) > 0


def test_batched_chain_draft_caches_stay_exact(tiny_pair):
    """The target as its own draft: every draft is accepted, which holds only if each row's
    draft cache is exactly its committed sequence after every round (full and partial)."""
    target, _ = tiny_pair
    pair = (target, target)
    outputs, results = batched(pair, PROMPTS, 3, drafter="chain", max_new_tokens=13, draft_tokens=4)
    for r in results:
        assert r.accepted == r.drafted > 0
    for prompt, out in zip(PROMPTS, outputs):
        assert out == reference_greedy(target.model, prompt, 13)


def test_batched_chain_stops_each_row_at_its_own_eos(tiny_pair):
    target, _ = tiny_pair
    first = reference_greedy(target.model, PROMPTS[0], 12)
    stop = frozenset({first[4]})
    _, results = batched(
        tiny_pair, PROMPTS[:4], 3, drafter="chain", stop_ids=stop, max_new_tokens=12, draft_tokens=4
    )
    by_index = {r.index: r for r in results}
    assert by_index[0].token_ids == first[:5] and by_index[0].stop == "eos"
    for i in (1, 2, 3):
        assert by_index[i].token_ids == reference_greedy(target.model, PROMPTS[i], 12, stop)


@pytest.mark.statistical
def test_batched_chain_sampling_is_reproducible(tiny_pair):
    sampling = SamplingConfig(temperature=0.9, seed=4)
    a, _ = batched(tiny_pair, PROMPTS[:5], 3, drafter="chain", max_new_tokens=10, sampling=sampling)
    b, _ = batched(tiny_pair, PROMPTS[:5], 3, drafter="chain", max_new_tokens=10, sampling=sampling)
    assert a == b


# -- batched trees ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method, settings",
    [
        ("rsd-c", dict(branching=(2, 2, 1))),
        ("rsd-s", dict(beam_width=2, depth=3)),
        ("multi-draft", dict(branching=(2, 2))),
    ],
    ids=["rsd-c", "rsd-s", "multi-draft"],
)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_batched_trees_greedy_equal_each_prompt_alone(tiny_pair, method, settings, batch_size):
    """Rows of different trees (RSD-S frontiers differ per row) verified in one padded forward."""
    outputs, results = batched(tiny_pair, PROMPTS, batch_size, drafter=method, max_new_tokens=12, **settings)
    for prompt, out in zip(PROMPTS, outputs):
        assert out == reference_greedy(tiny_pair[0].model, prompt, 12)
    assert sum(r.drafted for r in results) > 0


def test_batched_trees_keep_each_draft_cache_exact(tiny_pair):
    """The target as its own draft, rsd-c: each row's first child is always the target's choice."""
    target, _ = tiny_pair
    outputs, results = batched(
        (target, target), PROMPTS[:5], 3, drafter="rsd-c", branching=(2, 1), max_new_tokens=13
    )
    for prompt, out in zip(PROMPTS[:5], outputs):
        assert out == reference_greedy(target.model, prompt, 13)
    assert all(r.accepted >= 2 * (r.rounds - 1) for r in results)  # every tree round accepts its whole path


def test_batched_trees_in_deterministic_mode_match_plain(row_sensitive):
    prompts = PROMPTS[:6]
    settings = dict(max_new_tokens=20, deterministic=True, verify_window=8)
    reference = batched(row_sensitive, prompts, 1, **settings)[0]
    assert batched(row_sensitive, prompts, 3, drafter="rsd-c", branching=(2, 2), **settings)[0] == reference
    assert (
        batched(row_sensitive, prompts, 4, drafter="rsd-s", beam_width=2, depth=2, **settings)[0] == reference
    )


def test_cache_rows_join_without_copying_and_leave_in_place(tiny_pair):
    """A joining row takes a spare row of the buffers (no copy of the others); a leaving row's
    successors move down over it, their committed slots intact; any other order gathers."""
    from specgen.runtime import kvcache

    target, _ = tiny_pair
    cache = kvcache.new_cache(target.model, rows=1)
    prompts = [PROMPT, PROMPT[:9], PROMPT[2:], PROMPT[:5]]
    expected = []
    for i, prompt in enumerate(prompts):
        row = 0 if i == 0 else cache.add_row()
        kvcache.forward(target.model, cache, torch.tensor([prompt]), rows=slice(row, row + 1) if i else None)
        expected.append(
            [
                (layer.keys[row, :, : len(prompt)].clone(), layer.values[row, :, : len(prompt)].clone())
                for layer in cache.layers
            ]
        )
    buffer = cache.layers[0]._keys.data_ptr()
    assert cache.layers[0]._keys.shape[0] == 4 and cache.layers[0].keys.shape[0] == 4

    def held(rows):
        for row, source in enumerate(rows):
            n = len(prompts[source])
            assert cache.lengths[row] == n
            for layer, (k, v) in zip(cache.layers, expected[source]):
                assert torch.equal(layer.keys[row, :, :n], k) and torch.equal(layer.values[row, :, :n], v)

    cache.select([0, 2, 3])  # row 1 leaves: 2 and 3 move down, in place
    assert cache.layers[0]._keys.data_ptr() == buffer and cache.layers[0].keys.shape[0] == 3
    held([0, 2, 3])
    cache.add_row()  # the spare row: no new buffer
    assert cache.layers[0]._keys.data_ptr() == buffer and cache.lengths[-1] == 0
    cache.select([2, 0])  # out of order: gathered
    assert cache.layers[0].keys.shape[0] == 2
    held([3, 0])
