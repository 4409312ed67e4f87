"""Synthetic acceptance (benchmarks only): each chain round accepts a length replayed from a
recorded accepted-length histogram, clipped to what it drafted, and the target adds its own token.
The engine, caches and statistics run as for real acceptances (specgen/decoding/synthetic.py)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from scipy.stats import chisquare
from test_engine import PROMPT
from tiny import engine_with

from specgen.config import Acceptance, AcceptanceMode, GenerationConfig, Method, SamplingConfig
from specgen.decoding import synthetic
from specgen.decoding.events import Finished, RoundResult
from specgen.decoding.run import fold, timed
from specgen.errors import ConfigError

PROMPTS = [
    PROMPT,
    [257, 72, 101, 108, 108, 111, 44, 32],
    [257, 100, 101, 102, 32, 102, 40, 120, 41, 58],
    [257, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74],
    [257, 116, 104, 101, 32, 99, 97, 116],
    [257, 49, 50, 51, 52, 53],
    [257, 120, 121, 122, 32, 120, 121, 122, 32],
    [257, 33, 63, 33, 63, 33],
]
RECORDED = {0: 6, 1: 7, 2: 5, 3: 4, 4: 41}  # the default pair's chain rounds at k=4 (quick-greedy.json)
ROOT = Path(__file__).resolve().parents[1]


def recording(histogram: dict[int, int], k: int = 4, seed: int = 0) -> Acceptance:
    lengths = tuple(sorted(histogram))
    return Acceptance(
        AcceptanceMode.SYNTHETIC, lengths, tuple(histogram[a] for a in lengths), k, seed, "test"
    )


def config(acceptance: Acceptance, method: Method = Method.CHAIN, **kwargs) -> GenerationConfig:
    kwargs.setdefault("max_new_tokens", 40)
    return GenerationConfig(method=method, acceptance=acceptance, **kwargs)


def run_one(pair, prompt, cfg):
    """(final ids, Stats, rounds) of one prompt through the one driver."""
    engine = engine_with(pair, cfg, stop_ids=frozenset())
    rounds = []
    stats = None
    for report, stats in fold(engine, engine.generate([prompt], cfg), cfg.method.value):
        if isinstance(report.event, RoundResult):
            rounds.append(report.event)
    return [t for r in rounds for t in r.emitted], stats, rounds


def run_batch(pair, prompts, cfg, batch_size):
    """{index: (generated ids, rounds)} of a batched run."""
    engine = engine_with(pair, cfg, stop_ids=frozenset())
    rounds: dict[int, list[RoundResult]] = {}
    ids = {}
    for report in engine.generate(prompts, cfg, batch_size):
        if isinstance(report.event, RoundResult):
            rounds.setdefault(report.index, []).append(report.event)
        elif isinstance(report.event, Finished):
            ids[report.index] = report.state.ids[len(prompts[report.index]) :]
    return {i: (ids[i], rounds[i]) for i in ids}


def test_all_zeros_is_plain_decoding(tiny_pair):
    plain, _, _ = run_one(tiny_pair, PROMPT, GenerationConfig(method=Method.PLAIN, max_new_tokens=40))
    out, stats, rounds = run_one(tiny_pair, PROMPT, config(recording({0: 9})))
    assert out == plain
    assert stats.accepted == 0 and stats.drafted > 0 and all(r.accepted == 0 for r in rounds)
    assert stats.tokens_per_target_forward == 1.0


@pytest.mark.parametrize("length", [1, 2, 4])
@pytest.mark.parametrize("k", [1, 3, 4])
def test_single_length_accepts_min_of_length_and_k(tiny_pair, length, k):
    _, stats, rounds = run_one(tiny_pair, PROMPT, config(recording({length: 3}), draft_tokens=k))
    full = [r for r in rounds if len(r.draft_tokens) == k]
    made = 0
    for i, r in enumerate(rounds):  # the first round drafts nothing (engine.PROMPT_CATCH_UP), a
        assert len(r.draft_tokens) == (min(k, 40 - made - 1) if i else 0)  # later one fewer only
        made += len(r.emitted)  # near the length limit
    assert len(full) >= len(rounds) - 1 - k
    assert all(r.accepted == min(length, k) for r in full)
    assert all(r.accepted == min(length, len(r.draft_tokens)) for r in rounds)
    drafted = sum(len(r.draft_tokens) for r in rounds)
    assert stats.drafted == drafted and stats.accepted == sum(r.accepted for r in rounds)
    assert stats.acceptance_rate == pytest.approx(
        sum(min(length, len(r.draft_tokens)) for r in rounds) / drafted
    )
    if len(full) == len(rounds) - 1:
        assert stats.acceptance_rate == pytest.approx(min(length, k) / k)
    assert stats.tokens_per_target_forward == pytest.approx(40 / len(rounds))
    assert all(
        r.emitted[:-1] == list(r.draft_tokens[: r.accepted]) for r in rounds
    )  # drafts kept, then the target's


@pytest.mark.statistical
def test_accepted_lengths_follow_the_recording(tiny_pair):
    results = run_batch(tiny_pair, PROMPTS, config(recording(RECORDED), max_new_tokens=200), batch_size=4)
    observed = Counter(
        r.accepted for _, rounds in results.values() for r in rounds if len(r.draft_tokens) == 4
    )
    total = sum(observed.values())
    assert total > 300
    counts = [observed[a] for a in range(5)]

    def p_value(histogram):
        weights = [histogram.get(a, 0) for a in range(5)]
        return chisquare(counts, [total * w / sum(weights) for w in weights]).pvalue

    assert p_value(RECORDED) > 0.01
    assert p_value({0: 20, 1: 10, 2: 10, 3: 10, 4: 13}) < 1e-6  # negative control: another histogram


def test_draws_follow_the_recording_without_a_model():
    acceptance = recording(RECORDED, seed=5)
    counts = Counter(
        synthetic.draw(acceptance, index, position) for index in range(4) for position in range(5000)
    )
    expected = [20000 * RECORDED[a] / sum(RECORDED.values()) for a in range(5)]
    assert chisquare([counts[a] for a in range(5)], expected).pvalue > 0.01
    assert synthetic.expected_accepted(acceptance, 2) == pytest.approx((7 + 2 * 50) / 63)


@pytest.mark.parametrize("method", [Method.CHAIN, Method.LOOKUP_CHAIN])
def test_batched_rows_replay_what_they_replay_alone(tiny_pair, method):
    cfg = config(recording({0: 1, 1: 1, 3: 2}), method, draft_tokens=3, max_new_tokens=30)
    alone = run_batch(tiny_pair, PROMPTS[:3], cfg, batch_size=1)
    batched = run_batch(tiny_pair, PROMPTS[:3], cfg, batch_size=2)
    for i in range(3):
        assert batched[i][0] == alone[i][0]
        assert [r.accepted for r in batched[i][1]] == [r.accepted for r in alone[i][1]]
        assert all(r.accepted in (0, 1, 3) or r.accepted == len(r.draft_tokens) for r in batched[i][1])
    assert sum(r.accepted for _, rounds in batched.values() for r in rounds) > 0


def test_batched_all_zeros_is_plain_decoding(tiny_pair):
    plain = run_batch(tiny_pair, PROMPTS[:3], GenerationConfig(method=Method.PLAIN, max_new_tokens=20), 3)
    replayed = run_batch(tiny_pair, PROMPTS[:3], config(recording({0: 1}), max_new_tokens=20), 3)
    assert all(replayed[i][0] == plain[i][0] for i in range(3))


def test_sampling_is_reproducible_and_replays_the_lengths(tiny_pair):
    cfg = config(recording({2: 1}), sampling=SamplingConfig(temperature=0.8, seed=3), max_new_tokens=30)
    first, _, rounds = run_one(tiny_pair, PROMPT, cfg)
    again, _, _ = run_one(tiny_pair, PROMPT, cfg)
    assert first == again
    assert all(r.accepted == min(2, len(r.draft_tokens)) for r in rounds)


def test_timed_counts_as_usual(tiny_pair):
    cfg = config(recording({3: 1}), draft_tokens=3, max_new_tokens=32)
    ids, stats, _, _ = timed(engine_with(tiny_pair, cfg, stop_ids=frozenset()), PROMPT, cfg)
    # a plain first round (engine.PROMPT_CATCH_UP), 7 rounds of 3 + 1, a last one of 2 + 1
    assert len(ids) == 32 and stats.rounds == 9 and stats.accepted == 23 and stats.acceptance_rate == 1.0


# -- recordings and settings refused in one line --------------------------------------------------
def bench_json(tmp_path, measurements, settings=None) -> Path:
    path = tmp_path / "bench.json"
    path.write_text(
        json.dumps(
            {
                "schema": "specgen-bench/1",
                "settings": settings or {"draft_tokens": 4},
                "measurements": measurements,
            }
        )
    )
    return path


def test_loads_the_bench_json_of_the_default_pair():
    acceptance = synthetic.parse(str(ROOT / "benchmarks/results/quick-greedy.json"))
    assert acceptance.mode is AcceptanceMode.SYNTHETIC and acceptance.draft_tokens == 4
    assert dict(zip(acceptance.lengths, acceptance.rounds)) == RECORDED
    lookup = synthetic.parse(str(ROOT / "benchmarks/results/quick-greedy.json") + ":lookup")
    assert lookup.source.endswith(":lookup") and lookup.rounds != acceptance.rounds


def test_pools_prompts_and_reads_a_variants_k(tmp_path):
    path = bench_json(
        tmp_path,
        [
            {"method": "chain/k2", "accepted_length_histogram": {"0": 1, "2": 3}},
            {"method": "chain/k2", "accepted_length_histogram": {"1": 2, "2": 1}},
            {"method": "chain", "accepted_length_histogram": {"4": 9}},
        ],
    )
    acceptance = synthetic.parse(f"{path}:chain/k2")
    assert (acceptance.lengths, acceptance.rounds, acceptance.draft_tokens) == ((0, 1, 2), (1, 2, 4), 2)


def test_a_heads_variant_reads_its_k_not_the_heads_path(tmp_path):
    """'eagle/k2@/heads/coder': the k is the variant's; the slashes of the head's path are no variants."""
    path = bench_json(
        tmp_path, [{"method": "eagle/k2@/heads/coder", "accepted_length_histogram": {"0": 3, "1": 1}}]
    )
    acceptance = synthetic.parse(f"{path}:eagle/k2@/heads/coder")
    assert (acceptance.lengths, acceptance.rounds, acceptance.draft_tokens) == ((0, 1), (3, 1), 2)


@pytest.mark.parametrize(
    "content, spec_suffix, message",
    [
        (None, "", "cannot read it"),
        ("not json {", "", "not a JSON file"),
        (json.dumps({"schema": "other"}), "", "not a `specgen bench --json` file"),
        ("BENCH", ":lookup", "no accepted lengths recorded for 'lookup'; recorded: chain"),
        ("BENCH", ":rsd-c", "not a chain method"),
        ("BENCH", ":chain/additive", "varying lengths"),
        ("BADKEYS", "", "is not {length: rounds}"),
        ("TOOLONG", "", "must be distinct, ascending and in 0..4"),
        ("NOK", "", "do not say the draft length"),
    ],
)
def test_a_bad_recording_is_one_config_error_line(tmp_path, content, spec_suffix, message):
    path = tmp_path / "rec.json"
    good = [{"method": "chain", "accepted_length_histogram": {"1": 2}}]
    if content == "BENCH":
        bench_json(tmp_path, good).rename(path)
    elif content == "BADKEYS":
        bench_json(tmp_path, [{"method": "chain", "accepted_length_histogram": {"x": 2}}]).rename(path)
    elif content == "TOOLONG":
        bench_json(tmp_path, [{"method": "chain", "accepted_length_histogram": {"7": 2}}]).rename(path)
    elif content == "NOK":
        bench_json(tmp_path, good, settings={"schedule": "fixed"}).rename(path)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as error:
        synthetic.parse(f"{path}{spec_suffix}")
    text = str(error.value)
    assert "\n" not in text and text.startswith(f"--synthetic {path}") and message in text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(method=Method.RSD_C), "drafts trees"),
        (dict(deterministic=True), "turn --deterministic off"),
        (dict(draft_tokens=6), "recorded at k=4 cannot drive k=6"),
    ],
)
def test_settings_synthetic_acceptance_cannot_drive(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        GenerationConfig(acceptance=recording(RECORDED), **kwargs)
    with pytest.raises(ConfigError, match="takes no recording"):
        Acceptance(AcceptanceMode.REAL, (1,), (1,), 4)


def test_only_benchmarks_reach_it():
    """run, chat, serve and bench build configs with real acceptance; no front end names the mode."""
    assert GenerationConfig().acceptance.mode is AcceptanceMode.REAL
    allowed = {"config.py", "decoding/synthetic.py", "decoding/verify.py", "decoding/acceptance.py"}
    package = ROOT / "specgen"
    for source in package.rglob("*.py"):
        name = source.relative_to(package).as_posix()
        if name not in allowed:
            text = source.read_text(encoding="utf-8")
            assert "SYNTHETIC" not in text and "synthetic" not in text.lower(), name
