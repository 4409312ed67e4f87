"""EAGLE-3 heads: the target's features, heads in both public layouts, method eagle (greedy
identical to plain in every mode, sampled exact with a negative control), the trainer
(resumes after a kill and after Ctrl-C) and the refusals.

The target is a tiny 6-layer Qwen2 (random, seeded); heads are random (seeded) or trained for
a few seconds on the target's own answers."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny import batch_ids, build_model, decode, engine_with, save_tiny, two_token_law
from typer.testing import CliRunner

from specgen.cli import app
from specgen.config import GenerationConfig, Method, SamplingConfig
from specgen.decoding.engine import Engine
from specgen.decoding.events import Finished
from specgen.decoding.policy import Policy
from specgen.models.eagle_format import HeadError, load_head, save_head
from specgen.models.eagle_head import Eagle3Head, HeadConfig, default_layers
from specgen.models.load import Vocabulary, load_draft, load_pair
from specgen.runtime import features, kvcache
from specgen.train import data
from specgen.train.loop import Settings, Trainer

LAYERS = 6
HERE = Path(__file__).resolve().parent


def random_head(seed: int = 0, draft_vocab: int = 200, vocab: int = 259, hidden: int = 64) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(
        HeadConfig(hidden, 4, 2, hidden // 4, 2 * hidden, vocab, draft_vocab, default_layers(LAYERS))
    )
    for param in head.parameters():
        torch.nn.init.normal_(param, std=0.2)
    used = torch.randperm(vocab)[:draft_vocab].sort().values
    with torch.no_grad():
        head.d2t.copy_(used - torch.arange(draft_vocab))
        head.t2d.zero_()
        head.t2d[used] = True
    return head


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    out = {
        "target": save_tiny(root / "target", seed=1, layers=LAYERS),
        "other": save_tiny(root / "other", seed=5, layers=LAYERS, hidden=32),
    }
    head = random_head()
    save_head(head, root / "original", "original", "tiny", LAYERS)
    save_head(head, root / "speculators", "speculators", "tiny", LAYERS)
    sharp = random_head()  # surer laws: top probabilities of 0.2-0.7 (the random head's are under 0.02)
    with torch.no_grad():
        sharp.lm_head.weight.mul_(7.0)
    save_head(sharp, root / "sharp", "original", "tiny", LAYERS)
    # the original layout as EAGLE's own training saves it: pytorch_model.bin, LlamaForCausalLM
    bin_dir = root / "original-bin"
    bin_dir.mkdir()
    config = json.loads((root / "original" / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (bin_dir / "config.json").write_text(json.dumps(config))
    torch.save(head.state_dict(), bin_dir / "pytorch_model.bin")
    out.update(
        original=root / "original",
        speculators=root / "speculators",
        sharp=root / "sharp",
        original_bin=bin_dir,
        root=root,
    )
    return out


@pytest.fixture(scope="module")
def target(dirs):
    return load_pair(str(dirs["target"]), None, device="cpu", dtype="float32", quiet=True)[0]


def head_draft(dirs, target, name):
    return load_draft(str(dirs[name]), target, device="cpu", dtype="float32", quiet=True)


PROMPTS = [list(range(40, 75)), [257, 84, 82, 68, 81, 198, 33, 90], list(range(100, 180))]


def plain_ids(target, prompt, new=40):
    config = GenerationConfig(method=Method.PLAIN, max_new_tokens=new)
    return decode(engine_with((target, None), config), prompt, config)[1].ids


# -- the target's features ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_the_cache_keeps_the_hidden_states_entering_the_tapped_layers(family):
    """Features written by a forward (the lean path for Qwen2, transformers' own forward with
    hooks for Gemma 2) equal transformers' output_hidden_states, per row and position."""
    from families import build as build_family  # tests/families.py: tiny models of each family

    model = build_model(3, layers=LAYERS) if family == "qwen2" else build_family("gemma2", 3)
    count = model.config.num_hidden_layers
    layers = (1, count - 1, count)
    features.install(model)
    from specgen.runtime.lean import call_for

    call = call_for(model)
    cache = kvcache.SlotCache(model.config, rows=2, taps=layers)
    ids = torch.randint(0, 200, (2, 12))
    kvcache.forward(call, cache, ids[:, :7])
    kvcache.forward(call, cache, ids[:, 7:])  # a second forward writes the next slots
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    for row in range(2):
        got = cache.features.read(row, 0, 12).view(12, len(layers), -1)
        for place, layer in enumerate(layers):
            want = hidden[layer][row] if layer < count else None
            if want is None:  # transformers' last entry is after the final norm; ours before it
                continue
            # two forwards (7 then 5 tokens) against one of 12: float32 products of other
            # shapes round differently (seen on an AVX2-only CPU: 4e-5); a wrong layer is off by O(1)
            torch.testing.assert_close(got[:, place], want, atol=2e-4, rtol=1e-3)


def test_features_are_a_buffer_of_their_own_that_follows_every_row_move():
    """The features are a FeatureBuffer (no K/V layer with empty values): they follow a tree
    path's gather, a row joining, rows leaving out of order and a prefix copied to another
    cache, exactly as the K/V of the same slots do."""
    from transformers.cache_utils import CacheLayerMixin

    from specgen.runtime.lean import call_for
    from specgen.runtime.slots import FeatureBuffer

    model = build_model(3, layers=LAYERS)
    features.install(model)
    call = call_for(model)
    cache = kvcache.SlotCache(model.config, rows=2, taps=(1,))
    assert isinstance(cache.features, FeatureBuffer) and not isinstance(cache.features, CacheLayerMixin)
    kvcache.forward(call, cache, torch.randint(0, 200, (2, 10)))
    before = [cache.features.read(row, 0, 10).clone() for row in range(2)]
    keys = [cache.layers[0].keys[row, :, :10].clone() for row in range(2)]
    kvcache.keep_positions(cache, 4, torch.tensor([1, 3]), row=1)  # a tree's path: slots 5 and 7
    torch.testing.assert_close(cache.features.read(1, 4, 6), before[1][[5, 7]])
    torch.testing.assert_close(cache.layers[0].keys[1, :, 4:6], keys[1][:, [5, 7]])
    cache.add_row()
    cache.select([1, 0])  # out of order
    torch.testing.assert_close(cache.features.read(1, 0, 10), before[0])
    torch.testing.assert_close(cache.features.read(0, 0, 4), before[1][:4])
    other = kvcache.SlotCache(model.config, rows=1, taps=(1,))
    kvcache.copy_prefix(cache, 1, other, 0, 10)
    torch.testing.assert_close(other.features.read(0, 0, 10), before[0])


# -- heads in the public layouts ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["original", "speculators", "original_bin"])
def test_heads_in_both_layouts_load_and_decode_exactly(dirs, target, name):
    draft = head_draft(dirs, target, name)
    assert draft.vocabulary is Vocabulary.HEAD and draft.model.config.layers == default_layers(LAYERS)
    reference = random_head()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(draft.model.state_dict()[key].to(value.dtype), value)
    config = GenerationConfig(method=Method.EAGLE, max_new_tokens=40, draft_tokens=4)
    for prompt in PROMPTS:
        events, state = decode(engine_with((target, draft), config), prompt, config)
        assert state.ids == plain_ids(target, prompt)
        assert sum(len(e.draft_tokens) for e in events) > 0


def test_a_speculators_head_keeps_its_layers_and_residual_option(dirs, target, tmp_path):
    config = json.loads((dirs["speculators"] / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    config["eagle_aux_hidden_state_layer_ids"] = [1, 2, 6]
    config["norm_before_residual"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(dirs["speculators"] / "model.safetensors")
    head = load_head(tmp_path, target.model)
    assert head.config.layers == (1, 2, 6) and head.config.norm_before_residual
    original = json.loads((dirs["original"] / "config.json").read_text())
    assert original["architectures"] == ["LlamaForCausalLMEagle3"] and "eagle_config" not in original


# -- method eagle: every path identical to plain ------------------------------------------------------


@pytest.fixture(scope="module")
def trained(dirs, target):
    """A head trained for a few seconds on the target's own answers to 12 prompts."""
    out = dirs["root"] / "trained"
    torch.manual_seed(0)
    prompts = [torch.randint(0, 256, (12,)).tolist() for _ in range(12)]
    engine = Engine(target.model, target.device, frozenset(), target.context_length)
    config = GenerationConfig(method=Method.PLAIN, max_new_tokens=60)
    done = {
        r.index: r.state.ids
        for r in engine.generate(prompts, config, batch_size=6)
        if isinstance(r.event, Finished)
    }
    sequences = [data.Sequence(done[i], 11) for i in range(len(prompts))]
    data.record(target.model, default_layers(LAYERS), sequences, data.Shards(out), target.device)
    trainer = Trainer(
        target.model,
        out,
        Settings(steps=3, draft_vocab=259, lr=2e-3, epochs=60, holdout=1000, layers=default_layers(LAYERS)),
    )
    trainer.run()
    trainer.evaluate()
    trainer.write()
    return {
        "dir": out,
        "prompts": prompts,
        "draft": load_draft(str(out), target, device="cpu", dtype="float32", quiet=True),
    }


def test_a_trained_head_drafts_what_the_target_says(trained, target):
    """Trained on these prompts' answers, the head's drafts are accepted (training and drafting
    read the same features at the same positions), and the output is plain's."""
    config = GenerationConfig(method=Method.EAGLE, max_new_tokens=60, draft_tokens=3)
    accepted = drafted = 0
    for prompt in trained["prompts"][1:5]:
        events, state = decode(engine_with((target, trained["draft"]), config), prompt, config)
        assert state.ids == plain_ids(target, prompt, 60)
        accepted += sum(e.accepted for e in events)
        drafted += sum(len(e.draft_tokens) for e in events)
    assert accepted / drafted > 0.5, (accepted, drafted)
    record = json.loads((trained["dir"] / "training.json").read_text())
    assert len(record["heldout_acceptance_per_position"]) == 3


def test_eagle_batched_deterministic_chat_and_lookup_chain_equal_plain(trained, target):
    draft = trained["draft"]
    prompts = [trained["prompts"][1], PROMPTS[0], PROMPTS[1], trained["prompts"][2]]
    config = GenerationConfig(method=Method.EAGLE, max_new_tokens=30, draft_tokens=3)
    batched = batch_ids(engine_with((target, draft), config), prompts, config, batch_size=3)
    assert batched == [plain_ids(target, p, 30) for p in prompts]
    deterministic = dataclasses.replace(config, deterministic=True, verify_window=8)
    assert decode(engine_with((target, draft), deterministic), prompts[0], deterministic)[1].ids == plain_ids(
        target, prompts[0], 30
    )
    chained = dataclasses.replace(config, method=Method.LOOKUP_CHAIN)
    assert decode(engine_with((target, draft), chained), prompts[2], chained)[1].ids == plain_ids(
        target, prompts[2], 30
    )
    # a chat turn: the second prompt extends the first's sequence; the caches keep the common prefix
    engine = engine_with((target, draft), config)
    _, state = decode(engine, prompts[0], config)
    follow = state.ids + [10, 11, 12]
    _, resumed = decode(engine, follow, config, resume=state)
    assert resumed.ids == plain_ids(target, follow, 30)


def test_trees_from_a_head_equal_plain_alone_batched_in_chat_and_deterministic(trained, target):
    """`--method rsd-c` with a head: RSD-C trees (top children when greedy), through the same
    tree verification as a draft model's."""
    draft = trained["draft"]
    config = GenerationConfig(method=Method.RSD_C, max_new_tokens=30, branching=(3, 2, 1))
    accepted, sizes = 0, set()
    for prompt in trained["prompts"][1:4]:
        events, state = decode(engine_with((target, draft), config), prompt, config)
        assert state.ids == plain_ids(target, prompt, 30)
        accepted += sum(e.accepted for e in events)
        sizes |= {len(e.draft_tokens) for e in events if e.draft_tokens}
    assert accepted > 0 and sizes == {3 + 6 + 6}  # a tree of 3 children, 2 each, 1 each: 15 nodes
    prompts = [trained["prompts"][1], PROMPTS[0], PROMPTS[1], trained["prompts"][2]]
    assert batch_ids(engine_with((target, draft), config), prompts, config, batch_size=3) == [
        plain_ids(target, p, 30) for p in prompts
    ]
    deterministic = dataclasses.replace(config, deterministic=True, verify_window=8)
    assert decode(engine_with((target, draft), deterministic), prompts[0], deterministic)[1].ids == plain_ids(
        target, prompts[0], 30
    )
    engine = engine_with((target, draft), config)  # a chat turn continues the same caches
    _, state = decode(engine, prompts[0], config)
    follow = state.ids + [10, 11, 12]
    assert decode(engine, follow, config, resume=state)[1].ids == plain_ids(target, follow, 30)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_head_s_tree_is_cut_to_its_row_s_budget(trained, target, monkeypatch, temperature):
    """A head's RSD-C row drafts the largest tree of its shape within the budget its floor allows
    (shapes.fit_tree), as a draft model's row does: fewer levels, fewer children per node, one
    node, none. Before, a head drafted its whole tree whatever the floor said, so a head that lost
    drafted 10-node trees to the end (0.58-1.03x plain over 32 prompts, benchmarks/floor.md)."""
    from specgen.config import SamplingConfig
    from specgen.decoding import floor
    from specgen.decoding.shapes import fit_tree

    draft = trained["draft"]
    config = GenerationConfig(
        method=Method.RSD_C,
        max_new_tokens=30,
        branching=(3, 2, 1),
        floor=True,
        sampling=SamplingConfig(temperature=temperature, seed=4),
    )
    from specgen.decoding.drafters.eagle import EagleTreeDrafter

    each = iter([floor.NONE, 1, 5, 0, 2, 9, 3, 0, 10] * 40)
    monkeypatch.setattr(floor.Floor, "limit", lambda self: next(each))
    drafted, tree = [], EagleTreeDrafter._tree

    def traced(self, row, k, *args):
        proposal = tree(self, row, k, *args)
        drafted.append((k, proposal.size, max(proposal.depth)))
        return proposal

    monkeypatch.setattr(EagleTreeDrafter, "_tree", traced)
    events, state = decode(engine_with((target, draft), config), trained["prompts"][1], config)
    if not temperature:
        assert state.ids == plain_ids(target, trained["prompts"][1], 30)
    for k, size, depth in drafted:
        assert (size, depth) == (sum(fit_tree(config.tree_levels, k)), len(fit_tree(config.tree_levels, k)))
    assert {size for _, size, _ in drafted} & {1, 3, 9}  # some trees cut: one node, 3 children, 2 levels


HEAD_STOP = 0.9  # cuts some of the trained head's drafts on these prompts and not others


@pytest.mark.parametrize("method", [Method.EAGLE, Method.RSD_C])
def test_a_head_s_confidence_stop_cuts_its_drafts_and_keeps_plain_s_output(trained, target, method):
    """A head's chain ends after the first token whose reach (the product of the head's top
    probabilities over the round) is under the stop, and its tree grows no deeper once every node
    of its newest level is under it (length.level_stop), as a draft model's: some drafts cut, some
    whole, alone and batched, and the output is plain decoding's."""
    draft = trained["draft"]
    config = GenerationConfig(
        method=method, max_new_tokens=30, draft_tokens=4, branching=(2, 2, 1), draft_confidence=HEAD_STOP
    )
    whole = 4 if method is Method.EAGLE else sum(config.tree_levels)
    prompts = trained["prompts"][1:4] + [PROMPTS[0]]
    sizes = set()
    for prompt in prompts:
        events, state = decode(engine_with((target, draft), config), prompt, config)
        assert state.ids == plain_ids(target, prompt, 30)
        sizes |= {len(e.draft_tokens) for e in events if e.draft_tokens}
    assert whole in sizes and sizes - {whole}, sizes  # the stop cut some drafts and not others
    assert batch_ids(engine_with((target, draft), config), prompts, config, batch_size=3) == [
        plain_ids(target, p, 30) for p in prompts
    ]


def test_a_head_on_the_cpu_gets_the_device_s_k_and_a_stop_priced_by_its_step(
    trained, target, tmp_path, monkeypatch
):
    """`--draft-tokens device` with a head: `choose` times the head's own draft step (probes.HeadProbe)
    beside the target's forwards, once per machine and pair, and prices the head's stop by it
    as a draft model's (costs.stop_for); eagle, the head's trees and lookup-chain over it take
    them, and its verifies are priced by its own entry."""
    from specgen.cli.options import generation_config
    from specgen.decoding import costs, probes
    from specgen.decoding.build import resolve_draft_length
    from specgen.runtime.pair import Pair

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    timed, measured = [], []
    seconds, ratios = probes.HeadProbe.seconds, costs.ratios
    monkeypatch.setattr(probes.HeadProbe, "seconds", lambda self: timed.append(1) or seconds(self))
    monkeypatch.setattr(costs, "ratios", lambda pair: measured.append(ratios(pair)) or measured[-1])
    pair = Pair(target, trained["draft"])
    choice = costs.choose(pair)
    assert timed and len(measured) == 1 and 1 <= choice.k <= costs.MAX_K and "head step" in choice.reason
    assert choice.confidence == costs.stop_for(measured[0][0]) > 0
    assert costs.choose(pair) == choice and len(measured) == 1  # cached
    assert costs.verify_cost(pair) == choice.verify
    for method in ("eagle", "chain", "rsd-c", "lookup-chain"):
        config, chosen = resolve_draft_length(pair, generation_config(method=method, max_new_tokens=16))
        assert chosen == choice and config.draft_confidence == choice.confidence and config.floor
    given = generation_config(method="eagle", max_new_tokens=16, draft_tokens=3)
    assert resolve_draft_length(pair, given)[0].draft_confidence == 0.0  # a given k: no stop


def test_eagle_with_prefix_store_and_chunked_prefill_equals_plain(trained, target):
    """The target's prefix store and staged prefill carry the features too."""
    from specgen.decoding.build import make_drafter
    from specgen.runtime.pair import Pair
    from specgen.runtime.prefixes import PrefixStore

    pair = Pair(target, trained["draft"], "off", PrefixStore(budget=64 << 20), PrefixStore(budget=64 << 20))
    config = GenerationConfig(method=Method.EAGLE, max_new_tokens=20, draft_tokens=3)
    engine = Engine(
        target.model,
        target.device,
        target.stop_ids,
        target.context_length,
        make_drafter(pair, config),
        prefixes=pair.target_prefixes,
        policy=Policy(prefill_chunk=16),
    )
    long_prompt = trained["prompts"][3] + list(range(60, 130))
    prompts = [trained["prompts"][1], long_prompt, long_prompt[:50] + [5, 6, 7]]
    assert batch_ids(engine, prompts, config, batch_size=3) == [plain_ids(target, p, 20) for p in prompts]
    assert (
        pair.target_prefixes.entries
        and pair.target_prefixes.entries[next(iter(pair.target_prefixes.entries))].features is not None
    )


# -- sampled: exact in distribution --------------------------------------------------------------------

SAMPLING = SamplingConfig(temperature=1.0, top_p=0.95)
PROMPT = [257, 84, 82, 68, 81, 198]


def first_two(
    target,
    draft,
    seeds,
    method: Method = Method.EAGLE,
    confidence: float = 0.0,
    sizes: list | None = None,
    new: int = 0,
    branching: tuple[int, ...] = (3, 2),
) -> torch.Tensor:
    """The first two tokens of each seed's generation (of `new` tokens: by default 2, 3 for a
    tree); `confidence`: the head's stop, `sizes` collects the size of each first draft."""
    from specgen.decoding.build import make_drafter
    from specgen.runtime.pair import Pair

    out = []
    for seed in seeds:
        # a tree is drafted only while more tokens remain than its depth: trees decode three
        config = GenerationConfig(
            method=method,
            max_new_tokens=new or (3 if method.is_tree else 2),
            draft_tokens=3,
            branching=branching,
            sampling=dataclasses.replace(SAMPLING, seed=seed),
            draft_confidence=confidence,
        )
        engine = Engine(
            target.model,
            target.device,
            frozenset(),
            target.context_length,
            make_drafter(Pair(target, draft), config),
            policy=Policy(prompt_catch_up=100),
        )  # the first token is speculated too
        events = decode(engine, PROMPT, config)[0]
        if sizes is not None:  # the first round's: the only one drafted with every token still to come
            sizes.append(len(events[0].draft_tokens))
        out.append([t for r in events for t in r.emitted][:2])
    return torch.tensor(out)


@pytest.mark.slow  # over 10 s: the default run stays under 15 minutes
@pytest.mark.statistical
def test_sampled_eagle_follows_the_target_law_and_the_control_fails(dirs, target, monkeypatch):
    """1000 generations of 2 tokens: pairs ~ q0(t1) q1(t2 | t1) (alpha 1e-3); with the
    acceptance rule's residual removed the first token's law fails the same test."""
    from test_statistical import SMALL_ALPHA, gof_pvalue, rule_without_residual

    import specgen.decoding.verify as verify

    draft = head_draft(dirs, target, "original")
    q0, joint = two_token_law(target.model, PROMPT, SAMPLING)
    tokens = first_two(target, draft, range(1000))
    vocab = joint.shape[0]
    assert gof_pvalue(tokens[:, 0], q0) > SMALL_ALPHA
    assert gof_pvalue(tokens[:, 0] * vocab + tokens[:, 1], joint.flatten()) > SMALL_ALPHA
    monkeypatch.setattr(verify, "speculative_sampling", rule_without_residual)
    broken = first_two(target, draft, range(5000, 6000))
    assert gof_pvalue(broken[:, 0], q0) < SMALL_ALPHA


SHARP_HEAD_STOP = 0.2  # cuts the sharp head's first draft of 3 tokens to 2, its 3-level tree to 2 levels


@pytest.mark.slow  # over 10 s: the default run stays under 15 minutes
@pytest.mark.statistical
@pytest.mark.parametrize("method", [Method.EAGLE, Method.RSD_C])
def test_sampled_drafts_under_a_head_s_confidence_stop_follow_the_target_law(dirs, target, method):
    """A head's chains and trees cut by the confidence stop (from the head's laws, never from the
    tokens drawn) keep the target's law: 1000 generations of 2 tokens follow q0(t1) q1(t2 | t1)
    (alpha 1e-3). The stop is the one a draft model's drafts read (length.ChainStops,
    length.level_stop); its law under draws that decide where it cuts, and its negative controls
    (a drawn token dropped for its own low probability), are in test_adaptive.py and
    test_tree_statistical.py. Here, the head's proposals and their laws as the stop cuts them."""
    from test_statistical import SMALL_ALPHA, gof_pvalue

    draft = head_draft(dirs, target, "sharp")
    q0, joint = two_token_law(target.model, PROMPT, SAMPLING)
    sizes: list = []
    tokens = first_two(target, draft, range(1000), method, SHARP_HEAD_STOP, sizes, new=5, branching=(2, 2, 1))
    assert set(sizes) == ({2} if method is Method.EAGLE else {6}), set(sizes)  # cut: 3 tokens, 10 nodes whole
    vocab = joint.shape[0]
    assert gof_pvalue(tokens[:, 0], q0) > SMALL_ALPHA
    assert gof_pvalue(tokens[:, 0] * vocab + tokens[:, 1], joint.flatten()) > SMALL_ALPHA


@pytest.mark.slow  # over 10 s: the default run stays under 15 minutes
@pytest.mark.statistical
def test_sampled_trees_from_a_head_follow_the_target_law_and_the_control_fails(dirs, target, monkeypatch):
    """RSD-C trees from a head (Gumbel-top-k children of its law over the target's vocabulary):
    1000 generations of 2 tokens follow q0(t1) q1(t2 | t1); with the laws the children were
    drawn from lost on their way to the tree rule (zeros: every child the target can emit is
    accepted), the first token's law fails the same test."""
    from test_statistical import SMALL_ALPHA, gof_pvalue

    import specgen.decoding.verify as verify

    def broken_tree_rule(monkeypatch, module):
        original = module.recursive_rejection

        def lost_laws(children, tokens, draft_probs, target_probs, generator, *, replacement):
            return original(
                children,
                tokens,
                torch.zeros_like(draft_probs),
                target_probs,
                generator,
                replacement=replacement,
            )

        monkeypatch.setattr(module, "recursive_rejection", lost_laws)

    draft = head_draft(dirs, target, "original")
    q0, joint = two_token_law(target.model, PROMPT, SAMPLING)
    tokens = first_two(target, draft, range(1000), Method.RSD_C)
    vocab = joint.shape[0]
    assert gof_pvalue(tokens[:, 0], q0) > SMALL_ALPHA
    assert gof_pvalue(tokens[:, 0] * vocab + tokens[:, 1], joint.flatten()) > SMALL_ALPHA
    broken_tree_rule(monkeypatch, verify)
    broken = first_two(target, draft, range(5000, 6000), Method.RSD_C)
    assert gof_pvalue(broken[:, 0], q0) < SMALL_ALPHA


# -- refusals --------------------------------------------------------------------------------------

runner = CliRunner()


def test_a_head_for_another_target_and_a_corrupt_head_are_refused(dirs, tmp_path):
    other = load_pair(str(dirs["other"]), None, device="cpu", dtype="float32", quiet=True)[0]
    with pytest.raises(HeadError, match="hidden size 64"):
        load_head(dirs["original"], other.model)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((dirs["original"] / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes((dirs["original"] / "model.safetensors").read_bytes()[:300])
    result = runner.invoke(
        app,
        [
            "run",
            "hello",
            "--target",
            str(dirs["target"]),
            "--draft",
            str(corrupt),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--no-server",
            "-n",
            "4",
        ],
    )
    assert result.exit_code == 1 and "cannot be read" in result.output and "Traceback" not in result.output
    bad_layers = tmp_path / "bad-layers"
    bad_layers.mkdir()
    config = json.loads((dirs["speculators"] / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [1, 2, 40]
    (bad_layers / "config.json").write_text(json.dumps(config))
    (bad_layers / "model.safetensors").symlink_to(dirs["speculators"] / "model.safetensors")
    with pytest.raises(HeadError, match="layer"):
        load_head(
            bad_layers,
            load_pair(str(dirs["target"]), None, device="cpu", dtype="float32", quiet=True)[0].model,
        )


def test_method_eagle_without_a_head_and_beams_from_a_head_are_one_line(dirs, tiny_dirs):
    result = runner.invoke(
        app,
        [
            "run",
            "hello",
            "--target",
            str(dirs["target"]),
            "--draft",
            str(tiny_dirs["draft"]),
            "--method",
            "eagle",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--no-server",
        ],
    )
    assert (
        result.exit_code == 1
        and "needs an EAGLE-3 head" in result.output
        and "Traceback" not in result.output
    )
    result = runner.invoke(
        app,
        [
            "run",
            "hello",
            "--target",
            str(dirs["target"]),
            "--draft",
            str(dirs["original"]),
            "--method",
            "rsd-s",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--no-server",
        ],
    )
    assert result.exit_code == 1 and "EAGLE-3 head drafts" in result.output
    # RSD-C trees from a head run (test_trees_from_a_head_...): the command line gets them too
    result = runner.invoke(
        app,
        [
            "run",
            "hello",
            "--target",
            str(dirs["target"]),
            "--draft",
            str(dirs["original"]),
            "--method",
            "rsd-c",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--no-server",
            "-n",
            "8",
        ],
    )
    assert result.exit_code == 0, result.output


def test_a_draft_that_cannot_serve_the_method_is_refused_before_the_pair_loads(dirs, tiny_dirs, monkeypatch):
    """`run`, `chat`, `check` and the bench commands say that a model cannot draft eagle, or a
    head multi-draft, from the --draft argument alone, before anything loads (it took the
    default pair's 15-22-second load); the words are the loaded pair's refusal's."""
    from specgen.decoding import build
    from specgen.runtime import pair as pair_module

    model, head = str(tiny_dirs["draft"]), str(dirs["original"])
    assert build.why_not_draft(None, Method.PLAIN) is None
    assert build.why_not_draft(model, Method.LOOKUP) is None
    assert build.why_not_draft(model, Method.RSD_S) is None  # a model of the target's tokenizer or not
    assert build.why_not_draft(head, Method.EAGLE) is None and build.why_not_draft(head, Method.RSD_C) is None
    assert build.why_not_draft(head, Method.CHAIN) is None  # a head's chains are eagle's
    target, draft = load_pair(str(dirs["target"]), model, device="cpu", dtype="float32", quiet=True)
    after = build.why_not(pair_module.Pair(target, draft), Method.EAGLE)  # the same words, but the name
    assert build.why_not_draft(model, Method.EAGLE) == after.replace(f"; {draft.name} is", f"; {model} is")
    assert "needs a draft model" in build.why_not_draft(None, Method.CHAIN)
    assert "EAGLE-3 head drafts" in build.why_not_draft(head, Method.MULTI_DRAFT)

    def never(*args, **kwargs):
        raise AssertionError("the pair was loaded")

    monkeypatch.setattr(pair_module, "load", never)
    common = ["--target", str(dirs["target"]), "--device", "cpu", "--dtype", "float32", "--no-server"]
    for command, draft, method in (
        (["run", "hello"], model, "eagle"),
        (["run", "hello"], head, "multi-draft"),
        (["chat"], model, "eagle"),
    ):
        args = [*command, *common, "--draft", draft, "--method", method]
        result = runner.invoke(app, args, input="hello\n")
        assert result.exit_code == 1, result.output
        assert "needs" in result.output and "Traceback" not in result.output
        assert "was loaded" not in result.output
    result = runner.invoke(app, ["check", *common[:-1], "--draft", model, "--methods", "plain,eagle"])
    assert result.exit_code == 1 and "needs an EAGLE-3 head" in result.output, result.output
    assert "was loaded" not in result.output
    # bench, bench batch and bench serve: a named column, the run's --draft or its own @DRAFT
    from specgen.bench.methods import unsupported_before_load

    assert unsupported_before_load("eagle", model).startswith("eagle needs an EAGLE-3 head as its draft")
    assert unsupported_before_load(f"eagle@{head}", model) is None
    assert "EAGLE-3 head drafts" in unsupported_before_load("multi-draft", head)
    assert unsupported_before_load("chain", head) is None and unsupported_before_load("plain", None) is None
    for command in (
        ["bench"],
        ["bench", "batch", "--batch-sizes", "1,2"],
        ["bench", "serve", "--concurrency", "1,2"],
    ):
        args = [*command, *common[:-1], "--draft", model, "--prompts", "quick", "--methods", "plain,eagle"]
        result = runner.invoke(app, args)
        assert result.exit_code == 1, (command, result.output)
        assert "EAGLE-3 head" in result.output and "Traceback" not in result.output, result.output
        assert "was loaded" not in result.output


def test_run_with_a_head_drafts_with_it_and_matches_plain(dirs):
    """The default method over a head is lookup-chain (the head where lookup finds nothing);
    chain over a head is eagle."""
    common = [
        "--target",
        str(dirs["target"]),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--no-server",
        "-n",
        "16",
        "--format",
        "json",
        "--raw",
    ]
    head = runner.invoke(app, ["run", "def f(x):", "--draft", str(dirs["original"]), *common])
    chain = runner.invoke(app, ["run", "def f(x):", "--draft", str(dirs["original"]), "-m", "chain", *common])
    plain = runner.invoke(app, ["run", "def f(x):", "--method", "plain", *common])
    assert head.exit_code == 0 and chain.exit_code == 0 and plain.exit_code == 0, head.output + chain.output
    got, eagle, want = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (head, chain, plain))
    assert got["text"] == want["text"] and got["method"] == "lookup-chain"
    assert eagle["text"] == want["text"] and eagle["method"] == "eagle"


# -- the trainer ------------------------------------------------------------------------------------

TRAIN_SCRIPT = """
import sys, time, torch
sys.path.insert(0, {tests!r})
from pathlib import Path
from specgen.models.load import load_pair
from specgen.train.loop import Settings, Trainer
target = load_pair({target!r}, None, device="cpu", dtype="float32", quiet=True)[0]
def slow(tokens, loss):
    time.sleep(0.05)
trainer = Trainer(target.model, Path({out!r}), Settings(steps=2, draft_vocab=259, epochs=50, holdout=1000,
                  checkpoint_minutes=0.002, layers={layers!r}), progress=slow)
print("resumed at", trainer.steps_done, flush=True)
trainer.run()
"""


def test_the_trainer_resumes_after_a_kill_and_after_ctrl_c(trained, dirs, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(trained["dir"] / "data", out / "data")  # the recorded features, reused
    script = TRAIN_SCRIPT.format(
        tests=str(HERE), target=str(dirs["target"]), out=str(out), layers=default_layers(LAYERS)
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while (
        not (out / "checkpoint.pt").is_file() or (out / "checkpoint.pt").stat().st_mtime < time.time() - 0.5
    ):
        assert time.monotonic() < deadline and child.poll() is None, "no checkpoint"
        time.sleep(0.1)
    time.sleep(1.0)
    child.send_signal(signal.SIGKILL)
    child.wait()
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    assert saved["report"]["steps_done"] > 0
    # a rerun resumes where the checkpoint left off; Ctrl-C writes a checkpoint first
    target = load_pair(str(dirs["target"]), None, device="cpu", dtype="float32", quiet=True)[0]
    steps = []

    def interrupt(tokens, loss):
        steps.append(tokens)
        if len(steps) == 3:
            raise KeyboardInterrupt

    trainer = Trainer(
        target.model,
        out,
        Settings(steps=2, draft_vocab=259, epochs=50, holdout=1000, layers=default_layers(LAYERS)),
        progress=interrupt,
    )
    resumed = trainer.steps_done
    assert resumed >= saved["report"]["steps_done"]
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    after = torch.load(out / "checkpoint.pt", weights_only=True)
    assert after["report"]["steps_done"] == resumed + 3


def test_train_head_command_writes_a_loadable_head(dirs, tmp_path, target):
    out = tmp_path / "head"
    result = runner.invoke(
        app,
        [
            "train-head",
            "--out",
            str(out),
            "--target",
            str(dirs["target"]),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--tokens",
            "3000",
            "--draft-vocab",
            "100",
            "--quiet",
            "--format",
            "speculators",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "held-out acceptance per draft position" in result.output
    draft = head_draft({"h": out}, target, "h")
    assert draft.model.config.draft_vocab_size == 100
    config = GenerationConfig(method=Method.EAGLE, max_new_tokens=20, draft_tokens=3)
    assert decode(engine_with((target, draft), config), PROMPTS[0], config)[1].ids == plain_ids(
        target, PROMPTS[0], 20
    )
    bad = runner.invoke(
        app,
        [
            "train-head",
            "--out",
            str(out),
            "--target",
            str(dirs["target"]),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--tokens",
            "5000",
            "--quiet",
        ],
    )
    assert bad.exit_code == 1 and "holds data recorded" in bad.output


def test_train_head_answers_the_prompts_of_a_set(dirs, tmp_path, monkeypatch):
    """--prompts SET: each prompt's text, or its conversation, is what the target answers."""
    import json

    import specgen.train.head as head_module

    seen = {}

    def work(settings, out, source, tokens, answer_tokens, train, quiet, texts):
        seen["texts"] = texts
        return {
            "heldout_acceptance_per_position": [0.5],
            "tokens_trained": 1,
            "seconds": 1.0,
            "expected_tokens_per_round": 1.5,
        }

    monkeypatch.setattr(head_module, "train_head", work)
    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "More"},
    ]
    prompts = tmp_path / "set.jsonl"
    prompts.write_text(
        json.dumps({"id": "a", "category": "c", "prompt": "Say hi"})
        + "\n"
        + json.dumps({"id": "b", "category": "c", "messages": chat})
        + "\n"
    )
    result = runner.invoke(
        app,
        [
            "train-head",
            "--out",
            str(tmp_path / "head"),
            "--target",
            str(dirs["target"]),
            "--device",
            "cpu",
            "--prompts",
            str(prompts),
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert seen["texts"] == ["Say hi", chat]


def test_a_rerun_resumes_only_what_it_asks_for(dirs, tmp_path, monkeypatch):
    """A rerun into an earlier run's --out: --minutes trains that much more (it trained nothing
    once the epochs were done); a setting the checkpoint's head does not have, or data from
    another model of the same name, is one line; a run stopped before it recorded anything
    locks nothing."""
    import shutil

    def train(out, *extra, target=dirs["target"]):
        return runner.invoke(
            app,
            [
                "train-head",
                "--out",
                str(out),
                "--target",
                str(target),
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--tokens",
                "3000",
                "--draft-vocab",
                "100",
                "--quiet",
                *extra,
            ],
        )

    out = tmp_path / "head"
    (out / "data").mkdir(parents=True)  # what a Ctrl-C during loading left: a manifest, nothing recorded
    (out / "data" / "manifest.json").write_text(
        json.dumps({"target": "x", "source": "code", "tokens": 9, "layers": [0], "sequences": 0})
    )
    assert train(out).exit_code == 0
    first = json.loads((out / "training.json").read_text())
    from specgen.train import head as trainer

    # a rerun of a whole recording makes no data again (for prompts: the target's answers, decoded)
    monkeypatch.setattr(trainer, "_sequences", lambda *a: pytest.fail("the data was made again"))
    more = train(out, "--minutes", "0.02")
    assert more.exit_code == 0, more.output
    again = json.loads((out / "training.json").read_text())
    assert again["steps"] > first["steps"]
    assert (again["data_tokens"], again["record_seconds"]) == (first["data_tokens"], first["record_seconds"])
    monkeypatch.undo()
    for extra, fragment in (
        (["--draft-vocab", "50"], "with --draft-vocab 100; this run asks for 50"),
        (["--draft-vocab", "100", "--intermediate", "32"], "another --intermediate?"),
        (["--draft-vocab", "100", "--minutes", "1", "--epochs", "2"], "give one of them"),
    ):
        refused = runner.invoke(
            app,
            [
                "train-head",
                "--out",
                str(out),
                "--target",
                str(dirs["target"]),
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--tokens",
                "3000",
                "--quiet",
                *extra,
            ],
        )
        assert refused.exit_code == 1 and fragment in refused.output and "unexpected" not in refused.output, (
            refused.output
        )
    twin = tmp_path / "elsewhere" / "target"  # another model under the same directory name
    shutil.copytree(dirs["target"], twin)
    save_tiny(twin, seed=9, layers=LAYERS)
    other = train(out, target=twin)
    assert other.exit_code == 1 and "another model of that name" in other.output, other.output


def test_self_distillation_answers_a_conversation_with_every_turn_as_context(target):
    """A prompt set's conversation is answered after all its turns (only its last message was
    kept before)."""
    from specgen.decoding.prompts import render_chat

    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "second"},
    ]
    engine = Engine(target.model, target.device, frozenset(), target.context_length)
    conversation, text = data.prompt_sequences(engine, target.tokenizer, [messages, "second"], 4)
    rendered = render_chat(target.tokenizer, messages)
    assert conversation.ids[: len(rendered)] == rendered and conversation.start == len(rendered) - 1
    assert len(text.ids) < len(conversation.ids)


def test_a_head_given_as_the_target_is_one_line(dirs):
    result = runner.invoke(app, ["run", "hi", "--target", str(dirs["original"]), "--no-server", "-n", "2"])
    assert result.exit_code == 1 and "is an EAGLE-3 head, not a model" in result.output, result.output


def test_training_that_cannot_learn_writes_no_head(dirs, tmp_path):
    """Too little data (all of it held out) and a loss that diverges are one line each, with
    no head written; a head of NaN weights is refused at load."""

    def train(out, *extra):
        return runner.invoke(
            app,
            [
                "train-head",
                "--out",
                str(out),
                "--target",
                str(dirs["target"]),
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--draft-vocab",
                "100",
                "--quiet",
                *extra,
            ],
        )

    few = train(tmp_path / "few", "--tokens", "64")
    assert few.exit_code == 1 and "none left to train on" in few.output, few.output
    wild = train(tmp_path / "wild", "--tokens", "3000", "--lr", "1e10")
    assert wild.exit_code == 1 and "no longer finite" in wild.output, wild.output
    assert (
        not (tmp_path / "few" / "model.safetensors").exists()
        and not (tmp_path / "wild" / "model.safetensors").exists()
    )
    import shutil

    from safetensors.torch import load_file, save_file

    from specgen.cli.train_head import _kept

    broken = tmp_path / "nan"
    shutil.copytree(dirs["original"], broken)
    state = load_file(str(broken / "model.safetensors"))
    state["fc.weight"][0, 0] = float("nan")
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(HeadError, match="fc.weight holds NaN"):
        load_head(
            broken, load_pair(str(dirs["target"]), None, device="cpu", dtype="float32", quiet=True)[0].model
        )
    assert "nothing was recorded yet" in _kept(tmp_path / "few-nothing")
    assert "the features recorded so far" in _kept(tmp_path / "few")
    shard = next((tmp_path / "few" / "data").glob("shard-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])  # a copy cut short
    cut = train(tmp_path / "few", "--tokens", "64")
    assert cut.exit_code == 1 and "cannot be read" in cut.output and "unexpected" not in cut.output, (
        cut.output
    )
    (tmp_path / "few" / "data" / "manifest.json").write_text('{"sequences": ')  # a manifest cut short
    cut = train(tmp_path / "few", "--tokens", "64")
    assert cut.exit_code == 1 and "manifest.json cannot be read" in cut.output, cut.output


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--layers", "100"], "--layers: the head reads layer(s) [100]"),
        (["--layers", "0,2"], "--layers 0 is the embeddings' output"),  # the original layout would write -1
        (["--lr", "nan"], "--lr must be a number > 0"),
        (["--minutes", "inf"], "--minutes must be a number >= 0"),
        (["--intermediate", "-1"], "--intermediate must be in 0.."),
        (["--answer-tokens", "0"], "--answer-tokens must be >= 1"),
    ],
)
def test_train_head_refuses_bad_settings_and_leaves_its_directory_usable(dirs, tmp_path, extra, fragment):
    out = tmp_path / "head"
    result = runner.invoke(
        app,
        [
            "train-head",
            "--out",
            str(out),
            "--target",
            str(dirs["target"]),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--quiet",
            *extra,
        ],
    )
    assert result.exit_code == 1 and fragment in result.output and "unexpected" not in result.output, (
        result.output
    )
    assert not (out / "data" / "manifest.json").exists()  # a rerun with good settings is not refused


def test_train_head_names_the_default_layers_a_small_target_lacks(tiny_dirs, tmp_path):
    """vLLM's default layers (2, L/2, L-3) reach below layer 1 for a target of under 4 layers:
    the line says so, rather than naming a --layers that was never given."""
    result = runner.invoke(
        app,
        [
            "train-head",
            "--out",
            str(tmp_path / "head"),
            "--target",
            str(tiny_dirs["target"]),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--quiet",
        ],
    )
    assert result.exit_code == 1 and "need a target of at least 4 layers" in result.output, result.output


def test_train_head_never_writes_into_a_directory_of_other_files(dirs, tmp_path):
    """A model directory (the target's own, or `-o ''`: the current one) would lose its
    config.json and model.safetensors to the head's."""
    before = {p.name: p.read_bytes() for p in dirs["target"].iterdir() if p.is_file()}
    not_utf8 = runner.invoke(
        app, ["train-head", "--out", str(tmp_path) + "/bad\udcff", "--target", str(dirs["target"]), "--quiet"]
    )
    assert not_utf8.exit_code == 1 and "not a UTF-8 path" in not_utf8.output, not_utf8.output
    for out in (dirs["target"], tmp_path / "file"):
        (tmp_path / "file").write_text("x")
        result = runner.invoke(
            app, ["train-head", "--out", str(out), "--target", str(dirs["target"]), "--quiet"]
        )
        assert result.exit_code == 1 and "--out" in result.output, result.output
    assert {p.name: p.read_bytes() for p in dirs["target"].iterdir() if p.is_file()} == before


# -- the server --------------------------------------------------------------------------------------


def test_the_server_drafts_with_a_head_chains_and_trees(trained, dirs):
    """`specgen serve --draft HEAD_DIR`: eagle (and its default, chain) and rsd-c trees through
    the openai client give plain's greedy answer, in one batch of concurrent requests too; a
    beam search (rsd-s) from a head is a 400."""
    openai = pytest.importorskip("openai")
    from concurrent.futures import ThreadPoolExecutor

    from test_server import start, stop

    from specgen.config import ModelSettings
    from specgen.runtime.pair import load

    settings = ModelSettings(
        str(dirs["target"]), str(trained["dir"]), "cpu", None, "float32", "auto", "auto", "auto"
    )
    pair = load(settings, Method.EAGLE, quiet=True)
    running, thread = start(settings, pair, max_batch_size=4, max_queue=16)
    try:
        sdk = openai.OpenAI(
            base_url=running.state.info["url"] + "/v1", api_key=running.token, max_retries=0, timeout=60
        )
        model = running.state.model_id

        def complete(prompt: str, method: str) -> str:
            answer = sdk.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=24,
                temperature=0,
                extra_body={"speculative": {"method": method}},
            )
            return answer.choices[0].text

        prompts = ["def fib(n):", "The cache holds", "import torch\n", "Once upon a time"]
        plain = [complete(p, "plain") for p in prompts]
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda p: complete(p, "eagle"), prompts)) == plain
        assert complete(prompts[0], "chain") == plain[0]
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda p: complete(p, "rsd-c"), prompts)) == plain
        with pytest.raises(openai.BadRequestError, match="EAGLE-3 head drafts"):
            complete(prompts[0], "rsd-s")
    finally:
        stop(running, thread)


def test_specgen_check_covers_a_head(trained, dirs):
    """`specgen check --draft HEAD_DIR`: eagle alone, batched, from the prefix cache, chunked, in a
    chat turn and deterministic, RSD-C trees and lookup-chain over the head, against transformers'
    generate."""
    result = runner.invoke(
        app,
        [
            "check",
            "--target",
            str(dirs["target"]),
            "--draft",
            str(trained["dir"]),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--prompts",
            "2",
            "--max-new-tokens",
            "16",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    labels = [case["case"] for case in report["cases"]]
    assert all(case["identical"] for case in report["cases"]), report
    assert any("eagle" in label for label in labels) and any("chunked" in label for label in labels), labels
    assert any("rsd-c" in label for label in labels), labels  # trees from the head
    chain = runner.invoke(
        app,
        [
            "check",
            "--target",
            str(dirs["target"]),
            "--draft",
            str(trained["dir"]),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--prompts",
            "1",
            "--max-new-tokens",
            "8",
            "--methods",
            "chain",
            "--json",
        ],
    )  # chain with a head is eagle, as `run` reads it
    assert chain.exit_code == 0, chain.output
    assert {case["case"].split()[0].rstrip(",") for case in json.loads(chain.stdout)["cases"]} == {"eagle"}


def test_bench_reports_acceptance_per_draft_position():
    from collections import Counter

    from specgen.bench.summary import per_position

    assert per_position(Counter({"0": 2, "1": 1, "3": 1})) == [0.5, 0.25, 0.25]
    assert per_position(Counter()) is None
    assert per_position(Counter({"0": 5})) == [0.0]  # drafted every round, accepted none: not "no drafts"


def test_an_int8_head_on_the_cpu_drafts_the_same_way(trained, dirs, target):
    """`--draft-quant int8` (the CPU default for a 16-bit run): the head's linears in int8, output
    still plain's, its drafts still accepted."""
    from specgen.config import ModelSettings
    from specgen.runtime.pair import load

    pair = load(
        ModelSettings(
            str(dirs["target"]), str(trained["dir"]), "cpu", None, "float32", "int8", "off", "none"
        ),
        Method.EAGLE,
        quiet=True,
    )
    assert pair.draft.weights == "int8"
    config = GenerationConfig(method=Method.EAGLE, max_new_tokens=40, draft_tokens=3)
    accepted = 0
    for prompt in trained["prompts"][1:4]:
        events, state = decode(engine_with((pair.target, pair.draft), config), prompt, config)
        assert state.ids == plain_ids(target, prompt, 40)
        accepted += sum(e.accepted for e in events)
    assert accepted > 0


@pytest.mark.parametrize("method", ["eagle", "rsd-c"])
def test_eagle_through_the_fixed_shape_steps(trained, target, method):
    """`compile="fixed"`: the target's forwards and the head's (chain steps, a tree's levels, the
    catch-up) at the fixed widths CUDA graphs replay, run eagerly here over whole-capacity views,
    from the features buffers a graph reads; the features still reach the head (its drafts are
    accepted), and the output is plain's, one row and batched."""
    config = GenerationConfig(method=Method(method), max_new_tokens=40, draft_tokens=3, branching=(2, 2, 1))
    accepted = 0
    for prompt in trained["prompts"][1:3]:
        engine = engine_with((target, trained["draft"]), config, compile="fixed")
        assert engine.drafter.from_target.mode == engine.drafter.from_head.mode == "fixed"  # the head's too
        events, state = decode(engine, prompt, config)
        assert state.ids == plain_ids(target, prompt, 40)
        accepted += sum(e.accepted for e in events)
    assert accepted > 0
    prompts = [trained["prompts"][1], PROMPTS[0], PROMPTS[1]]
    assert batch_ids(
        engine_with((target, trained["draft"]), config, compile="fixed"), prompts, config, 2
    ) == [plain_ids(target, p, 40) for p in prompts]


def test_bench_columns_with_a_head_follow_the_engine(trained, target):
    """bench asks the engine's own refusal (build.why_not) of a head: chains and rsd-c run,
    a beam search and transformers' assisted generation do not."""
    from specgen.bench.methods import unsupported
    from specgen.runtime.pair import Pair

    pair = Pair(target, trained["draft"])
    assert [unsupported(pair, name) for name in ("eagle", "chain", "lookup-chain", "rsd-c")] == [None] * 4
    assert "EAGLE-3 head drafts" in unsupported(pair, "rsd-s")
    assert "not an EAGLE-3 head" in unsupported(pair, "hf-assisted")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["graphs", "inductor"])
@pytest.mark.parametrize("method", ["eagle", "rsd-c"])
def test_a_head_under_cuda_graphs_decides_what_eager_decides(trained, dirs, mode, method):
    """Captured (and compiled) target steps still write the features the head reads, and the head's
    own steps captured as CUDA graphs read each replay's features: on CUDA the same drafts,
    verdicts and tokens as eager, and plain decoding's output."""
    target = load_pair(str(dirs["target"]), None, device="cuda", dtype="float32", quiet=True)[0]
    draft = load_draft(str(trained["dir"]), target, device="cuda", dtype="float32", quiet=True)
    config = GenerationConfig(method=Method(method), max_new_tokens=30, draft_tokens=3, branching=(2, 2, 1))
    prompt = trained["prompts"][1]
    out, engines = {}, {}
    for run in (mode, "off"):
        engine = engines[run] = engine_with((target, draft), config, stop_ids=frozenset(), compile=run)
        events, state = decode(engine, prompt, config)
        out[run] = (state.ids, [(tuple(e.draft_tokens), e.accepted) for e in events])
    drafter = engines[mode].drafter  # the head's steps are captured too (a tree's deeper levels are not)
    assert drafter.from_target.mode == drafter.from_head.mode == "graphs" and drafter.from_target.graphs
    assert out[mode] == out["off"]
    assert sum(accepted for _, accepted in out["off"][1]) > 0
    plain = GenerationConfig(method=Method.PLAIN, max_new_tokens=30)
    reference = engine_with((target, None), plain, stop_ids=frozenset())
    assert out[mode][0] == decode(reference, prompt, plain)[1].ids


def head_mixed_batch(target, draft, mode: str, prompts) -> dict[int, list[int]]:
    """A head's rows in one batch with rows that draft otherwise (plain, an rsd-c tree,
    lookup-chain), the target's steps in `mode`: each row's final tokens."""
    from test_mixed import greedy, run

    from specgen.decoding.build import build_engine
    from specgen.runtime.pair import Pair

    configs = [
        greedy(Method.EAGLE, n=30),
        greedy(Method.PLAIN, n=30),
        greedy(Method.RSD_C, n=30, branching=(2, 1)),
        greedy(Method.LOOKUP_CHAIN, n=30),
    ]
    engine = build_engine(Pair(target, draft, mode), configs[0])
    finals, widths = run(engine, configs, prompts[: len(configs)])
    assert all(len(configs) in w for w in widths.values())  # one batch
    return finals


def test_a_head_s_rows_in_a_mixed_batch_on_fixed_shapes_decide_what_eager_decides(trained, target):
    """The head's fixed-shape path (what a GPU captures), eagerly on the CPU, beside rows drafted
    otherwise in one batch."""
    prompts = trained["prompts"]
    fixed = head_mixed_batch(target, trained["draft"], "fixed", prompts)
    assert fixed == head_mixed_batch(target, trained["draft"], "off", prompts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["graphs", "inductor"])
def test_a_head_s_rows_in_a_mixed_batch_under_cuda_graphs_decide_what_eager_decides(trained, dirs, mode):
    """`specgen serve` with a head on a GPU: the head's rows and rows of other methods in one
    batch under captured steps give what the batch gives eagerly, and each row plain decoding's
    tokens."""
    from test_mixed import greedy

    target = load_pair(str(dirs["target"]), None, device="cuda", dtype="float32", quiet=True)[0]
    draft = load_draft(str(trained["dir"]), target, device="cuda", dtype="float32", quiet=True)
    prompts = trained["prompts"]
    captured = head_mixed_batch(target, draft, mode, prompts)
    assert captured == head_mixed_batch(target, draft, "off", prompts)
    plain = greedy(Method.PLAIN, n=30)
    reference = engine_with((target, None), plain)
    for i in range(len(captured)):
        assert captured[i] == decode(reference, prompts[i], plain)[1].final_ids(), f"row {i}"
