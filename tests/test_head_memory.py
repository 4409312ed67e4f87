"""A pruned draft head's memory: what one process's head learned to propose, primed into the next."""

from __future__ import annotations

import json

import pytest
import torch
from test_engine import PROMPT, reference_greedy
from tiny import decode

from specgen.config import GenerationConfig, Method
from specgen.decoding.drafters.model import ChainDrafter
from specgen.decoding.engine import Engine
from specgen.models.load import load_pair
from specgen.runtime import head_memory
from specgen.runtime.pruned import WINDOW, head_of, prune_head
from specgen.runtime.quant import apply_draft_quant

KEEP = 120  # of the tiny vocabulary's 259 ids


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test's memory files apart from every other test's (they share the tiny tokenizer)."""
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))


def pruned_draft(tiny_dirs):
    """A fresh process's draft: pruned with its tokenizer, primed from the memory there is."""
    draft, _ = load_pair(str(tiny_dirs["draft"]), None, device="cpu", dtype="float32", quiet=True)
    prune_head(draft.model, KEEP, (258,), block_rows=16, tokenizer=draft.tokenizer)
    memory = head_memory.attach(draft.model, draft.tokenizer)
    return draft, memory


def read(model, ids: list[int]) -> None:
    """Feed ids as a draft reads an answer: after a prompt inside the kept ids, one at a time."""
    with torch.no_grad():
        model(torch.tensor([[(i * 7) % KEEP for i in range(WINDOW + 40)]]))
        for token in ids:
            model(torch.tensor([[token]]))


def test_the_next_process_proposes_what_the_last_one_learned(tiny_dirs):
    """A script packed at once, a block packed by the blocks' rule and an id read one by one in
    one process: the next process proposes the id from its first forward, and the script and
    the block from the first of their ids it reads (not the TRIP a head that never saw them
    needs), with the same logits there as the head that learned them. The file names the
    script and block by number."""
    draft, memory = pruned_draft(tiny_dirs)
    model, tokenizer = draft.model, draft.tokenizer
    ideographs = tokenizer.convert_tokens_to_ids([chr(lead) for lead in range(0xE4, 0xEA)])
    text = [ideographs[0], ideographs[2], ideographs[5], 200, 3, 201, 5, 205, 230]  # block 12; 230 once
    read(model, text)
    head = head_of(model)
    assert head.learned_scripts == {0xE4} and head.learned_blocks == {12}
    with torch.no_grad():
        learned = model(torch.tensor([[5]])).logits[0, -1]
    memory.note(PROMPT + text)
    saved = json.loads(memory.path.read_text())
    assert set(saved["days"]) == {"s228", "b12"} and saved["ids"] == [230]

    again, _ = pruned_draft(tiny_dirs)
    assert head_memory.primed(again.model) == {"scripts": 1, "blocks": 1, "ids": 1}  # bench's record
    assert (
        head_memory.primed(load_pair(str(tiny_dirs["draft"]), None, device="cpu", quiet=True)[0].model)
        is None
    )
    fresh = head_of(again.model)
    assert set(fresh.waiting) == {"s228", "b12"} and not fresh.learned_scripts | fresh.learned_blocks
    with torch.no_grad():
        first = again.model(torch.tensor([[5]])).logits[0, -1]
    assert torch.isfinite(first[230]) and not torch.isfinite(first[[*ideographs, *range(192, 208)]]).any()
    with torch.no_grad():
        again.model(torch.tensor([[ideographs[4]]]))  # one ideograph: the script joins
        assert torch.isfinite(again.model(torch.tensor([[5]])).logits[0, -1][ideographs]).all()
        again.model(torch.tensor([[207]]))  # one id of block 12: the block joins
        primed = again.model(torch.tensor([[5]])).logits[0, -1]
    assert not fresh.waiting and fresh.learned_scripts == {0xE4} and fresh.learned_blocks == {12}
    assert torch.equal(torch.isfinite(primed), torch.isfinite(learned))
    assert torch.isfinite(primed[[*ideographs, *range(192, 208), 230]]).all()
    torch.testing.assert_close(primed[torch.isfinite(primed)], learned[torch.isfinite(learned)])


def test_held_groups_cost_text_that_needs_none_of_them_nothing(tiny_dirs):
    """A primed script stays out of the forward while the text reads none of its ids (one
    product of the remembered ids beside the static one); a block the blocks' rule packs
    leaves out a held group's ids, so when that group joins no id is in two products."""
    draft, memory = pruned_draft(tiny_dirs)
    ideographs = draft.tokenizer.convert_tokens_to_ids([chr(lead) for lead in range(0xE4, 0xEA)])
    memory.path.parent.mkdir(parents=True, exist_ok=True)
    days = {"s228": head_memory.today()}
    memory.path.write_text(json.dumps({"format": head_memory.FORMAT, "days": days, "ids": [230]}))
    again, _ = pruned_draft(tiny_dirs)
    head = head_of(again.model)
    read(again.model, [5, 7, 9])
    assert [ids.tolist() for ids in head.block_ids] == [[230]] and head.widened == 1
    # three ids of the ideographs' block, outside their script and each of another script (so
    # none trips): the blocks' rule packs the block without the held ideographs
    block, scripts, others = ideographs[0] // 16, head.scripts.all(), {}
    for i in range(block * 16, block * 16 + 16):
        if i >= KEEP and i not in ideographs:
            others.setdefault(int(scripts[i]), i)
    others = list(others.values())[:3]
    assert len(others) == 3
    read(again.model, others)
    packed = set(torch.cat(head.block_ids).tolist())
    rest = {i for i in range(block * 16, block * 16 + 16) if i >= KEEP and i not in ideographs}
    assert packed == rest | {230} and "s228" in head.waiting
    read(again.model, [ideographs[1]])
    packed = torch.cat(head.block_ids)
    assert packed.numel() == packed.unique().numel() and set(ideographs) <= set(packed.tolist())


def test_what_no_text_needed_for_a_month_is_not_primed(tiny_dirs):
    """A script or block last needed more than STALE_DAYS ago is left out (its cost per draft
    step is not carried for ever); one needed again is dated anew; ids are kept either way."""
    draft, memory = pruned_draft(tiny_dirs)
    today = head_memory.today()
    stale = today - head_memory.STALE_DAYS - 1
    memory.path.parent.mkdir(parents=True, exist_ok=True)
    days = {"s228": stale, "b12": today - 3, "b13": stale}
    memory.path.write_text(json.dumps({"format": head_memory.FORMAT, "days": days, "ids": [230]}))
    again, memory = pruned_draft(tiny_dirs)
    head = head_of(again.model)
    assert [ids.tolist() for ids in head.block_ids] == [[230]] and set(head.waiting) == {"b12"}
    read(again.model, [200, 201, 205])  # block 12 needed today: it joins, and is dated so
    assert head.learned_blocks == {12} and not head.learned_scripts
    memory.note([200, 201, 205])
    saved = json.loads(memory.path.read_text())
    assert saved["days"] == {"b12": today} and saved["ids"] == [230]


@pytest.mark.parametrize(
    "text", ["not json", '{"format": 1}', '{"format": 99, "days": {}, "ids": []}', '{"format": 1, "days": 3}']
)
def test_a_damaged_or_foreign_memory_is_ignored(tiny_dirs, text):
    _, memory = pruned_draft(tiny_dirs)
    memory.path.parent.mkdir(parents=True, exist_ok=True)
    memory.path.write_text(text)
    again, _ = pruned_draft(tiny_dirs)
    assert head_of(again.model).block_ids == []


def test_an_unwritable_cache_costs_the_next_process_its_priming_only(tiny_dirs, tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("SPECGEN_CACHE", str(blocked))  # the cache's folder cannot be made
    draft, memory = pruned_draft(tiny_dirs)
    read(draft.model, [200, 3, 201, 5, 205])
    memory.note([200, 201, 205])
    assert not (blocked / "heads").exists()


def test_a_primed_int8_draft_drafts_and_the_output_is_plain_decodings(tiny_pair, tiny_dirs):
    """Through apply_draft_quant (int8 + prune, as `specgen` loads a draft) the memory is
    attached and primed; a chain round's finished row writes it; the next load proposes, or
    holds until the first of their ids is read, every id the first one had come to propose,
    and greedy output is plain decoding's both times."""
    target, _ = tiny_pair

    def draft():
        loaded, _ = load_pair(str(tiny_dirs["draft"]), None, device="cpu", dtype="float32", quiet=True)
        return apply_draft_quant(
            loaded.model, "int8+prune", keep=KEEP, special_ids=(258,), tokenizer=loaded.tokenizer
        )

    def chain_tokens(model):
        engine = Engine(
            target.model,
            target.device,
            frozenset(),
            target.context_length,
            ChainDrafter(model, torch.device("cpu")),
        )
        config = GenerationConfig(method=Method.CHAIN, max_new_tokens=16, draft_tokens=3)
        return [t for r in decode(engine, PROMPT, config)[0] for t in r.emitted]

    first = draft()
    assert head_of(first).known.sum() == KEEP + 1  # the first ids and the special
    tokens = chain_tokens(first)
    learned = head_of(first).known.clone()
    assert learned.sum() > KEEP + 1  # the tiny prompt has ids past KEEP
    again = draft()
    held = head_of(again).wakes >= 0  # joins at its first id read
    assert torch.equal(head_of(again).known | held, learned)
    assert tokens == chain_tokens(again) == reference_greedy(target.model, PROMPT, 16)


def test_every_drafter_of_the_draft_model_reports_its_finished_rows(tiny_dirs):
    """Chain, lookup-chain and the trees' per-row searches each hand a finished row's ids to the
    draft head's memory, which writes what the head learned."""
    from specgen.decoding.build import make_drafter
    from specgen.runtime.pair import Pair

    target, draft = load_pair(
        str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cpu", dtype="float32", quiet=True
    )
    prune_head(draft.model, KEEP, (258,), block_rows=16, tokenizer=draft.tokenizer)
    memory = head_memory.attach(draft.model, draft.tokenizer)
    read(draft.model, [230])
    for method in (Method.RSD_C, Method.RSD_S, Method.CHAIN, Method.LOOKUP_CHAIN):
        memory.path.unlink(missing_ok=True)
        memory.written, memory.wrote = None, 0.0
        make_drafter(Pair(target, draft), GenerationConfig(method=method)).finished(0, [230])
        assert json.loads(memory.path.read_text())["ids"] == [230], method


def test_a_change_held_back_is_written_at_exit(tiny_dirs, monkeypatch):
    """After a process's first write, a change within WRITE_EVERY seconds waits; an exit hook
    (registered once) writes it."""
    hooks = []
    monkeypatch.setattr(head_memory.atexit, "register", lambda *call: hooks.append(call))
    draft, memory = pruned_draft(tiny_dirs)
    read(draft.model, [230])
    memory.note([230])
    read(draft.model, [240])
    memory.note([240])
    memory.note([240])
    assert json.loads(memory.path.read_text())["ids"] == [230] and len(hooks) == 1
    hook, *arguments = hooks[0]
    hook(*arguments)
    assert json.loads(memory.path.read_text())["ids"] == [230, 240]
