"""The family matrix: every model family specgen checks, as tiny random models, against
transformers' own greedy `generate` (which equals a full recompute) on every path.

For each family (tests/families.py: sliding windows shorter than the prompts, softcaps, local
and global rope, MoE routing, attention sinks, no-rope layers, learned positions), a target and
a draft that agrees with it often (its weights plus a little noise), loaded through specgen's
own loading code, run through `specgen check`'s machinery (bench/check.py): plain, chain,
lookup, lookup-chain and rsd-c; batched rows of different lengths; prompts from the prefix
store; chunked prefill; a chat turn's kept cache; deterministic mode; rows of every method in
one batch. Then with fixed-shape
steps, with the int8 target of the CPU path, through the HTTP server, and under sampling
(the first two tokens' law, with a negative control). Unknown architectures are proved by the
load-time probe or refused.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from families import FAMILIES, WINDOW, build, near_copy, save
from tiny import build_tokenizer

from specgen.bench.check import Case, Path, check, describe, reference, standard_cases
from specgen.config import GenerationConfig, Method, ModelSettings, SamplingConfig
from specgen.errors import ModelError
from specgen.runtime.pair import load

TEXTS = (
    "The quick brown fox jumps",
    "def add(a, b):\n    return a + b\n\nprint(add(",
    "one, two, three, four, one, two, three",
)
NEW = 16


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    ids = [build_tokenizer().encode(text) for text in TEXTS]
    assert all(len(p) > WINDOW for p in ids) and len({len(p) for p in ids}) == len(ids)
    return ids


@pytest.fixture(scope="module")
def family_root(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


def saved(root, family: str):
    """(target dir, draft dir) of a family, built once per test run."""
    target, draft = root / family, root / f"{family}-draft"
    if not target.exists():
        model = build(family, seed=1)
        save(target, model)
        save(draft, near_copy(model, seed=2, noise=0.02))
    return target, draft


def settings(target, draft, quant: str = "none", compile: str = "off") -> ModelSettings:
    return ModelSettings(
        str(target), str(draft) if draft else None, "cpu", None, "float32", quant, compile, quant
    )


def assert_identical(pair, prompts, cases):
    results = check(pair, prompts, cases, NEW)
    bad = [f"{r.label}: {describe(r, pair, len(prompts))}" for r in results if not r.identical]
    assert not bad, "\n".join(bad)
    return results


@pytest.mark.parametrize("family", FAMILIES)
def test_every_method_and_path_equals_transformers(family, family_root, prompts):
    """fp32, the model's own forward (or the lean one): every standard case, then fixed-shape
    steps (the full-capacity view and padded trees of compiled runs)."""
    target, draft = saved(family_root, family)
    pair = load(settings(target, draft), Method.CHAIN, quiet=True)
    results = assert_identical(pair, prompts, standard_cases(pair))
    assert {r.path for r in results} == set(Path)
    fixed = dataclasses.replace(pair, compile="fixed")
    assert_identical(
        fixed, prompts, [Case(Method.CHAIN), Case(Method.CHAIN, Path.BATCHED), Case(Method.RSD_C)]
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_path_equals_transformers_on_the_same_weights(family, family_root, prompts):
    """The CPU's default path: int8 target (exact attention) and int8 draft. The reference is
    transformers' generate on the same quantized model."""
    target, draft = saved(family_root, family)
    pair = load(settings(target, draft, quant="int8"), Method.CHAIN, quiet=True)
    assert pair.target.weights == "int8"
    assert_identical(
        pair,
        prompts,
        [
            Case(Method.PLAIN),
            Case(Method.PLAIN, Path.CACHED),
            Case(Method.CHAIN),
            Case(Method.CHAIN, Path.BATCHED),
            Case(Method.PLAIN, Path.CHUNKED),
        ],
    )


def test_a_draft_of_another_family_with_the_same_tokenizer(family_root, prompts):
    """A Gemma 2 target (windows, softcaps) drafted by a Llama and by a Mistral (its own window)."""
    target, _ = saved(family_root, "gemma2")
    for other in ("llama3", "mistral"):
        _, draft = saved(family_root, other)
        pair = load(settings(target, draft), Method.CHAIN, quiet=True)
        assert_identical(
            pair,
            prompts,
            [
                Case(Method.CHAIN),
                Case(Method.CHAIN, Path.BATCHED),
                Case(Method.RSD_C),
                Case(Method.LOOKUP_CHAIN),
            ],
        )


def test_a_multimodal_gemma3_checkpoint_drafts_and_is_drafted_for(family_root, prompts):
    """gemma-3-4b/12b/27b-it load as Gemma3ForConditionalGeneration, whose text sizes are in
    `config.text_config`: with a draft model every command failed reading `config.vocab_size`."""
    import transformers as T
    from families import configs

    text = configs()["gemma3"]().to_dict()
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    torch.manual_seed(1)
    config = T.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=257,
        boi_token_index=256,
        eoi_token_index=255,
        eos_token_id=258,
        pad_token_id=256,
    )
    multimodal = family_root / "gemma3-multimodal"
    save(multimodal, T.Gemma3ForConditionalGeneration(config).eval())
    target, draft = saved(family_root, "gemma3")
    for pair_dirs in ((multimodal, draft), (target, multimodal)):
        pair = load(settings(*pair_dirs), Method.CHAIN, quiet=True)
        assert pair.vocab is None
        assert_identical(pair, prompts, [Case(Method.CHAIN), Case(Method.CHAIN, Path.BATCHED)])


# -- the server -------------------------------------------------------------------------------


def _complete(url: str, token: str, model: str, text: str, method: str) -> str:
    body = {
        "model": model,
        "prompt": text,
        "max_tokens": NEW,
        "temperature": 0,
        "speculative": {"method": method},
    }
    request = urllib.request.Request(
        f"{url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.load(answer)["choices"][0]["text"]


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3", "qwen2-sliding", "gpt-oss", "phi3"])
def test_the_server_answers_as_transformers(family, family_root, prompts):
    """Greedy completions through `specgen serve` (its prefix cache on): each prompt alone, again
    (its prompt now in the prefix cache), and all at once (rows joining a batch)."""
    from specgen.serve.server import ServeOptions, prepare

    target, draft = saved(family_root, family)
    pair = load(settings(target, draft), Method.CHAIN, quiet=True)
    tokenizer = pair.target.tokenizer
    texts = [tokenizer.decode(p) for p in prompts]
    expected = [tokenizer.decode(reference(pair, p, NEW), skip_special_tokens=True) for p in prompts]
    running = prepare(settings(target, draft), ServeOptions(port=0, max_batch_size=4), quiet=True, pair=pair)
    thread = threading.Thread(target=running.serve_until_stopped, daemon=True)
    thread.start()
    try:
        url, model = f"http://127.0.0.1:{running.sock.getsockname()[1]}", running.state.model_id
        for method in ("plain", "chain"):
            for _ in range(2):
                assert [_complete(url, running.token, model, t, method) for t in texts] == expected
            with ThreadPoolExecutor(len(texts)) as pool:
                assert (
                    list(pool.map(lambda t: _complete(url, running.token, model, t, method), texts))
                    == expected
                )
    finally:
        running.should_exit = True
        thread.join(timeout=30)


# -- sampling -----------------------------------------------------------------------------------

SAMPLING = SamplingConfig(temperature=1.0, top_p=0.95)
ROWS = 1200
LAW_PROMPT = "windows!!!!!!"  # 13 tokens: longer than the window


def _first_two(pair, seed: int) -> torch.Tensor:
    """The first two tokens of ROWS chain generations of LAW_PROMPT, 300 rows at a time."""
    from specgen.decoding.build import build_engine
    from specgen.decoding.events import Finished

    prompt = pair.target.tokenizer.encode(LAW_PROMPT)
    config = GenerationConfig(
        method=Method.CHAIN,
        max_new_tokens=2,
        draft_tokens=3,
        sampling=dataclasses.replace(SAMPLING, seed=seed),
    )
    engine = build_engine(pair, config)
    engine.stop_ids = frozenset()
    finished = {
        r.index: r.state.ids[-2:]
        for r in engine.generate([prompt] * ROWS, config, 300)
        if isinstance(r.event, Finished)
    }
    return torch.tensor([finished[i] for i in range(ROWS)])


def _pair_pvalue(pair, tokens: torch.Tensor) -> float:
    from test_statistical import gof_pvalue
    from tiny import two_token_law

    _, joint = two_token_law(pair.target.model, pair.target.tokenizer.encode(LAW_PROMPT), SAMPLING)
    return gof_pvalue(tokens[:, 0] * joint.shape[0] + tokens[:, 1], joint.flatten())


@pytest.mark.statistical
@pytest.mark.parametrize("family", FAMILIES)
def test_chain_sampling_follows_the_target_law(family, family_root):
    """1200 batched chain generations: (token 1, token 2) ~ the target's exact two-token law from
    full forwards without a cache. alpha = 1e-3."""
    target, draft = saved(family_root, family)
    pair = load(settings(target, draft), Method.CHAIN, quiet=True)
    pvalue = _pair_pvalue(pair, _first_two(pair, seed=31))
    assert pvalue > 1e-3, f"p-value {pvalue:.3g}"


@pytest.mark.statistical
def test_control_a_cache_that_ignores_windows_fails(family_root, monkeypatch):
    """Negative control: Mistral with its sliding window ignored by the cache's masks (the old
    behaviour) fails the same test, so the test can see a window."""
    import specgen.runtime.kvcache as kvcache
    from specgen.models import families

    real = families.windows
    monkeypatch.setattr(kvcache, "windows", lambda config: {kind: None for kind in real(config)})
    monkeypatch.setattr("specgen.runtime.pair.require_exact", lambda *args: None)
    target, draft = saved(family_root, "mistral")
    pair = load(settings(target, draft), Method.CHAIN, quiet=True)
    pvalue = _pair_pvalue(pair, _first_two(pair, seed=31))
    assert pvalue < 1e-3, f"the window-blind cache passed: p-value {pvalue:.3g}"


# -- what cannot be exact is refused ----------------------------------------------------------


def _saved_config(root, config, name: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return save(root / name, AutoModelForCausalLM.from_config(config).eval())


def test_an_unchecked_architecture_the_probe_proves_runs(family_root, prompts):
    """OLMo 3 is not in the matrix; its probe passes at load, and it is exact."""
    import transformers

    from specgen.models.families import CHECKED

    config = transformers.Olmo3Config(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=WINDOW,
        eos_token_id=258,
        pad_token_id=256,
        bos_token_id=None,
    )
    assert config.model_type not in CHECKED
    target = _saved_config(family_root, config, "olmo3")
    pair = load(settings(target, None), Method.PLAIN, quiet=True)
    assert_identical(
        pair, prompts, [Case(Method.PLAIN), Case(Method.PLAIN, Path.BATCHED), Case(Method.LOOKUP)]
    )


def test_alibi_is_refused_at_load_in_one_line(family_root):
    """MPT's ALiBi biases attention by slot distance, which a tree's slots do not keep: the probe
    finds its tree logits wrong, and the load is refused, naming what failed."""
    import transformers

    config = transformers.MptConfig(
        vocab_size=259, d_model=64, n_heads=4, n_layers=2, max_seq_len=256, eos_token_id=258, pad_token_id=256
    )
    target = _saved_config(family_root, config, "mpt")
    with pytest.raises(ModelError) as raised:
        load(settings(target, None), Method.PLAIN, quiet=True)
    message = str(raised.value)
    assert "'mpt'" in message and "tree logits differ" in message and "\n" not in message


def test_unknown_layer_types_are_refused_at_load(family_root):
    """A layer kind specgen does not run (Llama 4's chunked attention) is named in the refusal."""
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=258,
        layer_types=["full_attention", "chunked_attention"],
    )
    target = _saved_config(family_root, config, "chunked")
    with pytest.raises(ModelError, match="layers of type chunked_attention"):
        load(settings(target, None), Method.PLAIN, quiet=True)


def test_a_longrope_model_is_kept_to_its_original_context(family_root, capsys):
    """Phi-3's longrope rotates by each forward's longest position past its original context,
    so specgen caps the context there (and says so) rather than lose exactness."""
    import transformers
    from families import _common

    config = transformers.Phi3Config(
        **_common(
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0] * 8,
                "long_factor": [4.0] * 8,
            },
        )
    )
    target = _saved_config(family_root, config, "phi3-longrope")
    pair = load(settings(target, None), Method.PLAIN, quiet=False)
    assert pair.target.context_length == 64
    assert "runs up to 64 tokens" in capsys.readouterr().err
