"""--draft-quant: a cheaper draft never changes what the target decides."""

from __future__ import annotations

import copy

import pytest
import torch
from test_engine import PROMPT, reference_greedy
from tiny import decode

from specgen.config import GenerationConfig, Method
from specgen.decoding.drafters.model import ChainDrafter
from specgen.decoding.engine import Engine
from specgen.errors import ConfigError
from specgen.models.load import load_pair
from specgen.runtime import int8, int8_model
from specgen.runtime.pruned import PrunedHead
from specgen.runtime.quant import apply_draft_quant
from specgen.runtime.quant import parse_draft_quant as parse_quant

KEEP = 120  # of the tiny vocabulary's 259 ids


def draft_with(tiny_dirs, spec: str):
    draft, _ = load_pair(str(tiny_dirs["draft"]), None, device="cpu", dtype="float32", quiet=True)
    return apply_draft_quant(draft.model, spec, keep=KEEP, special_ids=(258,))


def test_parse_and_errors():
    assert parse_quant("none") == () and parse_quant("int8+prune") == ("int8", "prune")
    for bad in ("int4", "int8+int8-wo", "prune+x", "int8+int8", "+prune", "int8+", "prune+prune"):
        with pytest.raises(ConfigError):
            parse_quant(bad)


def test_pruned_head_keeps_the_first_ids_the_specials_and_what_it_reads(tiny_dirs):
    model = draft_with(tiny_dirs, "prune")
    assert isinstance(model.get_output_embeddings(), PrunedHead)
    # one id past KEEP in the text the draft reads (a third different one would pack its block:
    # the tiny vocabulary is one block)
    prompt = [t for t in PROMPT if t < KEEP or t == 258] + [200, 7, 200]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    kept = torch.zeros(259, dtype=torch.bool)
    kept[:KEEP] = True
    kept[[258, *prompt]] = True
    assert (torch.isfinite(logits) == kept).all()  # the same kept set at every position
    reference, _ = load_pair(str(tiny_dirs["draft"]), None, device="cpu", dtype="float32", quiet=True)
    with torch.no_grad():
        full = reference.model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits[:, kept], full[:, kept])
    with torch.no_grad():  # a later forward reads 230: proposable from then on, with its own row
        later = model(torch.tensor([[230]])).logits[0, -1]
    assert torch.isfinite(later[230]) and not torch.isfinite(later[231])
    assert torch.isfinite(later).sum() == kept.sum() + 1


def test_a_deep_copy_of_a_pruned_draft_reads_into_its_own_head(tiny_dirs):
    model = draft_with(tiny_dirs, "prune")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin(torch.tensor([[210]]))
    assert twin.get_output_embeddings().known[210] and not model.get_output_embeddings().known[210]


@pytest.mark.parametrize("spec", ["prune", "int8", "int8-wo", "int8+prune"])
def test_greedy_chain_with_a_cheaper_draft_equals_plain(tiny_pair, tiny_dirs, spec):
    target, _ = tiny_pair
    engine = Engine(
        target.model,
        target.device,
        frozenset(),
        target.context_length,
        ChainDrafter(draft_with(tiny_dirs, spec), torch.device("cpu")),
    )
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=16, draft_tokens=3)
    tokens = [t for r in decode(engine, PROMPT, config)[0] for t in r.emitted]
    assert tokens == reference_greedy(target.model, PROMPT, 16)


def test_cli_runs_with_a_quantized_draft_and_refuses_bad_specs(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))  # the int8 weights are cached there
    import json

    from typer.testing import CliRunner

    from specgen.cli import app

    models = [
        "--target",
        str(tiny_dirs["target"]),
        "--draft",
        str(tiny_dirs["draft"]),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "-n",
        "8",
        "--format",
        "json",
    ]
    runner = CliRunner()
    plain = json.loads(
        runner.invoke(app, ["run", "hello", *models, "--method", "plain"]).stdout.splitlines()[-1]
    )
    for spec in ("int8+prune", "int8-wo"):
        result = runner.invoke(app, ["run", "hello", *models, "--draft-quant", spec])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout.splitlines()[-1])["token_ids"] == plain["token_ids"]
    bad = runner.invoke(app, ["run", "hello", *models, "--draft-quant", "int3"])
    assert bad.exit_code != 0 and "Traceback" not in bad.output and "--draft-quant" in bad.output


def test_auto_quantizes_a_16_bit_draft_on_the_cpu_only():
    from specgen.runtime.quant import resolve_draft_quant as resolve_auto

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_auto("auto", cpu, torch.bfloat16) == "int8+prune"
    assert resolve_auto("auto", cpu, torch.float32) == "none"  # an explicit --dtype float32
    assert (
        resolve_auto("auto", cpu, torch.float32, dtype_auto=True) == "int8+prune"
    )  # fp32 chosen by --dtype auto
    assert resolve_auto("auto", cuda, torch.bfloat16) == "none"
    assert resolve_auto("prune", cuda, torch.bfloat16) == "prune"


@pytest.mark.skipif(not int8.available(), reason="needs fbgemm int8 kernels")
def test_auto_gives_tree_methods_the_int8_draft_too(tiny_dirs):
    """Trees used to keep the fp32 draft (torch's per-tensor int8 halved their acceptance)."""
    from specgen.config import ModelSettings
    from specgen.runtime.pair import load

    for method in (Method.RSD_C, Method.CHAIN):
        pair = load(
            ModelSettings(
                str(tiny_dirs["target"]), str(tiny_dirs["draft"]), "cpu", None, "auto", "auto", "off"
            ),
            method,
            quiet=True,
        )
        assert pair.draft.weights == "int8", method  # fp32 chosen by --dtype auto: row-exact int8 draft


@pytest.mark.parametrize("spec", ["prune", "int8+prune", "int8-wo+prune"])
def test_text_mostly_outside_the_kept_ids_widens_the_head_to_every_id(tiny_dirs, spec):
    """A prompt in another script (here: ids past KEEP) would leave the draft unable to propose
    most of its tokens; once three different ids of one block are among the last ids read,
    the head packs that block (the tiny vocabulary is one block: every id), and the logits are
    the unpruned draft's."""
    model = draft_with(tiny_dirs, spec)
    head = model.get_output_embeddings()
    mostly_inside = [(i * 7) % KEEP for i in range(80)] + [200, 201, 200, 201]  # two ids: stays pruned
    with torch.no_grad():
        logits = model(torch.tensor([mostly_inside])).logits[0, -1]
    assert not head.complete and torch.isinf(logits).sum() > 0
    outside = [KEEP + (i * 5) % (258 - KEEP) for i in range(70)]
    with torch.no_grad():
        logits = model(torch.tensor([outside])).logits[0]
    assert head.complete and torch.isfinite(logits).all()
    assert head.extra_ids.numel() == 0  # 200-202 moved from the read ids' product to the block's
    reference, _ = load_pair(str(tiny_dirs["draft"]), None, device="cpu", dtype="float32", quiet=True)
    if spec == "prune":
        with torch.no_grad():
            full = reference.model(torch.tensor([outside])).logits[0]
        torch.testing.assert_close(logits, full)


@pytest.mark.parametrize("spec", ["prune", "int8+prune"])
def test_the_head_packs_only_the_blocks_the_text_lives_in(tiny_dirs, spec):
    """Blocks of 16 ids: reads mostly in ids 160-191 pack those two blocks (many different ids
    each); a single read in another block stays in the read ids' product; every kept id has
    one logit, the unpruned draft's (prune) or the int8 one's, at every position."""
    from specgen.runtime.pruned import prune_head

    draft, _ = load_pair(str(tiny_dirs["draft"]), None, device="cpu", dtype="float32", quiet=True)
    reference = copy.deepcopy(draft.model)
    model = draft.model
    prune_head(model, KEEP, (258,), block_rows=16)
    if spec == "int8+prune":  # as apply_draft_quant does it: prune, then quantize; the reference is int8 too
        model, reference = int8_model.quantize_model(model), int8_model.quantize_model(reference)
    head = model.get_output_embeddings()
    text = [3, 5, 230, 9] + [160 + (i * 7) % 32 for i in range(70)]  # 230: read once, in block 14
    with torch.no_grad():
        logits = model(torch.tensor([text])).logits[0]
        full = reference(torch.tensor([text])).logits[0]
    assert [ids.tolist() for ids in head.block_ids] == [list(range(160, 176)), list(range(176, 192))]
    assert not head.complete and head.extra_ids.tolist() == [230]
    kept = torch.zeros(259, dtype=torch.bool)
    kept[[*range(KEEP), 258, 230, *range(160, 192)]] = True
    assert (torch.isfinite(logits) == kept).all()
    blocks = kept.clone()
    blocks[230] = False  # the read id's product is fp32 in both variants
    if spec == "prune":
        torch.testing.assert_close(logits[:, kept], full[:, kept])
    else:  # each block's product is the unpruned int8 head's, channel for channel
        assert torch.equal(logits[:, blocks], full[:, blocks])
    with torch.no_grad():  # later reads of a covered id change nothing; a new one joins the extras
        later = model(torch.tensor([[165, 240]])).logits[0, -1]
    assert head.extra_ids.tolist() == [230, 240] and torch.isfinite(later).sum() == kept.sum() + 1


def test_a_short_answer_in_another_script_packs_its_blocks_within_a_few_tokens(tiny_dirs):
    """Read one at a time after a prompt inside the kept ids (as a draft reads an answer), the
    third different id of a block packs it, however long the prompt, with every block two
    different ids were read in; a block read once stays in the read ids' product, and one id
    read over and over packs nothing (it is proposable from that product already)."""
    from specgen.runtime.pruned import WINDOW, prune_head

    draft, _ = load_pair(str(tiny_dirs["draft"]), None, device="cpu", dtype="float32", quiet=True)
    model = draft.model
    prune_head(model, KEEP, (258,), block_rows=16)
    head = model.get_output_embeddings()
    with torch.no_grad():
        model(torch.tensor([[(i * 7) % KEEP for i in range(WINDOW + 40)]]))
        for token in [200, 200, 3, 200, 5, 200, 9, 215, 230, 216]:  # blocks 12, 13 and 14
            model(torch.tensor([[token]]))
        assert head.block_ids == [] and head.extra_ids.tolist() == [200, 215, 230, 216]
        model(torch.tensor([[201]]))
        assert head.block_ids == []
        model(torch.tensor([[4]]))
        model(torch.tensor([[205]]))  # the third different id of block 12
    assert [ids.tolist() for ids in head.block_ids] == [list(range(192, 208)), list(range(208, 224))]
    assert head.extra_ids.tolist() == [230]  # the others moved to the blocks' products


def test_a_vocabulary_no_larger_than_keep_keeps_its_head(tiny_dirs):
    draft, _ = load_pair(str(tiny_dirs["draft"]), None, device="cpu", dtype="float32", quiet=True)
    head = draft.model.get_output_embeddings()
    model = apply_draft_quant(draft.model, "prune", keep=259)
    assert model.get_output_embeddings() is head


def test_an_answer_in_another_script_packs_every_id_of_that_script_at_once(tiny_dirs):
    """Given the tokenizer, the head packs a script's ids (Scripts: the UTF-8 lead byte of an
    id's first character outside ASCII, lead bytes E4-E9 as one script) once three different
    ids of it were read outside the kept ids, before the blocks' rule: every id of the script,
    wherever it lies, and no other. A single id of another script stays in the read ids'
    product. Each packing counts once in `widened` (what the drafters' floors watch)."""
    from specgen.runtime.pruned import WINDOW, head_of, prune_head

    def widened(model):
        return head_of(model).widened

    draft, _ = load_pair(str(tiny_dirs["draft"]), None, device="cpu", dtype="float32", quiet=True)
    model, tokenizer = draft.model, draft.tokenizer
    prune_head(model, KEEP, (258,), block_rows=16, tokenizer=tokenizer)
    head = model.get_output_embeddings()
    ideographs = tokenizer.convert_tokens_to_ids([chr(lead) for lead in range(0xE4, 0xEA)])  # 日: E6 97 A5
    cyrillic = tokenizer.convert_tokens_to_ids(chr(0xD0))
    assert min(ideographs) >= KEEP and cyrillic >= KEEP and widened(model) == 0
    with torch.no_grad():
        model(torch.tensor([[(i * 7) % KEEP for i in range(WINDOW + 40)]]))
        for token in [ideographs[0], 3, cyrillic, ideographs[0], ideographs[2]]:
            model(torch.tensor([[token]]))
        assert head.block_ids == [] and widened(model) == 0  # two different ideograph ids
        model(torch.tensor([[ideographs[5]]]))
        logits = model(torch.tensor([[5]])).logits[0, -1]
    assert [ids.tolist() for ids in head.block_ids] == [sorted(ideographs)] and widened(model) == 1
    assert head.extra_ids.tolist() == [cyrillic]
    assert torch.isfinite(logits[ideographs]).all() and torch.isfinite(logits[cyrillic])


def test_scripts_read_byte_level_and_sentencepiece_pieces():
    from tiny import build_byte_fallback_tokenizer, build_tokenizer

    from specgen.runtime.scripts import Scripts

    byte_level = Scripts(build_tokenizer(), 259)
    assert byte_level.byte_level
    # 日本 as byte-level BPE spells its bytes (E6 97 A5 E6 9C AC), a word with a space, é (C3 A9)
    assert [byte_level._script(p) for p in ("æĹ¥æľ¬", "Ġhello", "ÃĤ", "ìķĪ")] == [0xE4, -1, 0xC3, 0xEA]
    pieces = Scripts(build_byte_fallback_tokenizer(), 300)
    assert not pieces.byte_level
    assert [pieces._script(p) for p in ("▁日本", "▁hello", "é", "<0xE6>", "<0x41>")] == [
        0xE4,
        -1,
        0xC3,
        0xE4,
        -1,
    ]


def test_every_drafter_of_a_pruned_draft_reports_when_its_head_widens(tiny_dirs):
    """The trees' per-row searches read the one draft model as a chain does: each drafter built
    on a pruned draft reports its head's packings (`Drafter.widened`), so the engine measures
    tree rows' floors afresh too once the draft can propose a script's ids."""
    from specgen.decoding.build import make_drafter
    from specgen.runtime.pair import Pair
    from specgen.runtime.pruned import head_of, prune_head

    target, draft = load_pair(
        str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cpu", dtype="float32", quiet=True
    )
    prune_head(draft.model, KEEP, (258,), block_rows=16)
    methods = (Method.RSD_C, Method.RSD_S, Method.MULTI_DRAFT, Method.CHAIN, Method.LOOKUP_CHAIN)
    drafters = [make_drafter(Pair(target, draft), GenerationConfig(method=m)) for m in methods]
    assert [d.widened() for d in drafters] == [0] * len(methods)
    head_of(draft.model).cover([12])
    assert [d.widened() for d in drafters] == [1] * len(methods)
    plain, _ = load_pair(str(tiny_dirs["draft"]), None, device="cpu", dtype="float32", quiet=True)
    unpruned = make_drafter(Pair(target, plain), GenerationConfig(method=Method.RSD_C))
    assert unpruned.widened() == 0  # a whole head proposes every id from the start
