"""Suffix decoding (decoding/drafters/suffix.py over runtime/suffix.py's memory): drafts from
what earlier requests wrote, verified as point masses. Greedy output is plain decoding's, alone,
batched, in a mixed batch and across requests that feed each other; sampled output keeps the
target's law (a chi-square test with a negative control); tenants do not share a memory under
`key`; the memory's settings and file fail in one line or a notice, never a traceback."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_lookup import STAT_PROMPT, STAT_SAMPLING, assert_two_token_law, rule_without_residual
from test_statistical import gof_pvalue
from typer.testing import CliRunner

import specgen.decoding.build as build_module
import specgen.decoding.verify as verify_module
from specgen.cli.app import app
from specgen.config import MIN_SUFFIX_MIB, SUFFIX_TOKENS, GenerationConfig, MemorySettings, Method, Scope
from specgen.decoding.build import build_engine, mixed, resolve_draft_length
from specgen.decoding.drafters.suffix import SuffixDrafter
from specgen.decoding.engine import Engine
from specgen.decoding.events import Finished, RoundResult
from specgen.errors import ConfigError
from specgen.runtime.memories import OWN, Memories, tenant_of
from specgen.runtime.pair import Pair
from specgen.runtime.suffix import SuffixMemory

# a prompt whose reply the tiny target repeats in a loop, and one of other text
PROMPTS = [
    [40, 41, 42, 43, 40, 41, 42, 43, 40, 41, 42],
    [257, 84, 82, 68, 81, 198, 71, 127, 102, 258, 198, 257, 64],
]


@pytest.fixture
def pair(tiny_pair):
    return Pair(*tiny_pair, "off")  # a fresh memory per test


def greedy(method: Method, n: int = 32, **fields) -> GenerationConfig:
    return GenerationConfig(**{"method": method, "max_new_tokens": n, "draft_tokens": 8, **fields})


def generate(pair: Pair, config: GenerationConfig, prompts: list[list[int]], batch: int = 1):
    """(each prompt's whole sequence, every round's result) through the engine users run."""
    engine = build_engine(pair, config)
    finals, rounds = {}, []
    for report in engine.generate(prompts, config, batch):
        if isinstance(report.event, Finished):
            finals[report.index] = report.state.ids
        elif isinstance(report.event, RoundResult):
            rounds.append(report.event)
    return [finals[i] for i in range(len(prompts))], rounds


def test_suffix_drafts_and_gives_plain_decoding_s_tokens_alone_and_batched(pair):
    plain, _ = generate(pair, greedy(Method.PLAIN), PROMPTS, batch=2)
    for batch in (1, 2):
        pair.memories.clear()
        got, rounds = generate(pair, greedy(Method.SUFFIX), PROMPTS, batch)
        assert got == plain
        assert any(r.draft_tokens for r in rounds)


def test_a_second_request_drafts_the_first_one_s_reply_from_the_memory(pair):
    """The same prompt again (an agent's retry): the reply comes from the memory, most rounds
    accepting many tokens, and is still plain decoding's."""
    prompt = PROMPTS[1]
    (want,), _ = generate(pair, greedy(Method.PLAIN, n=24), [prompt])
    (first,), first_rounds = generate(pair, greedy(Method.SUFFIX, n=24), [prompt])
    (second,), rounds = generate(pair, greedy(Method.SUFFIX, n=24), [prompt])
    assert first == second == want
    assert len(rounds) < len(first_rounds)
    assert len(rounds) <= 24 // 8 + 2  # whole rounds of 8 from the memory


def test_suffix_rows_share_a_batch_with_plain_and_chain_rows(pair):
    configs = [greedy(Method.SUFFIX), greedy(Method.PLAIN), greedy(Method.CHAIN, draft_tokens=3)]
    from test_mixed import alone, run

    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    engine = build_engine(pair, configs[0])
    finals, widths = run(engine, configs, prompts)
    for i, (config, prompt) in enumerate(zip(configs, prompts)):
        assert finals[i] == alone(pair, config, prompt)
    assert all(3 in w for w in widths.values())


def test_the_memory_is_written_as_tokens_are_committed_and_a_chat_turn_adds_only_what_is_new(pair):
    memories = Memories()
    drafter = SuffixDrafter(memories)
    config = GenerationConfig(method=Method.SUFFIX)
    drafter.join(0, [1, 2, 3, 4], None, 64, config)
    memory = memories.get(OWN)
    assert memory.tokens >= 4
    drafter.propose([[1, 2, 3, 4, 5, 6]], [4], [config.sampling])  # two tokens committed since
    held = memory.tokens
    assert held >= 6
    drafter.finished(0, [1, 2, 3, 4, 5, 6, 7])
    drafter.join(0, [1, 2, 3, 4, 5, 6, 7, 8, 9], None, 64, config)  # the next turn extends it
    assert memory.tokens - held <= 3 + 2  # the new tokens (and at most a separator's worth)


def test_tenants_of_different_keys_do_not_share_a_memory_unless_the_scope_says_so():
    keyed = Memories(scope=Scope.KEY)
    assert keyed.get(tenant_of("a")) is keyed.get(tenant_of("a"))
    assert keyed.get(tenant_of("a")) is not keyed.get(tenant_of("b"))
    assert tenant_of(None) == OWN and tenant_of("a") != "a"  # a digest, never the key itself
    shared = Memories(scope=Scope.SHARED)
    assert shared.get(tenant_of("a")) is shared.get(tenant_of("b"))
    request = Memories(scope=Scope.REQUEST)
    assert request.get(OWN) is not request.get(OWN)


def test_memories_of_many_tenants_stay_within_one_budget():
    memories = Memories(budget=1 << 20)
    for n in range(12):
        memory = memories.get(tenant_of(str(n)))
        doc = memory.open()
        memory.extend(doc, list(range(n, n + 30_000)))
        memories.trim()  # as a drafter does after it writes
        assert memories.nbytes <= 1 << 20


def test_the_device_default_lets_the_memory_decide_the_length(pair):
    config = GenerationConfig(method=Method.SUFFIX, device_draft_tokens=True)
    resolved, choice = resolve_draft_length(pair, config)
    assert resolved.draft_tokens == SUFFIX_TOKENS and resolved.floor and choice is None


@pytest.mark.parametrize(
    "settings",
    [
        {"suffix_cache": 0},
        {"suffix_cache": -3},
        {"suffix_cache": float("nan")},
        {"suffix_cache": 0.01},  # positive, but too small to build a memory in
        {"suffix_scope": "everyone"},
    ],
)
def test_bad_memory_settings_are_one_line(settings):
    with pytest.raises(ConfigError) as error:
        MemorySettings(**settings)
    assert "\n" not in str(error.value)


def test_the_smallest_suffix_cache_the_settings_take_builds_a_memory():
    """MIN_SUFFIX_MIB is the floor the memory itself needs: the settings take it, and a memory
    of that budget is built (half of it is refused by the memory, so the floor is not loose by
    more than 2x)."""
    budget = MemorySettings(suffix_cache=MIN_SUFFIX_MIB).budget
    assert SuffixMemory(budget).budget == budget
    with pytest.raises(ValueError, match="too small"):
        SuffixMemory(budget // 2)


@pytest.mark.parametrize("value", ["0", "-1", "lots", "0.01"])
def test_a_bad_suffix_cache_on_the_command_line_is_one_line(tiny_dirs, value):
    result = CliRunner().invoke(
        app,
        ["run", "hi", "--target", str(tiny_dirs["target"]), "--method", "suffix", "--suffix-cache", value],
    )
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    assert "--suffix-cache" in result.output


def run_suffix(tiny_dirs, path, *extra) -> str:
    args = ["run", "hello hello hello", "--target", str(tiny_dirs["target"]), "--method", "suffix"]
    result = CliRunner().invoke(
        app, [*args, "-n", "8", "--no-server", "--suffix-cache-file", str(path), *extra]
    )
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    return result.output


@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign"])
def test_a_corrupt_or_foreign_memory_file_is_rebuilt_with_a_notice(tiny_dirs, tmp_path, damage):
    from specgen.runtime import suffix_file
    from specgen.runtime.suffix import SuffixMemory

    path = tmp_path / "memory.bin"
    memory = SuffixMemory(1 << 20)
    memory.extend(memory.open(), list(range(50)))
    suffix_file.save(memory, path, "another tokenizer" if damage == "foreign" else "x")
    if damage == "garbage":
        path.write_bytes(b"\x00not a memory" * 10)
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:20])
    output = run_suffix(tiny_dirs, path)
    assert "suffix memory starts empty" in output


def test_the_memory_file_carries_text_to_the_next_run(tiny_dirs, tmp_path):
    """Written when the process ends (its own process: the file is written at exit)."""
    import subprocess
    import sys

    path = tmp_path / "memory.bin"
    args = [sys.executable, "-m", "specgen", "run", "hello hello hello", "--target", str(tiny_dirs["target"])]
    args += ["--method", "suffix", "-n", "8", "--no-server", "--suffix-cache-file", str(path)]
    for _ in range(2):
        done = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert path.exists() and path.stat().st_size > 0
        assert "starts empty" not in done.stderr and "Traceback" not in done.stderr


def test_a_seeded_sampled_row_gives_the_same_text_whatever_the_memory_holds(pair):
    """Its drafts come from its own text only: the same seed, the same tokens, before and after
    other requests filled the memory (a greedy row beside it drafts from them)."""
    from specgen.config import SamplingConfig

    seeded = greedy(Method.SUFFIX, n=24, sampling=SamplingConfig(temperature=0.9, seed=11))
    (first,), _ = generate(pair, seeded, [PROMPTS[1]])
    generate(pair, greedy(Method.SUFFIX, n=24), [PROMPTS[1], PROMPTS[0]], batch=2)  # fills the memory
    (again,), _ = generate(pair, seeded, [PROMPTS[1]])
    assert again == first


# -- trees: where verifying is nearly free, the most frequent continuations side by side ----------


def branching_memory(pair: Pair, texts: list[list[int]]) -> None:
    """Each text written to the memory, and a variant of it that continues otherwise from its
    middle on: a context there has two continuations, so a draft with branches is a tree."""
    memory = pair.memories.get(OWN)
    for ids in texts:
        half = len(ids) // 2
        memory.extend(memory.open(), ids)
        memory.extend(memory.open(), ids[:half] + [(t * 7 + 1) % 250 for t in ids[half:]])


def test_suffix_trees_give_plain_decoding_s_tokens_alone_batched_and_mixed(pair, monkeypatch):
    from test_engine import engine_for
    from test_mixed import alone, run

    import specgen.decoding.build as build_module

    plain, _ = generate(pair, greedy(Method.PLAIN), PROMPTS, batch=2)
    for batch in (1, 2):
        pair.memories.clear()
        branching_memory(pair, plain)
        engine = engine_for((pair.target, pair.draft), SuffixDrafter(pair.memories, branches=3))
        rounds = []
        finals = {}
        for report in engine.generate(PROMPTS, greedy(Method.SUFFIX), batch):
            if isinstance(report.event, Finished):
                finals[report.index] = report.state.ids
            elif isinstance(report.event, RoundResult):
                rounds.append(report.event)
        assert [finals[0], finals[1]] == plain
        assert any(r.parents and r.parents != tuple(range(len(r.parents))) for r in rounds)  # trees
    pair.memories.clear()
    branching_memory(pair, plain)
    monkeypatch.setattr(build_module, "suffix_branches", lambda p: 3)  # a tree row beside plain and chain
    configs = [greedy(Method.SUFFIX), greedy(Method.PLAIN), greedy(Method.CHAIN, draft_tokens=3)]
    finals, widths = run(build_engine(pair, configs[0]), configs, [PROMPTS[0], PROMPTS[1], PROMPTS[0]])
    for i, (config, prompt) in enumerate(zip(configs, [PROMPTS[0], PROMPTS[1], PROMPTS[0]])):
        assert finals[i] == alone(pair, config, prompt)
    assert all(3 in w for w in widths.values())


def test_suffix_drafts_trees_where_a_verified_token_costs_less_than_a_branch_is_worth(pair, monkeypatch):
    assert build_module.suffix_branches(pair) == build_module.SUFFIX_BRANCHES  # no slope measured
    monkeypatch.setattr(build_module.costs, "verify_slope", lambda p: 0.08)  # this project's CPUs
    assert build_module.suffix_branches(pair) == build_module.SUFFIX_BRANCHES
    monkeypatch.setattr(build_module.costs, "verify_slope", lambda p: 0.5)  # dearer than a branch is worth
    assert build_module.suffix_branches(pair) == 1
    monkeypatch.setenv(build_module.SUFFIX_BRANCHES_ENV, "1")  # to measure either anywhere
    assert build_module.suffix_branches(pair) == 1
    monkeypatch.setenv(build_module.SUFFIX_BRANCHES_ENV, "many")
    assert build_module.suffix_branches(pair) == 1  # ignored, with a note: the slope decides


# -- sampling: point masses from the memory keep the target's law ------------------------------------


def first_two_from_memory(pair: Pair, seeds: range) -> torch.Tensor:
    """First two tokens of generations on STAT_PROMPT ([3, 3]) with a memory that saw only
    [3, 3, 3, 3, 3, 3] (so each first round drafts [3, 3]), one per seed."""
    out, drafted = [], 0
    target = pair.target  # no stop ids: every generation yields exactly 2 tokens
    engine = Engine(target.model, target.device, frozenset(), target.context_length, mixed(pair), pair.vocab)
    for seed in seeds:
        pair.memories.clear()  # the generations before wrote their samples to it
        memory = pair.memories.get(OWN)
        memory.extend(memory.open(), [3, 3, 3, 3, 3, 3])
        config = GenerationConfig(
            method=Method.SUFFIX,
            max_new_tokens=3,
            draft_tokens=2,
            sampling=dataclasses.replace(STAT_SAMPLING, seed=seed),
        )
        rounds = [r.event for r in engine.generate([STAT_PROMPT], config) if isinstance(r.event, RoundResult)]
        drafted += len(rounds[0].draft_tokens) == 2
        out.append([t for r in rounds for t in r.emitted][:2])
    assert drafted == len(seeds)
    return torch.tensor(out)


@pytest.fixture(scope="module")
def stat_law(tiny_pair):
    from tiny import two_token_law

    return two_token_law(tiny_pair[0].model, STAT_PROMPT, STAT_SAMPLING)


@pytest.fixture
def shared_when_seeded(monkeypatch):
    """Seeded rows draft from the shared memory here (they keep to their own text otherwise, so
    that a seed replays): the law under memory drafts, reproducibly."""
    monkeypatch.setattr(GenerationConfig, "seeded", property(lambda self: False))


@pytest.mark.statistical
def test_suffix_drafts_under_sampling_follow_the_target_law(pair, stat_law, shared_when_seeded):
    tokens = first_two_from_memory(pair, range(800))
    assert_two_token_law(tokens, *stat_law)


@pytest.mark.statistical
def test_control_suffix_drafts_without_the_residual_fail(pair, stat_law, monkeypatch, shared_when_seeded):
    monkeypatch.setattr(
        verify_module, "point_mass_sampling", lambda d, q, g: rule_without_residual(d, None, q, g)
    )
    tokens = first_two_from_memory(pair, range(10_000, 10_400))
    assert gof_pvalue(tokens[:, 0], stat_law[0]) < 1e-3


# -- served: across requests, by API key ------------------------------------------------------------


def test_served_suffix_retries_draft_from_the_memory_of_their_own_key_only(tiny_dirs, tiny_pair):
    """Through `specgen serve`: a retry of a request under the same key drafts the first reply
    from the memory (fewer target forwards, the same text as plain decoding); under another
    key the memory holds none of it (`key` scope, the default)."""
    pytest.importorskip("fastapi")
    from test_server import raw, settings_for, start, stop

    running, thread = start(settings_for(tiny_dirs), Pair(*tiny_pair, "off"), api_key="second-key")
    try:
        prompt = "def add(a, b): return a + b; def sub(a, b):"

        def ask(method: str, token: str = "default") -> dict:
            body = {
                "model": running.state.model_id,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 32,
                "temperature": 0,
                "ignore_eos": True,
                "speculative": {"method": method},
            }
            status, answer, _ = raw(running, "POST", "/v1/chat/completions", body, token=token)
            assert status == 200, answer
            return answer

        plain = ask("plain")["choices"][0]["message"]["content"]
        first, retry = ask("suffix"), ask("suffix")
        assert first["choices"][0]["message"]["content"] == retry["choices"][0]["message"]["content"] == plain
        assert retry["speculative"]["target_forwards"] < first["speculative"]["target_forwards"]
        other = ask("suffix", token="second-key")  # another tenant: its own, empty memory
        assert other["choices"][0]["message"]["content"] == plain
        assert other["speculative"]["target_forwards"] == first["speculative"]["target_forwards"]
        held = running.scheduler.pair.memories
        assert {OWN, tenant_of("second-key")} <= set(held._held)
    finally:
        stop(running, thread)


# -- lookup and lookup-chain consult the memory; every view says which drafts came from it -------


@pytest.mark.parametrize("method", [Method.LOOKUP, Method.LOOKUP_CHAIN])
def test_lookup_methods_draft_an_earlier_request_s_text_from_the_memory(pair, method):
    """A second request of other text than its own prompt's: lookup finds nothing in its own
    text, the memory holds the first request's reply; the output stays plain decoding's and the
    rounds say where their drafts came from."""
    from specgen.decoding.events import Origin
    from specgen.decoding.stats import Stats

    prompt = PROMPTS[1]
    (want,), _ = generate(pair, greedy(Method.PLAIN, n=24), [prompt])
    generate(pair, greedy(method, n=24, draft_tokens=4), [prompt])  # writes the reply to the memory
    (again,), rounds = generate(pair, greedy(method, n=24, draft_tokens=4), [prompt])
    assert again == want
    assert any(r.origin is Origin.MEMORY and r.accepted for r in rounds)
    stats = Stats(method=method.value)
    for r in rounds:
        stats.add(r, 1.0)
    assert stats.as_dict()["accepted_by_origin"].get("memory", 0) > 0


def test_run_s_json_counts_accepted_tokens_by_origin(tiny_dirs):
    import json

    result = CliRunner().invoke(
        app,
        ["run", "hello hello hello hello", "--target", str(tiny_dirs["target"]), "--method", "lookup"]
        + ["-n", "16", "--no-server", "--format", "json"],
    )
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout.strip().splitlines()[-1])["stats"]
    assert set(stats["accepted_by_origin"]) <= {"model", "text", "memory"}
