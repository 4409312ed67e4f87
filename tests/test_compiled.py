"""Fixed-shape steps (the CUDA-graph path) decide exactly what the eager path decides.

On the CPU the `fixed` mode runs the very code that is captured on a GPU (attention over the
whole preallocated capacity, tree forwards padded to a fixed width) eagerly; the gpu-marked
tests capture it as CUDA graphs (and with torch.compile) and compare with eager on the device.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from test_engine import PROMPT, reference_greedy
from tiny import batch_ids, decode, engine_with

import specgen
from specgen.config import GenerationConfig, Method, SamplingConfig
from specgen.decoding.engine import Engine
from specgen.errors import ConfigError
from specgen.runtime import kvcache
from specgen.runtime.compiled import Steps, resolve_compile

CONFIGS = [
    GenerationConfig(method=Method.PLAIN, max_new_tokens=24),
    GenerationConfig(method=Method.CHAIN, max_new_tokens=24, draft_tokens=3),
    GenerationConfig(method=Method.CHAIN, max_new_tokens=24, draft_tokens=1),
    GenerationConfig(method=Method.RSD_C, max_new_tokens=24, branching=(2, 2, 1)),
    GenerationConfig(method=Method.RSD_S, max_new_tokens=24, beam_width=2, depth=3),
    GenerationConfig(method=Method.LOOKUP_CHAIN, max_new_tokens=24, draft_tokens=3),
]


def generate(pair, config, mode, prompt=PROMPT, engine=None):
    if engine is None:
        engine = engine_with(pair, config, stop_ids=frozenset(), compile=mode)
    rounds, _ = decode(engine, prompt, config)
    return (
        [t for r in rounds for t in r.emitted],
        [(tuple(r.draft_tokens), r.accepted) for r in rounds],
        engine,
    )


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.method.value + str(c.draft_tokens))
def test_fixed_shapes_decide_what_eager_decides(tiny_pair, config):
    fixed, fixed_rounds, _ = generate(tiny_pair, config, "fixed")
    eager, eager_rounds, _ = generate(tiny_pair, config, "off")
    assert fixed == eager == reference_greedy(tiny_pair[0].model, PROMPT, 24)
    assert fixed_rounds == eager_rounds  # same drafts, same verdicts: both caches exact


def test_fixed_shape_sampling_follows_the_same_draws(tiny_pair):
    config = GenerationConfig(
        method=Method.CHAIN,
        max_new_tokens=20,
        draft_tokens=3,
        sampling=SamplingConfig(temperature=0.9, seed=5),
    )
    fixed, _, _ = generate(tiny_pair, config, "fixed")
    eager, _, _ = generate(tiny_pair, config, "off")
    assert fixed == eager


def test_fixed_engine_is_reused_across_prompts_and_growth(tiny_pair, monkeypatch):
    """One engine, one preallocated cache: shorter and longer prompts, and a cache that grows."""
    monkeypatch.setattr(kvcache, "MIN_CAPACITY", 16)
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=12, draft_tokens=4)
    _, _, engine = generate(tiny_pair, config, "fixed")
    for prompt in (PROMPT[:4], PROMPT * 15, PROMPT[::-1]):
        tokens, _, _ = generate(tiny_pair, config, "fixed", prompt, engine)
        assert tokens == reference_greedy(tiny_pair[0].model, prompt, 12)
    assert engine.cache.capacity >= len(PROMPT) * 15 + 12  # grew from 16, keeping what it held


def test_full_capacity_view_equals_exact_view(tiny_pair):
    model = tiny_pair[0].model
    eager, fixed = kvcache.new_cache(model), kvcache.new_cache(model)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        kvcache.forward(model, eager, ids)
        kvcache.forward(model, fixed, ids)
        step = torch.tensor([[5, 6, 7]])
        a = Steps(model, "off").forward(eager, step)
        b = Steps(model, "fixed").forward(fixed, step)
    assert fixed.capacity > len(PROMPT) + 3
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert eager.lengths == fixed.lengths == [len(PROMPT) + 3]


def test_compile_setting():
    assert resolve_compile("auto", "cpu") == "off"
    assert resolve_compile("auto", "cuda") == "inductor"
    assert resolve_compile("on", "cuda") == "inductor"
    assert resolve_compile("graphs", "cuda") == "graphs"
    assert resolve_compile("off", "cuda") == "off"
    assert resolve_compile("inductor", "cpu") == "inductor"
    with pytest.raises(ConfigError):
        resolve_compile("graphs", "cpu")
    with pytest.raises(ConfigError):
        resolve_compile("sometimes", "cpu")


def test_cli_rejects_a_bad_compile_value(tiny_dirs):
    from typer.testing import CliRunner

    from specgen.cli import app

    result = CliRunner().invoke(
        app,
        [
            "run",
            "hello",
            "--target",
            str(tiny_dirs["target"]),
            "--draft",
            str(tiny_dirs["draft"]),
            "--compile",
            "sometimes",
            "--format",
            "plain",
        ],
    )
    assert result.exit_code != 0
    assert "--compile" in result.output and "Traceback" not in result.output


def test_split_model_degrades_to_eager_with_a_notice(tiny_pair):
    model = tiny_pair[0].model
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}
    try:
        steps = Steps(model, "graphs")
    finally:
        del model.hf_device_map
    assert steps.mode == "off" and "several devices" in steps.notice


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["graphs", "inductor"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.method.value + str(c.draft_tokens))
def test_cuda_graphs_decide_what_eager_decides(tiny_dirs, config, mode):
    from specgen.models.load import load_pair

    pair = load_pair(
        str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cuda", dtype="float32", quiet=True
    )
    captured, captured_rounds, engine = generate(pair, config, mode)
    assert engine.steps.mode == mode
    eager, eager_rounds, _ = generate(pair, config, "off")
    assert captured == eager
    assert captured_rounds == eager_rounds
    again, _, _ = generate(pair, config, mode, engine=engine)  # replays, no new capture
    assert again == eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["graphs", "inductor"])
def test_cuda_graphs_survive_a_cache_that_grows_between_generations(tiny_dirs, monkeypatch, mode):
    """A reused engine (chat, `specgen serve`) whose next generation needs a larger cache: the
    stale graphs go, new ones are captured, and they still decide what eager decides."""
    from specgen.models.load import load_pair

    monkeypatch.setattr(kvcache, "MIN_CAPACITY", 16)
    pair = load_pair(
        str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cuda", dtype="float32", quiet=True
    )
    config = GenerationConfig(method=Method.CHAIN, max_new_tokens=12, draft_tokens=3)
    _, _, engine = generate(pair, config, mode, PROMPT[:4])
    for prompt in (PROMPT * 4, PROMPT * 15, PROMPT[::-1]):
        tokens, _, _ = generate(pair, config, mode, prompt, engine)
        eager, _, _ = generate(pair, config, "off", prompt)
        assert tokens == eager
    assert engine.cache.capacity >= len(PROMPT) * 15 + 12


@pytest.mark.parametrize("method", ["chain", "rsd-c"])
def test_fixed_shapes_in_a_batch_decide_what_eager_decides(tiny_pair, method):
    from test_batch import PROMPTS

    outputs = {}
    for mode in ("fixed", "off"):
        config = GenerationConfig(method=Method(method), max_new_tokens=12, draft_tokens=3, branching=(2, 2))
        engine = engine_with(tiny_pair, config, stop_ids=frozenset(), compile=mode)
        outputs[mode] = batch_ids(engine, PROMPTS, config, 3)
    assert outputs["fixed"] == outputs["off"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["graphs", "inductor"])
@pytest.mark.parametrize("method", ["chain", "rsd-c"])
def test_cuda_graphs_in_a_batch_decide_what_eager_decides(tiny_dirs, method, mode):
    from test_batch import PROMPTS

    from specgen.models.load import load_pair

    pair = load_pair(
        str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cuda", dtype="float32", quiet=True
    )
    config = GenerationConfig(method=Method(method), max_new_tokens=12, draft_tokens=3, branching=(2, 2))
    outputs = {}
    for run in (mode, "off"):
        engine = engine_with(pair, config, stop_ids=frozenset(), compile=run)
        outputs[run] = batch_ids(engine, PROMPTS, config, 3)
    assert outputs[mode] == outputs["off"]


def mixed_batch(target, draft, mode: str) -> dict[int, list[int]]:
    """Rows of every method in one batch (drafters/mixed.py), its steps in `mode`: each row's
    final tokens."""
    from test_mixed import MIXES, PROMPTS, run

    from specgen.decoding.build import build_engine
    from specgen.runtime.pair import Pair

    configs = MIXES["every method"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(configs))]
    finals, widths = run(build_engine(Pair(target, draft, mode), configs[0]), configs, prompts, len(configs))
    assert all(len(configs) in w for w in widths.values())  # one batch: every row saw all of them
    return finals


def test_fixed_shapes_in_a_mixed_batch_decide_what_eager_decides(tiny_pair):
    """The code a GPU captures, eagerly on the CPU, for a batch whose rows each draft their own
    way (plain, chain, lookup, trees, a deterministic row)."""
    assert mixed_batch(*tiny_pair, "fixed") == mixed_batch(*tiny_pair, "off")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["graphs", "inductor"])
def test_cuda_graphs_in_a_mixed_batch_decide_what_eager_decides(tiny_dirs, mode):
    """`specgen serve` on a GPU batches rows of every method together under captured steps: each
    row gives what the same batch gives eagerly, and that is plain decoding's tokens."""
    from test_mixed import MIXES, PROMPTS, alone

    from specgen.models.load import load_pair
    from specgen.runtime.pair import Pair

    target, draft = load_pair(
        str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cuda", dtype="float32", quiet=True
    )
    captured = mixed_batch(target, draft, mode)
    assert captured == mixed_batch(target, draft, "off")
    eager = Pair(target, draft, "off")
    for i, config in enumerate(MIXES["every method"]):
        assert captured[i] == alone(eager, config, PROMPTS[i % len(PROMPTS)]), (
            f"row {i} ({config.method.value})"
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["chain", "rsd-c", "lookup-chain"])
def test_cli_on_cuda_prints_what_plain_decoding_prints(tiny_dirs, method):
    """What a user runs: `specgen run --device cuda` (compile auto, so compiled on CUDA)."""
    from typer.testing import CliRunner

    from specgen.cli import app

    outputs = {}
    for m in ("plain", method):
        result = CliRunner().invoke(
            app,
            [
                "run",
                "def add(a, b):",
                "--target",
                str(tiny_dirs["target"]),
                "--draft",
                str(tiny_dirs["draft"]),
                "--device",
                "cuda",
                "--method",
                m,
                "-n",
                "24",
                "-k",
                "3",
                "--format",
                "plain",
            ],
        )
        assert result.exit_code == 0, result.output
        outputs[m] = result.stdout  # the text; progress and statistics go to stderr
    assert outputs[method] == outputs["plain"] and outputs["plain"].strip()


class EagerGraph:
    """Stands in for a captured CUDA graph on the CPU: runs eagerly, and fails if the cache's
    buffers are not the ones it was 'captured' with (a replay would then use freed memory)."""

    def __init__(self, model, cache, input_ids, bases, offset, depth, tree, keep, pool):
        from specgen.runtime import kvcache as kv

        self.run = lambda ids, b, d, t: kv.run(model, cache, ids, b, offset, d, t, cache.capacity, keep)
        self.cache = cache
        self.first = self.run(input_ids, bases, depth, tree)
        self.buffers = [layer.keys for layer in cache.layers]

    def __call__(self, input_ids, bases, depth, tree):
        if self.first is not None:
            first, self.first = self.first, None
            return first
        for layer, captured in zip(self.cache.layers, self.buffers):
            assert layer.keys is captured, "a graph replayed over reallocated cache buffers"
        return self.run(input_ids, bases, depth, tree)


@pytest.mark.parametrize("method", ["chain", "rsd-c"])
def test_graph_keys_follow_cache_reallocation(tiny_pair, method, monkeypatch):
    """Rows joining and leaving reallocate the batch cache: graphs captured before must not be
    replayed (on a GPU that replay read freed buffers and changed tokens)."""
    from test_batch import PROMPTS

    import specgen.runtime.compiled as compiled

    monkeypatch.setattr(compiled, "GraphStep", EagerGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    real_init = compiled.Steps.__init__

    def on_cuda(self, *args, **kwargs):  # every Steps (target, drafter, each row's tree drafter)
        real_init(self, *args, **kwargs)
        self.cuda = True  # takes the capture path, with the stand-in above

    monkeypatch.setattr(compiled.Steps, "__init__", on_cuda)
    config = GenerationConfig(method=Method(method), max_new_tokens=12, draft_tokens=3, branching=(2, 2))
    outputs = {}
    for mode in ("graphs", "off"):
        engine = engine_with(tiny_pair, config, stop_ids=frozenset(), compile=mode)
        outputs[mode] = batch_ids(engine, PROMPTS, config, 3)
    assert outputs["graphs"] == outputs["off"]


def test_capture_time_is_reported_apart_from_decoding(tiny_pair, monkeypatch):
    """The first use of a shape (capture, compilation) goes to setup_seconds, not to decode speed."""
    import specgen.runtime.compiled as compiled
    from specgen.cli.render import JsonRenderer
    from specgen.decoding.run import generate as run_generation

    monkeypatch.setattr(compiled, "GraphStep", EagerGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    target = tiny_pair[0]
    engine = Engine(target.model, target.device, frozenset(), target.context_length, compile="graphs")
    engine.steps.cuda = True
    config = GenerationConfig(method=Method.PLAIN, max_new_tokens=8)
    first = run_generation(engine, target.tokenizer, PROMPT, config, JsonRenderer(io.StringIO()))
    again = run_generation(engine, target.tokenizer, PROMPT, config, JsonRenderer(io.StringIO()))
    assert first.stats.setup_seconds > 0 and again.stats.setup_seconds == 0  # one capture, then replays
    stats = first.stats.as_dict()
    assert stats["decode_seconds"] == pytest.approx(
        stats["seconds"] - stats["prefill_seconds"] - stats["setup_seconds"], abs=1e-3
    )


def test_eager_runs_leave_the_cache_write_unwrapped_until_something_compiles():
    """torch.compiler.disable imports torch._dynamo (a second or more of a start where nothing
    else needs it): SlotCache.update is wrapped when a model is first compiled, never on import.
    (transformers' own modeling code imports torch._dynamo today; specgen adds no import of it.)"""
    import subprocess
    import sys

    from tiny import build_model

    from specgen.runtime.compiled import compile_layers

    probe = (
        "import specgen.decoding.run, specgen.runtime.pair, specgen.cli; "
        "from specgen.runtime.kvcache import SlotCache; "
        "print(not getattr(SlotCache.update, '_specgen_disabled', False))"
    )
    assert (
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "True"
    )
    sources = Path(specgen.__file__).parent.rglob("*.py")
    assert not [f for f in sources if "import torch._dynamo\n" in f.read_text() and f.name != "compiled.py"]
    compile_layers(build_model(9, layers=1))  # compiles lazily: nothing runs here
    assert getattr(kvcache.SlotCache.update, "_specgen_disabled", False)


def test_compiled_layers_use_a_persistent_cache_that_says_whether_it_is_warm(tmp_path, monkeypatch, capsys):
    """inductor's caches live in $SPECGEN_CACHE/compile/torch-<version> (not /tmp), unless the
    user set TORCHINDUCTOR_CACHE_DIR; a cold cache is said once, so a slow first start explains
    itself. (A second compiled process loading from it: test_a_second_compiled_run_loads_...)"""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from specgen.runtime import compile_cache

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what inductor writes itself
    monkeypatch.setattr(compile_cache, "_said", False)
    ours = tmp_path / "compile" / f"torch-{torch.__version__}"
    assert compile_cache.use_persistent_cache() is compile_cache.CompileCache.COLD
    assert compile_cache.directory() == ours and torch._inductor.config.fx_graph_cache
    assert "no compile cache yet" in capsys.readouterr().err
    (ours / "fxgraph" / "ab").mkdir(parents=True)
    monkeypatch.setattr(compile_cache, "_said", False)
    assert compile_cache.use_persistent_cache() is compile_cache.CompileCache.WARM
    assert "from the compile cache" in capsys.readouterr().err
    assert compile_cache.use_persistent_cache() is compile_cache.CompileCache.WARM
    assert capsys.readouterr().err == ""  # said once per process
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.directory() == tmp_path / "mine"


@pytest.mark.slow
def test_a_second_compiled_run_loads_the_first_ones_compiled_layers(tiny_dirs, tmp_path):
    """Two processes with --compile inductor on the CPU: the first compiles and stores, the
    second loads (on this 2-core VM, tiny models: 119 s then 28 s while other jobs ran)."""
    import subprocess
    import sys

    env = dict(__import__("os").environ, SPECGEN_CACHE=str(tmp_path))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    command = [
        sys.executable,
        "-m",
        "specgen",
        "run",
        "hello",
        "--target",
        str(tiny_dirs["target"]),
        "--draft",
        str(tiny_dirs["draft"]),
        "--compile",
        "inductor",
        "--device",
        "cpu",
        "-n",
        "4",
        "--format",
        "plain",
    ]
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert "no compile cache yet" in first.stderr and "from the compile cache" in second.stderr
    assert first.stdout == second.stdout
    assert any((tmp_path / "compile").rglob("fxgraph/*"))
