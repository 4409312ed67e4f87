"""A draft with another tokenizer: text-level drafting (decoding/drafters/text.py, retokenize.py).

Two tiny models trained for a few seconds on one short text, so that they agree often and
drafts get accepted: a byte-level target (tests/tiny.py: every byte a token, ChatML specials)
and a byte-level BPE with merges, other special tokens and ids, a BOS and another chat template.
Both directions are tested: byte target + BPE draft, and BPE target + byte draft (there the
target's merges make the seam re-encode). Models load through specgen's own loading code.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_chat import Quiet
from test_deterministic import ShapeSensitive
from test_statistical import SMALL_ALPHA, gof_pvalue, rule_without_residual
from tiny import batch_ids, build_model, build_tokenizer, decode, engine_with, two_token_law
from typer.testing import CliRunner

import specgen.decoding.verify as verify_module
from specgen.chat.session import ChatSession
from specgen.cli import app
from specgen.config import GenerationConfig, Method, ModelSettings, SamplingConfig
from specgen.decoding.build import make_drafter
from specgen.decoding.drafters.lookup_chain import LookupChain
from specgen.decoding.drafters.model import ChainDrafter
from specgen.decoding.drafters.retokenize import Bridge, Seam
from specgen.decoding.drafters.text import TextDrafter
from specgen.decoding.engine import Engine
from specgen.decoding.events import Finished, Joined, ReplayResult, RoundResult
from specgen.errors import ConfigError
from specgen.models.load import TEXT_DRAFTING, Vocabulary, load_pair
from specgen.runtime.pair import Pair

CORPUS = (
    "héllo wörld ✓ 日本 is a greeting. The quick brown fox jumps over the lazy dog. "
    "héllo wörld ✓ 日本 again and again; the fox says héllo to the dog.\n"
)
BPE_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>"]
BPE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}"
)
PROMPTS = ["The quick", "héllo wörld ✓ 日本", "héllo wö", "the fox says", "again and"]


def build_bpe_tokenizer():
    """A byte-level BPE with 70 merges learned from CORPUS (some inside multi-byte characters:
    "日本" is one token), other specials at ids 0-3, a BOS it adds itself, another template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        special_tokens=BPE_SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator([CORPUS] * 4, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<unk>"
    )
    tokenizer.chat_template = BPE_TEMPLATE
    return tokenizer


def trained(model, ids: list[int], steps: int, seed: int):
    """A few hundred Adam steps on windows of `ids`: the model learns the text by heart."""
    generator = torch.Generator().manual_seed(seed)
    data = torch.tensor(ids)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 49, (8,), generator=generator).tolist()
        batch = torch.stack([data[s : s + 48] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("cross")
    byte, bpe = build_tokenizer(), build_bpe_tokenizer()
    torch.manual_seed(0)
    byte_model = trained(build_model(11, vocab=259, init_range=0.02), byte.encode(CORPUS * 4), 300, seed=1)
    bpe_model = trained(
        build_model(12, layers=1, vocab=len(bpe), init_range=0.02, eos_id=2, pad_id=0),
        bpe.encode(CORPUS * 4, add_special_tokens=False),
        300,
        seed=2,
    )
    torch.set_num_threads(threads)
    out = {}
    for name, model, tokenizer in (("byte", byte_model, byte), ("bpe", bpe_model, bpe)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        out[name] = root / name
    return out


def load(dirs, target: str, draft: str):
    return load_pair(str(dirs[target]), str(dirs[draft]), device="cpu", dtype="float32", quiet=True)


@pytest.fixture(scope="module")
def byte_bpe(dirs):
    """Byte-level target, BPE draft."""
    return load(dirs, "byte", "bpe")


@pytest.fixture(scope="module")
def bpe_byte(dirs):
    """BPE target (its merges re-encode across the seam), byte-level draft."""
    return load(dirs, "bpe", "byte")


PAIRS = ["byte_bpe", "bpe_byte"]


def prompt_ids(pair, text: str) -> list[int]:
    return pair[0].tokenizer.encode(text, add_special_tokens=False)


def run(pair, prompt: list[int], **settings):
    """(generated ids, rounds, the engine's drafter)."""
    config = GenerationConfig(**{"max_new_tokens": 40, "draft_tokens": 4, **settings})
    engine = engine_with(pair, config)
    events, state = decode(engine, prompt, config)
    return state.ids[len(prompt) :], [e for e in events if isinstance(e, RoundResult)], engine.drafter


# -- loading ------------------------------------------------------------------------------------


def test_load_accepts_another_tokenizer_with_one_notice(dirs, capfd):
    target, draft = load(dirs, "byte", "bpe")
    assert draft.vocabulary is Vocabulary.TEXT and target.vocabulary is Vocabulary.SHARED
    assert Pair(target, draft).vocab is None  # the target's whole vocabulary is verified
    assert capfd.readouterr().err.count(TEXT_DRAFTING) == 1
    _, same = load(dirs, "byte", "byte")
    assert same.vocabulary is Vocabulary.SHARED
    assert TEXT_DRAFTING not in capfd.readouterr().err


def test_the_drafter_a_pair_gets(byte_bpe, tiny_pair):
    """Text drafting for chain and lookup-chain; trees refuse it; a shared tokenizer stays on ids."""
    with pytest.raises(ConfigError, match="chain or lookup-chain"):
        make_drafter(Pair(*byte_bpe), GenerationConfig(method=Method.RSD_C))
    assert isinstance(make_drafter(Pair(*byte_bpe), GenerationConfig(method=Method.CHAIN)), TextDrafter)
    assert isinstance(
        make_drafter(Pair(*byte_bpe), GenerationConfig(method=Method.LOOKUP_CHAIN)), LookupChain
    )
    # a shared tokenizer keeps the id-level path
    assert type(make_drafter(Pair(*tiny_pair), GenerationConfig(method=Method.CHAIN))) is ChainDrafter


# -- the seams, tokenizers only -----------------------------------------------------------------


def test_seams_between_the_two_tokenizers():
    byte, bpe = build_tokenizer(), build_bpe_tokenizer()
    # BPE target: committed "héllo wö", drafted "rld ✓": "wörld" is one BPE token, so the
    # re-encoding would change the committed tokens; the text is proposed on its own instead
    bridge = Bridge(bpe, byte)
    committed = bpe.encode("héllo wö", add_special_tokens=False)
    seam = bridge.cut(committed, 0)
    assert 0 < seam < len(committed)
    ids, how = bridge.proposal(committed, seam, [], byte.encode("rld ✓"), 8)
    assert how is Seam.RESPLIT and bpe.decode(committed + ids) == "héllo wörld ✓"
    # ... and a seam that holds: the proposal starts right after the last committed token
    committed = bpe.encode("héllo", add_special_tokens=False)
    ids, how = bridge.proposal(committed, 0, [], byte.encode(" wörld ✓ 日本"), 8)
    assert how is Seam.EXTENDS and ids == bpe.encode(" wörld ✓ 日本", add_special_tokens=False)
    # a drafted token that ends mid character: the incomplete character is dropped
    partial = byte.encode(" 日本")[:-1]
    ids, _ = bridge.proposal(committed, 0, [], partial, 8)
    assert bpe.decode(ids) == " 日"
    # byte target: the committed text ends inside "日"; the draft's "日本" completes it
    bridge = Bridge(byte, bpe)
    committed = byte.encode("héllo wörld ✓ 日本")[:-4]
    seam = bridge.cut(committed, 0)
    draft_context = bridge.draft_ids(committed, 0, len(committed))
    assert bpe.decode(draft_context) == "héllo wörld ✓ "  # the partial character is left out
    ids, how = bridge.proposal(
        committed, seam, draft_context, bpe.encode("日本", add_special_tokens=False), 8
    )
    assert how is Seam.EXTENDS and byte.decode(committed + ids) == "héllo wörld ✓ 日本"


def test_special_tokens_and_the_draft_bos():
    """Target specials never reach the draft as text: the same name maps, others drop."""
    byte, bpe = build_tokenizer(), build_bpe_tokenizer()
    bridge = Bridge(byte, bpe)
    assert bridge.lead == [bpe.bos_token_id]
    prompt = list(
        byte.apply_chat_template(
            [{"role": "user", "content": "héllo"}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
    )
    draft = bridge.draft_ids(prompt, 0, len(prompt))
    assert bpe.decode(draft) == "<|im_start|>user\nhéllo\n<|im_start|>assistant\n"
    assert draft.count(bpe.convert_tokens_to_ids("<|im_start|>")) == 2  # mapped by name, not spelled
    # the draft's end of sequence (no target token of that name) ends the proposal
    ids, _ = bridge.proposal(
        prompt,
        len(prompt),
        draft,
        bpe.encode(" hi", add_special_tokens=False)
        + [bpe.eos_token_id]
        + bpe.encode(" more", add_special_tokens=False),
        8,
    )
    assert byte.decode(ids) == " hi"


# -- greedy: token for token the target's ---------------------------------------------------------


@pytest.mark.parametrize("method", [Method.CHAIN, Method.LOOKUP_CHAIN])
@pytest.mark.parametrize("pair_name", PAIRS)
def test_greedy_is_plain_greedy_on_every_prompt(request, pair_name, method):
    pair = request.getfixturevalue(pair_name)
    accepted = 0
    prompts = [prompt_ids(pair, text) for text in PROMPTS]
    if pair_name == "byte_bpe":
        prompts.append(pair[0].tokenizer.encode("héllo wörld ✓ 日本")[:-4])  # ends inside a character
    for prompt in prompts:
        plain, _, _ = run(pair, prompt, method=Method.PLAIN)
        ids, rounds, _ = run(pair, prompt, method=method)
        assert ids == plain, pair[0].tokenizer.decode(prompt)
        accepted += sum(r.accepted for r in rounds)
    assert accepted > 20  # the trained pair agrees: drafts do get accepted


def test_the_target_seam_re_encodes_and_output_stays_exact(bpe_byte):
    prompt = prompt_ids(bpe_byte, "héllo wö")
    plain, _, _ = run(bpe_byte, prompt, method=Method.PLAIN)
    ids, rounds, drafter = run(bpe_byte, prompt, method=Method.CHAIN)
    assert ids == plain
    assert drafter.seams[Seam.RESPLIT] > 0 and drafter.seams[Seam.EXTENDS] > 0


def test_a_draft_of_another_tokenizer_declines_a_prompt_too_dear_to_read(byte_bpe):
    """The read rule (drafters/model.py) reaches the chain drafter inside the text drafter: a
    prompt too dear to read is not read, and the row's rounds are plain ones."""
    target, draft = byte_bpe
    prompt = prompt_ids(byte_bpe, PROMPTS[0])
    plain = run(byte_bpe, prompt, method=Method.PLAIN, max_new_tokens=24)[0]
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=24, draft_tokens=3, floor=True)
    for price, declined in ((10.0, True), (1e-4, False)):  # a read that pays is read
        inner = ChainDrafter(draft.model, draft.device, window=0, read_price=price)
        drafter = TextDrafter(inner, Bridge(target.tokenizer, draft.tokenizer))
        engine = Engine(target.model, target.device, target.stop_ids, target.context_length, drafter)
        joined, drafted = [], 0
        for report in engine.generate([prompt], config):
            joined += [report.event] if isinstance(report.event, Joined) else []
            drafted += len(report.event.draft_tokens) if isinstance(report.event, RoundResult) else 0
            state = report.state
        assert state.ids[len(prompt) :] == plain
        assert [event.declined for event in joined] == [declined]
        assert (inner.cache.lengths[0] == 0) == declined  # a declined prompt is never read
        assert (drafted == 0) == declined


def test_the_draft_side_tail_is_re_encoded(byte_bpe):
    """Byte target, BPE draft: a word grows over rounds and the draft re-reads it merged."""
    _, rounds, drafter = run(byte_bpe, prompt_ids(byte_bpe, "The quick"), method=Method.CHAIN, draft_tokens=2)
    assert drafter.retokenized > 0 and any(r.accepted for r in rounds)


@pytest.mark.parametrize("method", [Method.CHAIN, Method.LOOKUP_CHAIN])
@pytest.mark.parametrize("pair_name", PAIRS)
def test_batched_rows_are_single_rows(request, pair_name, method):
    pair = request.getfixturevalue(pair_name)
    prompts = [prompt_ids(pair, text) for text in PROMPTS]
    config = GenerationConfig(method=method, max_new_tokens=24, draft_tokens=3)
    batched = batch_ids(engine_with(pair, config), prompts, config, batch_size=3)
    single = [
        prompt + run(pair, prompt, method=method, max_new_tokens=24, draft_tokens=3)[0] for prompt in prompts
    ]
    assert batched == single


# -- chat, deterministic mode ----------------------------------------------------------------------


@pytest.mark.parametrize("pair_name", PAIRS)
def test_chat_turns_keep_their_caches_and_stay_exact(request, dirs, pair_name):
    pair = request.getfixturevalue(pair_name)
    names = pair_name.split("_")
    settings = ModelSettings(str(dirs[names[0]]), str(dirs[names[1]]), "cpu", None, "float32")
    replies = {}
    for method in (Method.PLAIN, Method.CHAIN, Method.LOOKUP_CHAIN):
        config = GenerationConfig(method=method, max_new_tokens=20, draft_tokens=3)
        session = ChatSession(Pair(*pair), settings, config, "Be kind.", None)
        turns = [session.send(text, Quiet()) for text in ("héllo wörld", "the fox says")]
        assert turns[1].reused_tokens > 0
        replies[method] = [turn.outcome.token_ids for turn in turns]
    assert replies[Method.PLAIN] == replies[Method.CHAIN] == replies[Method.LOOKUP_CHAIN]


@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(), SamplingConfig(temperature=0.9, top_p=0.95, seed=5)],
    ids=["greedy", "sampling"],
)
def test_deterministic_mode_gives_plain_tokens(byte_bpe, sampling):
    """A shape-sensitive target (logits depend on the forward's width) forces rollbacks, which
    rewind the text drafter; the committed tokens are the same for every method."""
    target, draft = byte_bpe
    pair = (dataclasses.replace(target, model=ShapeSensitive(target.model, scale=3.0)), draft)
    prompt = prompt_ids(pair, "The quick")
    outputs, rolled_back = {}, 0
    for method in (Method.PLAIN, Method.CHAIN, Method.LOOKUP_CHAIN):
        config = GenerationConfig(
            method=method,
            max_new_tokens=40,
            draft_tokens=4,
            sampling=sampling,
            deterministic=True,
            verify_window=8,
        )
        events, state = decode(engine_with(pair, config), prompt, config)
        outputs[method] = state.ids[len(prompt) :]
        rolled_back += sum(len(e.rolled_back) for e in events if isinstance(e, ReplayResult))
    assert rolled_back > 0  # the drafter was rewound
    assert len(outputs[Method.PLAIN]) == 40
    assert outputs[Method.PLAIN] == outputs[Method.CHAIN] == outputs[Method.LOOKUP_CHAIN]


# -- sampling: exactly the target's law --------------------------------------------------------

STAT_PROMPT = "héllo wörld ✓ 日本 "  # the text goes on with " is" or " again"
STAT_SAMPLING = SamplingConfig(temperature=1.5)
GENERATIONS = 1200


def first_two(pair, generations: int, seed: int) -> torch.Tensor:
    """The first two tokens of `generations` rows of one prompt, 300 rows at a time."""
    config = GenerationConfig(
        method=Method.CHAIN,
        max_new_tokens=2,
        draft_tokens=3,
        sampling=dataclasses.replace(STAT_SAMPLING, seed=seed),
    )
    # the first token is drafted too, though the prompt is long
    engine = engine_with(pair, config, stop_ids=frozenset(), prompt_catch_up=1 << 30)
    prompt = prompt_ids(pair, STAT_PROMPT)
    finished = {
        r.index: r.state.ids[-2:]
        for r in engine.generate([prompt] * generations, config, 300)
        if isinstance(r.event, Finished)
    }
    return torch.tensor([finished[i] for i in range(generations)])


@pytest.fixture(scope="module")
def stat_law(byte_bpe):
    return two_token_law(byte_bpe[0].model, prompt_ids(byte_bpe, STAT_PROMPT), STAT_SAMPLING)


@pytest.mark.statistical
def test_sampling_follows_the_target_law(byte_bpe, stat_law):
    """1200 rows (temperature 1.5): first tokens ~ q0, pairs ~ q0(t1) q1(t2 | t1); alpha 1e-3 each."""
    tokens = first_two(byte_bpe, GENERATIONS, seed=3)
    q0, joint = stat_law
    assert gof_pvalue(tokens[:, 0], q0) > SMALL_ALPHA
    pvalue = gof_pvalue(tokens[:, 0] * joint.shape[0] + tokens[:, 1], joint.flatten())
    assert pvalue > SMALL_ALPHA, f"p-value {pvalue:.3g}"


@pytest.mark.statistical
def test_control_point_masses_without_residual_fail(byte_bpe, stat_law, monkeypatch):
    """Negative control: re-drawing from q after a rejected point mass (no residual) over-weights
    the drafted token; the same test must fail."""

    def broken(draft_tokens, target_probs, generator):
        return rule_without_residual(draft_tokens, None, target_probs, generator)

    monkeypatch.setattr(verify_module, "point_mass_sampling", broken)
    tokens = first_two(byte_bpe, GENERATIONS, seed=9000)
    q0, _ = stat_law
    pvalue = gof_pvalue(tokens[:, 0], q0)
    assert pvalue < SMALL_ALPHA, f"the broken rule passed: p-value {pvalue:.3g}"


# -- the command line --------------------------------------------------------------------------------


def test_cli_run_with_a_draft_of_another_tokenizer(dirs):
    runner = CliRunner()
    texts = {}
    for method in ("plain", "chain", "lookup-chain"):
        result = runner.invoke(
            app,
            [
                "run",
                "héllo wörld",
                "--target",
                str(dirs["byte"]),
                "--draft",
                str(dirs["bpe"]),
                "--dtype",
                "float32",
                "--device",
                "cpu",
                "-n",
                "24",
                "--method",
                method,
                "--format",
                "json",
            ],
        )
        assert result.exit_code == 0, result.output
        texts[method] = json.loads(result.stdout.strip().splitlines()[-1])["token_ids"]
        notices = result.stderr.count(TEXT_DRAFTING)
        assert notices == (0 if method == "plain" else 1), result.stderr
    assert texts["plain"] == texts["chain"] == texts["lookup-chain"]


def test_bench_with_a_draft_of_another_tokenizer(dirs, tmp_path):
    """What such a pair cannot run (trees; transformers' assisted generation) is refused before
    anything is measured when named, and left out with a line from the default list."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "c", "prompt": "the cat sat"}) + "\n")
    base = [
        "bench",
        "--target",
        str(dirs["byte"]),
        "--draft",
        str(dirs["bpe"]),
        "--dtype",
        "float32",
        "--prompts",
        str(prompts),
        "-n",
        "4",
        "--no-warmup",
        "--json",
        str(tmp_path / "b.json"),
    ]
    named = CliRunner().invoke(app, [*base, "--methods", "chain,rsd-c"])
    assert named.exit_code == 1 and "Traceback" not in named.output
    assert "rsd-c drafts trees" in named.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "b.json").exists()
    every = CliRunner().invoke(app, base)
    assert every.exit_code == 0, every.output
    for name in ("rsd-c", "rsd-s", "multi-draft", "hf-assisted", "hf-assisted-k4"):
        assert f"bench: left out {name}" in every.stderr
    data = json.loads((tmp_path / "b.json").read_text())
    measured = data["methods"]
    assert {"plain", "chain", "lookup-chain", "hf-lookup"} <= set(measured) and "rsd-c" not in measured
    assert "drafts trees" in data["settings"]["left_out"]["rsd-c"]  # the JSON says what was left out, and why
