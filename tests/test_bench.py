"""specgen bench on tiny models: prompt sets, ordering, medians, speed-ups, exactness, the
transformers reference methods, the JSON/CSV schema and the CLI. No timing is asserted:
fake runners report their own seconds wherever a number is checked."""

from __future__ import annotations

import csv
import dataclasses
import html.parser
import json
import math
import sys

import pytest
import typer
from typer.testing import CliRunner

from specgen.bench import measure as measuring
from specgen.bench import (
    methods,
    summary,
)
from specgen.bench import prompts as prompt_sets
from specgen.bench import report as bench_cli
from specgen.bench import runners as bench_runners
from specgen.bench import table as bench_table
from specgen.bench.measure import BenchSettings
from specgen.bench.runners import Generation
from specgen.cli.bench import bench_app
from specgen.config import GenerationConfig, Method, SamplingConfig
from specgen.decoding.prompts import PromptRecord
from specgen.decoding.stats import Stats
from specgen.errors import ConfigError, PromptError
from specgen.runtime.pair import Pair

SHORT_PROMPTS = [
    {"id": "code-1", "category": "code", "prompt": "def fib(n):"},
    {"id": "code-2", "category": "code", "prompt": "Write a loop"},
    {
        "id": "chat-1",
        "category": "chat",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "and then?"},
        ],
    },
]


def write_jsonl(path, objects):
    path.write_text("".join(json.dumps(o) + "\n" for o in objects), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return Pair(*tiny_pair)


@pytest.fixture(scope="module")
def short_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "short.jsonl", SHORT_PROMPTS)


def settings(n=8, repeats=1, warmup=False, **sampling):
    return BenchSettings(
        GenerationConfig(max_new_tokens=n, sampling=SamplingConfig(**sampling)),
        repeats=repeats,
        warmup=warmup,
        threads=1,
    )


# -- prompt sets -----------------------------------------------------------------------------
def test_a_set_by_name_and_the_documented_fields():
    quick = prompt_sets.load_prompts("quick")
    assert [p.id for p in quick][:2] == ["quick-codegen-01", "quick-codegen-02"]
    assert len(quick) == 4 and {p.category for p in quick} == {"code-generation", "explanation", "rewrite"}
    chat = prompt_sets.load_prompts("multi-turn-chat", limit=3)
    assert len(chat) == 3 and all(p.messages and p.text == "" for p in chat)
    assert chat[0].messages[-1]["role"] == "user"


def test_all_is_every_category_file_but_quick():
    every = prompt_sets.load_prompts("all")
    assert len(every) == 84 and not any(p.id.startswith("quick-") for p in every)
    assert len({p.category for p in every}) == 7
    two_each = prompt_sets.load_prompts("all", limit=2)
    assert len(two_each) == 14 and len({p.category for p in two_each}) == 7


def test_a_file_and_a_name_under_the_working_directory(tmp_path, monkeypatch, short_file):
    assert [p.id for p in prompt_sets.load_prompts(str(short_file))] == ["code-1", "code-2", "chat-1"]
    (tmp_path / "prompts").mkdir()
    write_jsonl(tmp_path / "prompts" / "mine.jsonl", SHORT_PROMPTS[:1])
    monkeypatch.chdir(tmp_path)
    assert [p.id for p in prompt_sets.load_prompts("mine")] == ["code-1"]


@pytest.mark.parametrize(
    "lines, fragment",
    [
        (['{"id": "a", "category": "c"}'], "exactly one of 'prompt' or 'messages'"),
        (['{"id": "a", "category": "c", "prompt": "x"}', "{not json"], ":2: not valid JSON"),
        (
            ['{"id": "a", "category": "c", "prompt": "x"}', '{"id": "a", "category": "c", "prompt": "y"}'],
            "appears twice",
        ),
        (['{"id": "a", "category": "c", "messages": [{"role": "user"}]}'], "'messages' must be"),
        (['{"id": "a", "category": "all", "prompt": "x"}'], "the category 'all' is the summary"),
        (['{"id": "a\\u001b[31mRED", "category": "c", "prompt": "x"}'], "'id' holds a control character"),
        (['{"id": "a", "category": "c", "prompt": "x\\ud800"}'], ":1: the text is not valid Unicode"),
    ],
)
def test_a_malformed_file_is_one_line_naming_file_and_line(tmp_path, lines, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(PromptError, match="bad.jsonl") as info:
        prompt_sets.load_prompts(str(path))
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_a_prompt_file_of_bytes_that_are_not_utf8_names_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"id": "a", "category": "c", "prompt": "x"}\n\xff\xfe\n')
    with pytest.raises(PromptError, match=r"bad.jsonl:2: not valid UTF-8 text \(byte 0xff\)"):
        prompt_sets.load_prompts(str(path))


def test_a_prompt_file_keeps_unicode_line_separators_inside_its_strings(tmp_path):
    """JSON leaves U+2028, U+0085 and \x1c unescaped in a string: they are not line ends."""
    path = tmp_path / "odd.jsonl"
    text = "one\u2028two\u0085three\x1cfour"
    path.write_text(
        json.dumps({"id": "a", "category": "c", "prompt": text}, ensure_ascii=False) + "\r\n",
        encoding="utf-8",
    )
    assert [p.text for p in prompt_sets.load_prompts(str(path))] == [text]


def test_an_unknown_set_lists_the_names():
    with pytest.raises(PromptError, match="unknown prompt set 'nope'.*code-generation.*quick.*all"):
        prompt_sets.load_prompts("nope")


def test_conversations_go_through_the_chat_template(pair):
    item = PromptRecord("c", "", 1, "chat", messages=tuple(SHORT_PROMPTS[2]["messages"]))
    tokenizer = pair.target.tokenizer
    expected = tokenizer.apply_chat_template(
        list(item.messages), add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert prompt_sets.encode(tokenizer, item) == list(expected)
    assert tokenizer.decode(prompt_sets.encode(tokenizer, item)).endswith("<|im_start|>assistant\n")


# -- ordering, medians, speed-ups (fake runners: they report their own seconds) ---------------
class FakeRunner:
    """Emits `max_new_tokens` tokens; seconds come from `times[prompt][call]`, cycling."""

    def __init__(self, name, log, times=None):
        self.name, self.log, self.times, self.calls = name, log, times or {}, {}

    def generate(self, prompt_ids, config):
        self.log.append((self.name, prompt_ids[0], config.max_new_tokens))
        n = config.max_new_tokens
        call = self.calls.get(prompt_ids[0], 0)
        self.calls[prompt_ids[0]] = call + 1
        seconds = self.times.get(prompt_ids[0], [1.0])[call % len(self.times.get(prompt_ids[0], [1.0]))]
        return Generation(list(range(n)), seconds, 0.1 * seconds, 1, Stats(method=self.name, new_tokens=n))


def fake_prompts():
    return [(PromptRecord("p1", "x", 1, "A"), [1, 9]), (PromptRecord("p2", "y", 2, "B"), [2, 9])]


def test_warmup_then_methods_interleaved_per_prompt_and_repeat_every_other_time_reversed():
    """ABBA: a machine that slows down steadily costs every method the same on average (with a
    fixed order the last method would always run on the slowest machine)."""
    log = []
    runners = [FakeRunner(name, log) for name in ("plain", "a", "b")]
    list(measuring.measure(runners, fake_prompts(), settings(n=40, repeats=2, warmup=True)))
    warm = [("plain", 1, 16), ("a", 1, 16), ("b", 1, 16)]
    forward = lambda p: [("plain", p, 40), ("a", p, 40), ("b", p, 40)]  # noqa: E731
    backward = lambda p: forward(p)[::-1]  # noqa: E731
    assert log == warm + forward(1) + backward(1) + forward(2) + backward(2)
    log.clear()  # one repeat: the order alternates over the prompts
    list(measuring.measure(runners, fake_prompts(), settings(n=40, repeats=1)))
    assert log == forward(1) + backward(2)


def test_steady_drift_costs_every_method_the_same_over_even_repeats():
    """Each run takes longer than the one before (a machine heating up): with an even number of
    repeats, every method's mean time is the same."""
    log, clock = [], iter(range(1, 100))

    class Drifting(FakeRunner):
        def generate(self, prompt_ids, config):
            gen = super().generate(prompt_ids, config)
            return dataclasses.replace(gen, seconds=float(next(clock)))

    runners = [Drifting(name, log) for name in ("plain", "a", "b")]
    runs = list(measuring.measure(runners, fake_prompts()[:1], settings(n=8, repeats=2)))
    means = {name: sum(r.seconds for r in runs if r.method == name) / 2 for name in ("plain", "a", "b")}
    assert means == {"plain": 3.5, "a": 3.5, "b": 3.5}


def test_a_column_that_raises_is_its_line_and_the_others_are_measured():
    """Not only an isolated runner's crash: any error of one column is that column's failure."""

    class Broken(FakeRunner):
        def generate(self, prompt_ids, config):
            raise ValueError("a tokenizer that cannot\ndo this")

    log, failures = [], []
    runners = [FakeRunner("plain", log), Broken("broken", log), FakeRunner("b", log)]
    runs = list(measuring.measure(runners, fake_prompts(), settings(n=4), failures=failures))
    assert [m.method for m in runs] == ["plain", "b", "b", "plain"]  # p2 runs them in reverse
    assert [(f.method, f.prompt_id, f.error) for f in failures] == [
        ("broken", "p1", "ValueError: a tokenizer that cannot")
    ]


def test_plain_always_comes_first_and_unknown_methods_are_refused():
    assert methods.parse_methods("hf-lookup,chain") == ["plain", "hf-lookup", "chain"]
    assert methods.parse_methods("chain,plain,chain") == ["plain", "chain"]
    every = methods.parse_methods(
        None
    )  # specgen's methods (eagle needs a head: not by default), then the references
    from specgen.bench import llamacpp as bench_llamacpp

    llama = list(bench_llamacpp.METHODS) if bench_llamacpp.installed() else []  # the optional extra
    assert (
        every
        == [m.value for m in Method if m is not Method.EAGLE]
        + ["hf-assisted", "hf-assisted-k4", "hf-lookup"]
        + llama
    )
    assert every[:2] == ["plain", "chain"]
    with pytest.raises(ConfigError, match="unknown method 'tree'"):
        methods.parse_methods("chain,tree")
    with pytest.raises(
        ConfigError, match="is not a variant of chain"
    ):  # a superscript: a digit to isdigit(), not to int()
        methods.parse_methods("chain/k\u00b2")


def test_medians_over_repeats():
    log = []
    runners = [FakeRunner("plain", log, {1: [1.0, 4.0, 2.0], 2: [2.0]}), FakeRunner("a", log)]
    runs = list(measuring.measure(runners, fake_prompts(), settings(n=10, repeats=3)))
    assert [m.repeat for m in runs if m.method == "plain" and m.prompt_id == "p1"] == [0, 1, 2]
    result = {(r.prompt_id, r.method): r for r in summary.per_prompt(runs, greedy=True)}
    assert result[("p1", "plain")].wall_tokens_per_second == pytest.approx(5.0)  # median of 10, 2.5, 5
    assert result[("p1", "plain")].seconds == pytest.approx(2.0)
    assert result[("p1", "plain")].ttft_seconds == pytest.approx(0.2)
    assert result[("p1", "a")].speedup == pytest.approx(10.0 / 5.0)


def test_speedup_is_per_prompt_then_a_geometric_mean():
    # plain: 10 and 40 tok/s; a: 20 and 40 tok/s -> per-prompt 2x and 1x, geo mean sqrt(2)
    # (the ratio of mean throughputs would say 30/25 = 1.2x)
    log = []
    runners = [FakeRunner("plain", log, {1: [1.0], 2: [0.25]}), FakeRunner("a", log, {1: [0.5], 2: [0.25]})]
    runs = list(measuring.measure(runners, fake_prompts(), settings(n=10)))
    prompts = summary.per_prompt(runs, greedy=True)
    rows = {(g.method, g.category): g for g in summary.summarize(runs, prompts, ["plain", "a"])}
    assert rows[("a", "all")].speedup == pytest.approx(math.sqrt(2.0))
    assert (rows[("a", "all")].speedup_min, rows[("a", "all")].speedup_max) == pytest.approx((1.0, 2.0))
    assert rows[("a", "A")].speedup == pytest.approx(2.0) and rows[("a", "B")].speedup == pytest.approx(1.0)
    assert rows[("plain", "all")].speedup == pytest.approx(1.0)
    assert rows[("a", "all")].wall_tokens_per_second == pytest.approx(math.sqrt(20 * 40))
    assert summary.geometric_mean([2.0, 8.0]) == pytest.approx(4.0)
    assert list(rows)[:3] == [("plain", "all"), ("plain", "A"), ("plain", "B")]


def test_the_read_round_is_the_first_round_a_draft_model_drafted():
    """Lookup's rounds draft from the text and read nothing; the first round the draft model
    drafts holds its read of the prompt, and it alone is kept apart (summed over generations)."""
    from specgen.decoding.events import Origin, RoundResult

    def drafted(origin, seconds, k=3):
        return RoundResult(
            list(range(k)), tuple(range(k)), (1,), 9, emitted=[0, 9], draft_seconds=seconds, origin=origin
        )

    stats = Stats(method="lookup-chain")
    for event in (drafted(Origin.TEXT, 0.001), drafted(Origin.MODEL, 0.3), drafted(Origin.MODEL, 0.05, 2)):
        stats.add(event, 1.0)
    assert (stats.read_seconds, stats.read_drafted) == (0.3, 3)
    assert stats.drafted == 8 and stats.draft_seconds == pytest.approx(0.351)
    both = stats.merge(stats)
    assert (both.read_seconds, both.read_drafted) == (0.6, 6)
    assert Stats(method="x").read_drafted == 0


def test_draft_step_is_a_draft_token_s_time_in_plain_target_forwards():
    """plain: 10 forwards in 0.5 s of verify time (0.05 s a forward); a: 20 drafted tokens in
    0.2 s of draft time (0.01 s each) after its read round -> a draft step costs 0.2 target steps."""

    class Counted(FakeRunner):
        def __init__(self, name, log, stats):
            super().__init__(name, log)
            self.stats = stats

        def generate(self, prompt_ids, config):
            n = config.max_new_tokens
            return Generation(
                list(range(n)),
                1.0,
                0.1,
                1,
                dataclasses.replace(self.stats, new_tokens=n),
                known=bench_runners.Known.FORWARDS | bench_runners.Known.DRAFTS | bench_runners.Known.TIMES,
            )

    plain = Stats(method="plain", rounds=10, verify_seconds=0.5)
    # its first model round (5 tokens in 0.1 s, mostly the draft's read of the prompt) is left out
    drafted = Stats(
        method="a",
        rounds=5,
        verify_seconds=0.3,
        drafted=25,
        accepted=10,
        draft_seconds=0.3,
        read_seconds=0.1,
        read_drafted=5,
    )
    runners = [Counted("plain", [], plain), Counted("a", [], drafted)]
    runs = list(measuring.measure(runners, fake_prompts(), settings(n=10)))
    rows = {
        (g.method, g.category): g
        for g in summary.summarize(runs, summary.per_prompt(runs, True), ["plain", "a"])
    }
    assert rows[("a", "all")].draft_step == pytest.approx(0.2) and rows[
        ("a", "A")
    ].draft_step == pytest.approx(0.2)
    assert rows[("plain", "all")].draft_step is None
    assert bench_table.summary_cells(rows[("a", "all")])[bench_table.COLUMNS.index("draft step")] == "0.20"


def test_an_interrupted_run_keeps_what_was_measured(pair):
    class Stop(FakeRunner):
        def generate(self, prompt_ids, config):
            if sum(name == "a" for name, *_ in self.log) == 2:  # Ctrl-C during its third run
                raise KeyboardInterrupt
            return super().generate(prompt_ids, config)

    log = []
    result = measuring.run_bench(
        pair,
        [],
        [PromptRecord("p1", "x", 1, "A"), PromptRecord("p2", "y", 2, "B"), PromptRecord("p3", "z", 3, "C")],
        settings(n=4),
        runners=[FakeRunner("plain", log), Stop("a", log)],
    )
    assert result.interrupted
    assert [(m.prompt_id, m.method) for m in result.measurements] == [  # p2 in reverse order
        ("p1", "plain"),
        ("p1", "a"),
        ("p2", "a"),
        ("p2", "plain"),
        ("p3", "plain"),
    ]
    assert {g.category for g in result.summary if g.method == "a"} == {"all", "A", "B"}


# -- exactness on the tiny pair ---------------------------------------------------------------
class FlipOneToken:
    """A deliberately wrong method: plain decoding with token 3 changed."""

    name = "wrong"

    def __init__(self, pair):
        self.inner = bench_runners.EngineRunner(pair, Method.PLAIN)

    def generate(self, prompt_ids, config):
        gen = self.inner.generate(prompt_ids, config)
        gen.token_ids[3] ^= 1
        return gen


def test_the_exactness_column_catches_a_wrong_method(pair, short_file):
    runners = [
        bench_runners.EngineRunner(pair, Method.PLAIN),
        bench_runners.EngineRunner(pair, Method.CHAIN),
        FlipOneToken(pair),
    ]
    result = measuring.run_bench(
        pair, [], prompt_sets.load_prompts(str(short_file)), settings(n=10), runners=runners
    )
    by = {(p.prompt_id, p.method): p for p in result.prompts}
    assert all(by[(pid, "chain")].identical_to_plain for pid in ("code-1", "code-2", "chat-1"))
    assert not any(by[(pid, "wrong")].identical_to_plain for pid in ("code-1", "code-2", "chat-1"))
    assert by[("code-1", "wrong")].first_mismatch == 3
    rows = {(g.method, g.category): g for g in result.summary}
    assert (rows[("chain", "all")].identical, rows[("chain", "all")].compared) == (3, 3)
    assert (rows[("wrong", "all")].identical, rows[("wrong", "all")].compared) == (0, 3)
    chain = next(m for m in result.measurements if m.method == "chain")
    assert chain.drafted > 0 and chain.tokens_per_target_forward >= 1.0
    assert chain.accepted_length_histogram and chain.draft_seconds is not None
    assert sum(chain.accepted_length_histogram.values()) <= chain.target_forwards
    plain = next(m for m in result.measurements if m.method == "plain")
    assert plain.acceptance_rate is None and plain.tokens_per_target_forward == 1.0
    assert plain.prefill_seconds is not None and plain.ttft_seconds is not None


def test_no_exactness_claim_under_sampling(pair, short_file):
    runners = [bench_runners.EngineRunner(pair, Method.PLAIN), bench_runners.EngineRunner(pair, Method.CHAIN)]
    result = measuring.run_bench(
        pair,
        [],
        prompt_sets.load_prompts(str(short_file), limit=1),
        settings(n=6, temperature=0.8, seed=3),
        runners=runners,
    )
    assert all(p.identical_to_plain is None for p in result.prompts)
    assert all(g.identical is None for g in result.summary)


# -- transformers reference methods ------------------------------------------------------------
def test_hf_references_run_on_the_pair_with_our_settings(pair, short_file, monkeypatch):
    draft_config = pair.draft.model.generation_config
    before = draft_config.to_dict()
    # a model-shipped penalty must not leak into the reference (it would change greedy output)
    monkeypatch.setattr(pair.target.model.generation_config, "repetition_penalty", 1.5, raising=False)
    names = ["plain", "hf-assisted", "hf-assisted-k4", "hf-lookup"]
    result = measuring.run_bench(pair, names, prompt_sets.load_prompts(str(short_file)), settings(n=12))
    assert result.methods == names
    assert all(p.identical_to_plain for p in result.prompts if p.method != "plain"), [
        (p.prompt_id, p.method, p.first_mismatch) for p in result.prompts if not p.identical_to_plain
    ]
    assert all(p.identical_to_plain is None for p in result.prompts if p.method == "plain")  # the reference
    for m in result.measurements:
        assert m.new_tokens == 12 and m.ttft_seconds is not None and m.ttft_seconds <= m.seconds
        if m.method != "plain":
            assert m.target_forwards is not None and 1 <= m.target_forwards <= 12
            assert m.tokens_per_target_forward == pytest.approx(12 / m.target_forwards)
            assert m.drafted is not None and m.accepted <= m.drafted
            assert m.draft_seconds is None  # transformers' drafts are counted, not timed: "–", never 0.00
    assert all(s.draft_step is None for s in result.summary)
    k4 = [m for m in result.measurements if m.method == "hf-assisted-k4"]
    assert all(m.drafted <= 4 * m.target_forwards for m in k4)
    assert pair.draft.model.generation_config is draft_config and draft_config.to_dict() == before
    assert result.settings["hf_assistant"]["hf-assisted-k4"]["num_assistant_tokens"] == 4
    assert result.settings["hf_assistant"]["hf-lookup"] == {"prompt_lookup_num_tokens": 10}


def test_hf_sampling_is_reproducible_with_a_seed(pair):
    runner = methods.registry()["hf-lookup"].build(pair)
    config = GenerationConfig(max_new_tokens=10, sampling=SamplingConfig(temperature=1.0, top_k=20, seed=5))
    ids = pair.target.tokenizer.encode("hello there")
    assert runner.generate(ids, config).token_ids == runner.generate(ids, config).token_ids


# -- reports ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_result(pair, short_file):
    return measuring.run_bench(
        pair, ["plain", "chain"], prompt_sets.load_prompts(str(short_file)), settings(n=6, repeats=2)
    )


def test_noise_is_plain_against_plain_and_a_loss_is_below_the_bound_in_every_repeat():
    """Three repeats: plain's tok/s on each prompt against the repeat before (four pairs), each
    method's speed-up in each repeat, and the caption's line naming what lost in every repeat."""
    log = []
    plain = FakeRunner("plain", log, {1: [1.0, 1.25, 1.0], 2: [1.0, 1.0, 1.0]})  # p1: 10, 8, 10 tok/s
    slow = FakeRunner("slow", log, {1: [1.1, 1.4, 1.1], 2: [1.0, 0.9, 1.2]})  # p1 lost in every repeat
    runs = list(measuring.measure([plain, slow], fake_prompts(), settings(n=10, repeats=3)))
    noise = summary.noise(runs)
    assert (noise.pairs, noise.share_below) == (4, 0.25)  # 8/10, then 10/8, 1 and 1
    assert (noise.low, noise.high) == pytest.approx((0.83, 1.2125))  # interpolated
    prompts = {(r.prompt_id, r.method): r for r in summary.per_prompt(runs, greedy=True)}
    assert prompts[("p1", "slow")].speedups == pytest.approx([1 / 1.1, 1.25 / 1.4, 1 / 1.1])
    assert prompts[("p2", "slow")].speedups == pytest.approx([1.0, 1 / 0.9, 1 / 1.2])
    assert prompts[("p1", "plain")].speedups == []
    (line,) = summary.noise_lines(noise, list(prompts.values()), repeats=3)
    assert line == (
        "noise: plain against plain, 4 pairs of repeats: 25% below 0.97x, 5-95% 0.83-1.21; "
        "below 0.97x in every repeat: slow p1"
    )


def test_one_repeat_measures_no_noise_and_says_so_only_where_a_prompt_fell_below():
    log = []
    runners = [FakeRunner("plain", log), FakeRunner("a", log, {1: [1.1], 2: [0.5]})]
    runs = list(measuring.measure(runners, fake_prompts(), settings(n=10)))
    prompts = summary.per_prompt(runs, greedy=True)
    assert summary.noise(runs) is None
    assert summary.noise_lines(None, prompts, repeats=1) == [
        "one repeat: a speed-up below 0.97x may be this machine's noise (--repeats 3 tells)"
    ]
    faster = [p for p in prompts if p.prompt_id == "p2"]
    assert summary.noise_lines(None, faster, repeats=1) == []


def test_json_schema(small_result, tmp_path):
    path = tmp_path / "out" / "bench.json"
    bench_cli.write_json(small_result, path)
    data = json.loads(path.read_text())
    assert data["schema"] == "specgen-bench/1"
    assert {"environment", "settings", "methods", "summary", "prompts", "measurements", "noise"} <= set(data)
    assert data["noise"]["pairs"] == 3 and set(data["noise"]) == {
        "pairs",
        "share_below",
        "low",
        "high",
        "bound",
    }
    assert {
        "cpu",
        "cpu_count",
        "torch_threads",
        "gpus",
        "torch",
        "transformers",
        "specgen",
        "target",
        "draft",
        "peak_memory",
    } <= set(data["environment"])
    assert data["environment"]["torch_threads"] == 1
    assert data["environment"]["target"]["dtype"] == "float32"
    assert data["settings"]["repeats"] == 2 and data["settings"]["greedy"] is True
    fields = {
        "prompt_id",
        "category",
        "method",
        "repeat",
        "prompt_tokens",
        "new_tokens",
        "seconds",
        "prefill_seconds",
        "ttft_seconds",
        "tokens_per_second",  # the old key of wall_tokens_per_second, for one release
        "wall_tokens_per_second",
        "decode_tokens_per_second",  # the old key of after_first_tokens_per_second, for one release
        "after_first_tokens_per_second",
        "acceptance_rate",
        "tokens_per_target_forward",
        "target_forwards",
        "drafted",
        "accepted",
        "accepted_length_histogram",
        "draft_seconds",
        "verify_seconds",
        "read_seconds",
        "read_drafted",
        "peak_memory_bytes",
        "stop_reason",
        "token_ids",
    }
    assert len(data["measurements"]) == 3 * 2 * 2
    assert all(set(m) == fields for m in data["measurements"])
    assert all(
        set(p) == {f.name for f in dataclasses.fields(summary.PromptResult)} | {"tokens_per_second"}
        for p in data["prompts"]
    )
    for record in data["measurements"] + data["prompts"] + data["summary"]:  # the old key, the same figure
        assert record["tokens_per_second"] == record["wall_tokens_per_second"]
    assert [(g["method"], g["category"]) for g in data["summary"]] == [
        ("plain", "all"),
        ("plain", "code"),
        ("plain", "chat"),
        ("chain", "all"),
        ("chain", "code"),
        ("chain", "chat"),
    ]
    first = data["measurements"][0]
    assert isinstance(first["token_ids"], list) and first["new_tokens"] == len(first["token_ids"])


def test_csv_schema(small_result, tmp_path):
    path = tmp_path / "bench.csv"
    bench_cli.write_csv(small_result, path)
    rows = list(csv.DictReader(path.open(encoding="utf-8")))
    assert list(rows[0]) == bench_cli.CSV_COLUMNS
    # every field of a measurement's JSON record is a column, its kept old keys included
    assert set(small_result.measurements[0].record()) <= set(bench_cli.CSV_COLUMNS)
    assert len(rows) == 12
    chain = next(r for r in rows if r["method"] == "chain")
    measured = next(m for m in small_result.measurements if m.method == "chain")
    assert chain["read_seconds"] == str(measured.read_seconds)
    assert chain["identical_to_plain"] == "True"
    assert chain["accepted_length_histogram"] == " ".join(
        f"{k}:{v}" for k, v in small_result.measurements[1].accepted_length_histogram.items()
    )
    assert len(chain["token_ids"].split()) == int(chain["new_tokens"])
    assert next(r for r in rows if r["method"] == "plain")["acceptance_rate"] == ""
    # text a spreadsheet would run as a formula is quoted
    from specgen.bench.report import _cell

    assert (
        _cell("=cmd|' /C calc'!A0") == "'=cmd|' /C calc'!A0"
        and _cell(-1.5) == -1.5
        and _cell("chain") == "chain"
    )


def test_plot_draws_a_png(small_result, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    bench_cli.write_plot(small_result, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plain_only = dataclasses.replace(
        small_result, methods=["plain"], summary=[g for g in small_result.summary if g.method == "plain"]
    )
    bench_cli.write_plot(plain_only, path)  # no legend to draw: it failed with "number sections must be > 0"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class Page(html.parser.HTMLParser):
    """A strict reading of an HTML page: every element closed in order (void ones excepted), the
    SVG plots and their marks counted, anything that would load or run something noted."""

    VOID = {"meta", "link", "br", "hr", "img", "input", "line", "rect", "polyline", "circle", "path"}

    def __init__(self, text: str):
        super().__init__()
        self.open, self.problems, self.plots, self.rects, self.cells = [], [], 0, 0, []
        self.feed(text)
        self.close()
        if self.open:
            self.problems.append(f"unclosed: {self.open}")

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "svg" and "data-plot" in attrs:
            self.plots += 1
        self.rects += tag == "rect"
        if tag in ("script", "iframe", "img", "link") or any(
            v and "//" in v and k != "xmlns" for k, v in attrs.items()
        ):
            self.problems.append(f"loads something: <{tag} {attrs}>")
        if tag == "td":
            self.cells.append("")
        if tag not in self.VOID:
            self.open.append(tag)

    def handle_startendtag(self, tag, attrs):
        if tag not in self.VOID:
            self.handle_starttag(tag, attrs)
            self.handle_endtag(tag)
        else:
            self.handle_starttag(tag, attrs)

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.open or self.open[-1] != tag:
            self.problems.append(f"</{tag}> closes {self.open[-1:] or 'nothing'}")
        else:
            self.open.pop()

    def handle_data(self, data):
        if self.open and self.open[-1] == "td":
            self.cells[-1] += data


def test_html_report_is_one_page_with_an_svg_per_plot(small_result, tmp_path):
    from specgen.bench.html import write_html

    path = tmp_path / "r" / "bench.html"
    write_html(small_result, path)
    text = path.read_text(encoding="utf-8")
    page = Page(text)
    assert page.problems == [] and text.startswith("<!doctype html>")
    assert page.plots == 3  # speed-up with ranges, acceptance per position, draft share
    chain = next(g for g in small_result.summary if g.method == "chain" and g.category == "all")
    assert (
        bench_table.summary_cells(chain)
        == page.cells[len(bench_table.COLUMNS) * 3 : len(bench_table.COLUMNS) * 4]
    )
    assert "chain</strong>: identical to plain on 3/3 prompts" in text
    for heading in (
        "Speed-up over plain",
        "Acceptance per draft position",
        "Draft share of decode time",
        "First token that differs from plain",
    ):
        assert heading in text
    # a method that differs: its first differing token, prompt by prompt
    differing = [
        dataclasses.replace(p, identical_to_plain=False, first_mismatch=4)
        if p.method == "chain" and p.prompt_id == "code-2"
        else p
        for p in small_result.prompts
    ]
    text = bench_cli_html(dataclasses.replace(small_result, prompts=differing))
    assert "differs from plain on 1/3 prompts: code-2 at token 4" in text
    # plain alone: the plots are still there, and say there is nothing to draw
    plain_only = dataclasses.replace(
        small_result, methods=["plain"], summary=[g for g in small_result.summary if g.method == "plain"]
    )
    page = Page(bench_cli_html(plain_only))
    assert page.problems == [] and page.plots == 3


def test_html_labels_too_long_for_their_group_are_slanted_and_cut_with_the_whole_name_kept():
    """Two categories of 200 characters ran into each other, level, under the speed-up plot."""
    from specgen.bench.html import _groups, _label

    assert "rotate" not in _label("code", 100, False)
    long = "x" * 199 + "<"
    label = _label(long, 100, True)
    assert "rotate(-25" in label and f"<title>{'x' * 199}&lt;</title>" in label
    assert "x" * 17 + "\u2026</text>" in label
    plot = _groups(["code", long], ["chain"], lambda label, m: 1.0, {"chain": "#000"}, 2.0, ".2f")
    assert plot.count("rotate(-25") == 2  # one label too long slants both


def bench_cli_html(result) -> str:
    from specgen.bench.html import page

    return page(result)


# -- the command ------------------------------------------------------------------------------
app = typer.Typer(add_completion=False)
app.add_typer(bench_app, name="bench")


@app.callback()
def _root() -> None:
    """A stand-in for specgen's app."""


runner = CliRunner()


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return [
        "--target",
        str(tiny_dirs["target"]),
        "--draft",
        str(tiny_dirs["draft"]),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--threads",
        "1",
    ]


def assert_one_line_error(result, *fragments):
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_cli_end_to_end_with_json_csv_and_html(models, short_file, tmp_path):
    out_json, out_csv, out_html = (
        tmp_path / "r" / "b.json",
        tmp_path / "r" / "b.csv",
        tmp_path / "r" / "b.html",
    )
    result = runner.invoke(
        app,
        [
            "bench",
            *models,
            "--prompts",
            str(short_file),
            "--limit",
            "2",
            "--methods",
            "chain,hf-lookup",
            "-n",
            "6",
            "--repeats",
            "2",
            "--json",
            str(out_json),
            "--csv",
            str(out_csv),
            "--html",
            str(out_html),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "speed-up" in result.stdout and "hf-lookup" in result.stdout and "2/2" in result.stdout
    data = json.loads(out_json.read_text())
    assert data["methods"] == ["plain", "chain", "hf-lookup"]
    assert len(data["measurements"]) == 2 * 2 * 3
    assert len(list(csv.DictReader(out_csv.open()))) == 12
    assert f"wrote {out_json}" in result.stderr and f"wrote {out_html}" in result.stderr
    page = Page(out_html.read_text(encoding="utf-8"))
    assert page.problems == [] and page.plots == 3 and "hf-lookup" in out_html.read_text()


def test_cli_plot_without_matplotlib_is_one_line_before_loading(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    result = runner.invoke(
        app, ["bench", "--target", str(tmp_path / "no-model"), "--plot", str(tmp_path / "p.png")]
    )
    assert_one_line_error(result, "--plot needs matplotlib", "pip install 'specgen[plot]'")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--prompts", "nope"], "unknown prompt set 'nope'"),
        (["--methods", "chain,warp"], "unknown method 'warp'"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--methods", "rsd-c", "--branching", "8,8,8"], "would have 584 nodes"),
    ],
)
def test_cli_bad_options_are_one_line(models, args, fragment):
    assert_one_line_error(runner.invoke(app, ["bench", *models, *args]), fragment)


def test_throughput_mode_reports_batching_and_the_cost_of_deterministic_mode(models, short_file, tmp_path):
    out = tmp_path / "t.json"
    result = runner.invoke(
        app,
        [
            "bench",
            "batch",
            *models,
            "--prompts",
            str(short_file),
            "--methods",
            "chain,lookup,rsd-c",
            "-n",
            "6",
            "--batch-sizes",
            "1,3",
            "--verify-windows",
            "4,8",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "det. cost" in result.stdout and "rollback rate" in result.stdout
    cells = json.loads(out.read_text())["cells"]
    grid = {(c["method"], c["batch_size"], c["mode"]): c for c in cells}
    assert len(grid) == 4 * 2 * 3
    assert (
        grid["rsd-c", 3, "off"]["skipped"] is None and grid["rsd-c", 3, "off"]["new_tokens"] > 0
    )  # trees batch
    for cell in cells:
        if cell["skipped"]:
            continue
        assert cell["new_tokens"] > 0 and cell["wall_tokens_per_second"] > 0
        assert cell["tokens_per_second"] == cell["wall_tokens_per_second"]  # the old key, for one release
        if cell["mode"] == "off":
            assert cell["deterministic_cost"] is None and cell["replays"] == 0
        else:
            assert cell["deterministic_cost"] > 0 and cell["replays"] > 0
            assert cell["differs"] == 0  # the guarantee: the same tokens in every deterministic cell
            assert 0 <= cell["rollback_rate"] < 1
    assert grid["plain", 1, "off"]["speedup"] == 1.0


def test_throughput_mode_compares_sampled_tokens_only_in_deterministic_windows(pair):
    """Sampled rounds draw by method and batch: there 'differs' says nothing, and is None; the
    keyed draws of a deterministic window are the same in every cell."""
    from specgen.bench import throughput

    ids = [pair.target.tokenizer.encode(t) for t in ("one two", "three four five")]
    config = GenerationConfig(max_new_tokens=6, sampling=SamplingConfig(temperature=0.8, seed=3))
    cells = throughput.run_throughput(pair, ["plain", "chain"], ids, config, [1, 2], [8])
    assert {c.differs for c in cells if c.mode == "off"} == {None}
    assert {c.differs for c in cells if c.mode != "off"} == {0}


def test_verify_windows_alone_say_they_measure_throughput_cells(models, short_file, tmp_path):
    out = tmp_path / "w.json"
    result = runner.invoke(
        app,
        [
            "bench",
            *models,
            "--prompts",
            str(short_file),
            "--limit",
            "1",
            "-n",
            "4",
            "--methods",
            "chain",
            "--verify-windows",
            "8",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "--verify-windows measures throughput cells" in result.stderr
    assert (
        "`bench --verify-windows` is now `specgen bench batch --verify-windows`" in result.stderr
    )  # the old spelling
    assert {c["batch_size"] for c in json.loads(out.read_text())["cells"]} == {1}


def test_throughput_mode_bad_sizes_are_one_line(models):
    assert_one_line_error(runner.invoke(app, ["bench", *models, "--batch-sizes", "1,x"]), "--batch-sizes")
    assert_one_line_error(runner.invoke(app, ["bench", *models, "--batch-sizes", "0"]), "--batch-sizes")


def test_method_variants_compare_draft_lengths_and_schedules(models, short_file, tmp_path):
    out = tmp_path / "v.json"
    result = runner.invoke(
        app,
        [
            "bench",
            *models,
            "--prompts",
            str(short_file),
            "--limit",
            "2",
            "-n",
            "8",
            "--methods",
            "chain/k1,chain/additive,lookup/expected-gain",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["methods"] == ["plain", "chain/k1", "chain/additive", "lookup/expected-gain"]
    assert all(p["identical_to_plain"] for p in data["prompts"] if p["method"] != "plain")
    k1 = [m for m in data["measurements"] if m["method"] == "chain/k1"]
    assert all(m["drafted"] <= m["target_forwards"] for m in k1)  # one draft token per round
    assert_one_line_error(
        runner.invoke(app, ["bench", *models, "--methods", "chain/k0"]), "/k0 drafts 0 tokens"
    )
    assert_one_line_error(
        runner.invoke(app, ["bench", *models, "--methods", "chain/k99"]), "must be in 1..64"
    )
    assert_one_line_error(
        runner.invoke(app, ["bench", *models, "--methods", "chain/c1.5"]), "/c1.5 is not a variant of chain"
    )
    assert_one_line_error(
        runner.invoke(app, ["bench", *models, "--methods", "rsd-c/k2"]), "its only variant is /cX"
    )


def test_another_draft_in_the_same_run_with_method_at_draft(models, tiny_dirs, short_file, tmp_path):
    """`chain@DRAFT` runs chain with another draft model, loaded once beside the run's own, in
    the same run against the same plain runs: here one with another tokenizer (text-level
    drafting) beside the same-tokenizer draft. Exact under greedy either way."""
    out = tmp_path / "d.json"
    other = str(tiny_dirs["odd_draft"])
    result = runner.invoke(
        app,
        [
            "bench",
            *models,
            "--prompts",
            str(short_file),
            "--limit",
            "2",
            "-n",
            "8",
            "--methods",
            f"chain,chain@{other},lookup-chain/k2@{other}",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["methods"] == ["plain", "chain", f"chain@{other}", f"lookup-chain/k2@{other}"]
    assert all(p["identical_to_plain"] for p in data["prompts"] if p["method"] != "plain")
    assert list(data["environment"]["extra_drafts"]) == [other]
    assert data["environment"]["extra_drafts"][other]["draft_tokens"] >= 1  # its own device k, measured
    assert data["environment"]["draft"]["name"] != data["environment"]["extra_drafts"][other]["name"]
    odd = [m for m in data["measurements"] if m["method"] == f"chain@{other}"]
    assert odd and all(m["drafted"] is not None for m in odd)
    assert_one_line_error(
        runner.invoke(app, ["bench", *models, "--methods", f"plain@{other}"]), "METHOD@DRAFT"
    )
    assert_one_line_error(runner.invoke(app, ["bench", *models, "--methods", "chain@"]), "METHOD@DRAFT")


def test_variant_suffixes_combine_and_a_confidence_stop_reaches_the_engine(models, short_file, tmp_path):
    from specgen.bench.methods import variant
    from specgen.config import Method, Schedule

    assert variant("lookup-chain/k4/c0.5") == (
        Method.LOOKUP_CHAIN,
        {"draft_tokens": 4, "schedule": Schedule.FIXED, "draft_confidence": 0.5, "floor": False},
    )
    assert variant("chain/expected-gain/k6") == (
        Method.CHAIN,
        {"schedule": Schedule.EXPECTED_GAIN, "draft_tokens": 6, "floor": True},
    )
    assert variant("chain/c0") == (
        Method.CHAIN,
        {"draft_confidence": 0.0},
    )  # no stop, whatever the run's default
    for bad in ("chain/k2/k3", "chain/c1.5", "chain/c-1", "chain/cx", "chain/", "chain/k0", "chain/k65"):
        with pytest.raises(ConfigError, match="in --methods: /"):
            variant(bad)
    assert variant("rsd-s/c0.5") == (Method.RSD_S, {"draft_confidence": 0.5})  # a tree: the stop only
    for bad in ("rsd-c/k2", "rsd-c/additive", "multi-draft/c2"):
        with pytest.raises(ConfigError, match="its only variant is /cX"):
            variant(bad)
    assert variant("chain") is None and variant("rsd-c") is None and variant("warp/k2") is None
    out = tmp_path / "c.json"
    result = runner.invoke(
        app,
        [
            "bench",
            *models,
            "--prompts",
            str(short_file),
            "--limit",
            "2",
            "-n",
            "8",
            "--methods",
            "chain/k4/c0,chain/k4/c0.99,rsd-c/c0,rsd-c/c0.99",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert all(p["identical_to_plain"] for p in data["prompts"] if p["method"] != "plain")
    drafted = {
        name: sum(m["drafted"] for m in data["measurements"] if m["method"] == name)
        for name in ("chain/k4/c0", "chain/k4/c0.99", "rsd-c/c0", "rsd-c/c0.99")
    }
    # a tiny model is rarely 99% sure: chains stop early, trees grow less deep
    assert drafted["chain/k4/c0.99"] < drafted["chain/k4/c0"]
    assert drafted["rsd-c/c0.99"] < drafted["rsd-c/c0"]


def test_ctrl_c_in_throughput_mode_keeps_the_measured_cells(models, short_file, tmp_path, monkeypatch):
    from specgen.bench import throughput as bench_batch

    real, calls = bench_batch.decode_all, []

    def decode_all(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 4:  # the warm-up, two cells, then Ctrl-C in the third
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_batch, "decode_all", decode_all)
    out = tmp_path / "t.json"
    result = runner.invoke(
        app,
        [
            "bench",
            "batch",
            *models,
            "--prompts",
            str(short_file),
            "--methods",
            "chain",
            "-n",
            "4",
            "--batch-sizes",
            "1,2",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 130, result.output
    assert "INTERRUPTED" in result.stdout
    data = json.loads(out.read_text())
    assert data["interrupted"] is True
    cells = [(c["method"], c["batch_size"], c["skipped"]) for c in data["cells"]]
    assert cells == [  # measured by batch size, methods side by side: plain 1, chain 1, chain 2 (cut)
        ("plain", 1, None),
        ("plain", 2, "interrupted"),
        ("chain", 1, None),
        ("chain", 2, "interrupted"),
    ]
    assert all(c["new_tokens"] > 0 for c in data["cells"] if c["skipped"] is None)


def test_throughput_cells_run_methods_side_by_side_in_alternating_order(pair, monkeypatch):
    """Drift in the machine's speed must not land on the methods measured last: each batch size
    and mode runs its methods next to each other, every other time in reverse; the cells still
    come back method by method, and each mode's reference is plain at the smallest batch."""
    from specgen.bench import throughput as bench_batch

    log = []

    def decode_all(pair, method, prompts, config, batch_size):
        log.append((method.value, batch_size, config.verify_window if config.deterministic else None))
        outputs = [[1, 2, 3 if method is Method.PLAIN else 4] for _ in prompts]  # chain differs
        return outputs, 1.0, Stats(method=method.value, new_tokens=3 * len(prompts))

    monkeypatch.setattr(bench_batch, "decode_all", decode_all)
    config = GenerationConfig(max_new_tokens=3)
    cells = bench_batch.run_throughput(pair, ["plain", "chain"], [[5, 6]], config, [1, 2], [8])
    assert log[1:] == [
        ("plain", 1, None),
        ("chain", 1, None),
        ("chain", 1, 8),
        ("plain", 1, 8),
        ("plain", 2, None),
        ("chain", 2, None),
        ("chain", 2, 8),
        ("plain", 2, 8),
    ]
    assert [(c.method, c.batch_size, c.mode) for c in cells] == [
        ("plain", 1, "off"),
        ("plain", 1, "window 8"),
        ("plain", 2, "off"),
        ("plain", 2, "window 8"),
        ("chain", 1, "off"),
        ("chain", 1, "window 8"),
        ("chain", 2, "off"),
        ("chain", 2, "window 8"),
    ]
    # measured against plain in each mode, though chain ran first in the window's first turn
    assert [c.differs for c in cells] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(c.speedup == 1.0 for c in cells)


def test_ctrl_c_inside_a_batched_cell_is_not_taken_for_a_measurement(pair, monkeypatch):
    from specgen.bench import throughput as bench_batch

    real = bench_batch.run_prompts

    def cut(engine, tokenizer, prompts, config, batch_size):
        rows = real(engine, tokenizer, prompts, config, batch_size)
        if batch_size == 1:  # the batch-1 cell runs whole; Ctrl-C lands in the batched one
            yield from rows
            return
        yield next(rows)
        yield rows.throw(KeyboardInterrupt())  # Ctrl-C: the rest come back unfinished
        yield from rows

    monkeypatch.setattr(bench_batch, "run_prompts", cut)
    ids = [pair.target.tokenizer.encode(t) for t in ("one", "two", "three")]
    cells = bench_batch.run_throughput(pair, ["plain"], ids, GenerationConfig(max_new_tokens=4), [1, 2], [])
    assert [(c.batch_size, c.skipped, c.interrupted) for c in cells] == [
        (1, None, False),
        (2, "interrupted", True),
    ]


@pytest.mark.parametrize("option", ["--json", "--csv", "--html"])
def test_unwritable_outputs_fail_before_measuring(tmp_path, option):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    no_model = ["--target", str(tmp_path / "no-model")]  # loading would fail: the check must come first
    result = runner.invoke(app, ["bench", *no_model, option, str(blocker / "out.json")])
    assert_one_line_error(result, f"cannot write {option}", "a-file/out.json", "is a file, not a folder")
    result = runner.invoke(app, ["bench", *no_model, option, str(tmp_path / ("n" * 300 + ".json"))])
    assert_one_line_error(result, f"cannot write {option}", "too long")
    result = runner.invoke(app, ["bench", *no_model, option, str(tmp_path)])
    assert_one_line_error(result, "is a directory")
    same = tmp_path / "same"
    result = runner.invoke(app, ["bench", *no_model, "--json", str(same), "--csv", str(same)])
    assert_one_line_error(result, "--json and --csv both name")
    result = runner.invoke(app, ["bench", *no_model, "--batch-sizes", "1", "--json", str(blocker / "t.json")])
    assert_one_line_error(result, "cannot write --json")
    result = runner.invoke(app, ["bench", *no_model, "--batch-sizes", "1", "--csv", str(tmp_path / "t.csv")])
    assert_one_line_error(result, "with --batch-sizes use --json")
    result = runner.invoke(
        app, ["bench", *no_model, "--concurrency", "1", "--html", str(tmp_path / "t.html")]
    )
    assert_one_line_error(result, "it takes --json, not", "--html")
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"id": "a", "category": "c", "prompt": "hi"}\n')
    result = runner.invoke(app, ["bench", *no_model, "--prompts", str(prompts), option, str(prompts)])
    assert_one_line_error(result, f"{option} {prompts} is the prompt file this run reads")
    assert prompts.read_text().startswith('{"id": "a"')


@pytest.mark.parametrize("installed", [True, False], ids=["llama-cpp-installed", "llama-cpp-absent"])
def test_llama_cpp_columns_named_for_a_target_of_no_gguf_are_refused(
    models, short_file, tmp_path, monkeypatch, installed
):
    """The target is asked before the package: the same line whether llama-cpp-python is there or not."""
    from specgen.bench import llamacpp as bench_llamacpp

    monkeypatch.setattr(bench_llamacpp, "installed", lambda: installed)
    out = tmp_path / "b.json"
    result = runner.invoke(
        app,
        [
            "bench",
            *models,
            "--prompts",
            str(short_file),
            "-n",
            "2",
            "--no-warmup",
            "--methods",
            "plain,llamacpp",
            "--json",
            str(out),
        ],
    )
    assert_one_line_error(result, "llamacpp (llama.cpp) needs a GGUF target")
    assert not out.exists()


def test_a_failed_write_keeps_the_other_outputs_and_says_where_the_data_went(
    models, short_file, tmp_path, monkeypatch
):
    import shutil
    import tempfile

    spare = tmp_path / "spare"
    spare.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spare))
    gone, kept = tmp_path / "gone", tmp_path / "kept"
    real = measuring.run_bench

    def run_bench(*args, **kwargs):  # the JSON's folder turns into a file while measuring
        result = real(*args, **kwargs)
        shutil.rmtree(gone)
        gone.write_text("in the way")
        return result

    monkeypatch.setattr(measuring, "run_bench", run_bench)
    out_json, out_csv = gone / "b.json", kept / "b.csv"
    result = runner.invoke(
        app,
        [
            "bench",
            *models,
            "--prompts",
            str(short_file),
            "--limit",
            "1",
            "--methods",
            "plain",
            "-n",
            "3",
            "--no-warmup",
            "--json",
            str(out_json),
            "--csv",
            str(out_csv),
        ],
    )
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert len(list(csv.DictReader(out_csv.open()))) == 1  # the CSV was still written
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"cannot write --json {out_json}" in errors[0], result.stderr
    copies = list(spare.glob("specgen-bench-*.json"))
    assert len(copies) == 1 and str(copies[0]) in errors[0]
    assert json.loads(copies[0].read_text())["methods"] == ["plain"]
    assert sorted(p.name for p in kept.iterdir()) == ["b.csv"]  # no temporary file left beside it


def test_cli_plot_is_written_through_a_temporary_file(models, short_file, tmp_path):
    pytest.importorskip("matplotlib")
    bad = runner.invoke(
        app, ["bench", "--target", str(tmp_path / "no-model"), "--plot", str(tmp_path / "p.docx")]
    )
    assert_one_line_error(bad, "cannot write '.docx' files")
    out = tmp_path / "plots" / "speed"  # no extension: a PNG
    result = runner.invoke(
        app,
        [
            "bench",
            *models,
            "--prompts",
            str(short_file),
            "--limit",
            "1",
            "--methods",
            "chain",
            "-n",
            "3",
            "--no-warmup",
            "--plot",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in out.parent.iterdir()] == ["speed"]


def test_llamacpp_methods_without_the_extra_say_how_to_install(monkeypatch):
    from specgen.bench import llamacpp as bench_llamacpp

    monkeypatch.setattr(bench_llamacpp, "installed", lambda: False)
    names = methods.parse_methods("llamacpp")  # a known name, installed or not
    with pytest.raises(ConfigError, match=r"specgen\[llamacpp\]"):
        bench_llamacpp.refuse_early(names, "qwen2.5-coder-1.5b-instruct")  # a GGUF target: then the package
    assert "llamacpp" not in methods.parse_methods(None)


def test_llamacpp_runner_needs_a_gguf_target(monkeypatch):
    from types import SimpleNamespace

    from specgen.bench import llamacpp as bench_llamacpp

    monkeypatch.setattr(bench_llamacpp, "installed", lambda: True)
    pair = SimpleNamespace(target=SimpleNamespace(gguf=None, name="tiny", source="dir"))
    with pytest.raises(ConfigError, match="needs a GGUF target"):
        bench_llamacpp.LlamaCppRunner(pair, "llamacpp")


@pytest.mark.parametrize(
    "command, args, fragment",
    [
        (
            ["batch"],
            ["--batch-sizes", "1", "--verify-windows", "100000"],
            "--verify-windows values must be in 1..1024",
        ),
        (["batch"], ["--verify-windows", "600"], "--verify-window must be in"),
        (["batch"], ["--batch-sizes", "99999999999"], "--batch-sizes values must be in 1..1024"),
        (["batch"], [], "bench batch measures at --batch-sizes"),
        (["batch"], ["--methods", ""], "--methods is empty"),
        (["serve"], ["--concurrency", "30000"], "--concurrency values must be in 1..1024"),
        (["serve"], ["--concurrency", "2", "--max-batch-size", "0"], "--max-batch-size must be in 1..256"),
        (["serve"], ["--concurrency", "2", "--repeats", "0"], "--repeats must be >= 1"),
        (
            ["serve"],
            ["--concurrency", "1", "--methods", "hf-lookup"],
            "bench serve measures specgen's own methods",
        ),
        (["serve"], ["--concurrency", "0"], "--concurrency"),
        (["serve"], [], "bench serve drives the server at --concurrency levels"),
        (["serve"], ["--threads", "0"], "--threads must be in"),
        ([], ["--methods", ""], "--methods is empty"),
        ([], ["--methods", " , "], "--methods is empty"),
        ([], ["--threads", "100000"], "--threads must be in"),
        # the old spellings of bench batch and bench serve: checked as they were
        ([], ["--batch-sizes", "1,2", "--repeats", "3"], "--batch-sizes runs each cell once"),
        ([], ["--batch-sizes", "99999999999"], "--batch-sizes values must be in 1..1024"),
        ([], ["--concurrency", "30000"], "--concurrency values must be in 1..1024"),
        ([], ["--concurrency", "1", "--methods", "hf-lookup"], "bench serve measures specgen's own methods"),
    ],
)
def test_every_setting_is_checked_before_a_model_loads(tmp_path, command, args, fragment):
    """A target that does not exist: had anything loaded, the error would be about the model."""
    no_model = ["--target", str(tmp_path / "no-model"), "--json", str(tmp_path / "out.json")]
    result = runner.invoke(app, ["bench", *command, *no_model, *args])
    assert_one_line_error(result, fragment)
    assert not (tmp_path / "out.json").exists()


def test_bench_is_three_commands_and_an_option_before_a_commands_name_is_refused(tmp_path):
    """`bench` measures per prompt; `bench batch` and `bench serve` are its commands, each with its
    own options only. `bench --methods chain batch` would measure batch's default methods: it is
    one line that says where the option goes."""
    shown = runner.invoke(app, ["bench", "--help"], terminal_width=200)
    assert shown.exit_code == 0
    assert "batch" in shown.output and "serve" in shown.output
    assert "--batch-sizes" not in shown.output and "--concurrency" not in shown.output  # the old spellings
    assert "Server mode" not in shown.output and "Throughput mode" not in shown.output
    batch_help = runner.invoke(app, ["bench", "batch", "--help"], terminal_width=200).output
    assert "--batch-sizes" in batch_help and "--csv" not in batch_help and "--concurrency" not in batch_help
    serve_help = runner.invoke(app, ["bench", "serve", "--help"], terminal_width=200).output
    assert (
        "--concurrency" in serve_help and "--requests-per-client" in serve_help and "--csv" not in serve_help
    )
    no_model = ["--target", str(tmp_path / "no-model")]
    result = runner.invoke(app, ["bench", "--methods", "chain", "batch", *no_model, "--batch-sizes", "1"])
    assert_one_line_error(result, "--methods goes after the command's name: specgen bench batch --methods")
    assert (
        runner.invoke(app, ["bench", "batch", *no_model, "--csv", "x.csv"]).exit_code == 2
    )  # not its option


def test_concurrency_mode_drives_a_server_and_reports_every_cell(models, short_file, tmp_path):
    """bench --concurrency: a server on the loaded pair, N streaming clients per method, runs
    interleaved and pooled; aggregate tok/s, TTFT and per-token latency against plain."""
    pytest.importorskip("fastapi")
    out = tmp_path / "conc.json"
    result = runner.invoke(
        app,
        [
            "bench",
            "serve",
            *models,
            "--prompts",
            str(short_file),
            "-n",
            "6",
            "--methods",
            "plain,chain,lookup-chain",
            "--concurrency",
            "1,3",
            "--requests-per-client",
            "2",
            "--repeats",
            "2",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "specgen bench serve" in result.stdout
    assert "draft length by batch width" in " ".join(result.stderr.split())
    data = json.loads(out.read_text())
    assert data["schema"] == "specgen-bench-concurrency/1" and data["settings"]["repeats"] == 2
    cells = {(c["concurrency"], c["method"]): c for c in data["cells"]}
    assert set(cells) == {(n, m) for n in (1, 3) for m in ("plain", "chain", "lookup-chain")}
    for (clients, method), cell in cells.items():
        assert cell["errors"] == [] and cell["requests"] == clients * 2 * 2
        assert cell["tokens"] == cell["requests"] * 6 and cell["wall_tokens_per_second"] > 0
        assert cell["tokens_per_second"] == cell["wall_tokens_per_second"]  # the old key, for one release
        assert cell["ttft_p50"] <= cell["ttft_p95"]
    assert cells[(1, "plain")]["speedup"] == 1.0 and cells[(3, "chain")]["speedup"] > 0
    assert cells[(1, "plain")]["acceptance_rate"] is None and 0 <= cells[(1, "chain")]["acceptance_rate"] <= 1
    assert all(
        len(cell["runs"]) == data["settings"]["repeats"] and min(cell["runs"]) > 0 for cell in cells.values()
    )
    assert data["settings"]["width_caps"]["1"] >= 1
    # what the served engines' measured rounds settled on, per method and batch width (2 and up)
    # what the rows' floors compared their rounds with: a plain round's seconds by batch width
    assert all(int(w) >= 1 and seconds > 0 for w, seconds in data["learned"].items())


def test_concurrency_mode_sends_the_runs_sampling_and_takes_specgens_own_methods_by_default(
    models, short_file, tmp_path, monkeypatch
):
    """The default method list holds transformers' columns, which run no server: left out, not
    an error. A sampled run's requests carry its law (each its own seed), and the title says so."""
    pytest.importorskip("fastapi")
    from specgen.bench import concurrency

    sent = []
    real = concurrency.one_request
    monkeypatch.setattr(
        concurrency, "one_request", lambda url, key, body: sent.append(body) or real(url, key, body)
    )
    out = tmp_path / "conc.json"
    result = runner.invoke(
        app,
        [
            "bench",
            *models,
            "--prompts",
            str(short_file),
            "--limit",
            "1",
            "-n",
            "3",
            "--concurrency",
            "1",
            "--requests-per-client",
            "2",
            "--temperature",
            "0.8",
            "--seed",
            "7",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert (
        "`bench --concurrency` is now `specgen bench serve --concurrency`" in result.stderr
    )  # the old spelling runs
    data = json.loads(out.read_text())
    assert {c["method"] for c in data["cells"]} == {m.value for m in Method if m is not Method.EAGLE}
    assert data["settings"]["sampling"]["temperature"] == 0.8 and "temperature 0.8" in result.stdout
    measured = [b for b in sent if b["max_tokens"] == 3]
    assert all(b["temperature"] == 0.8 for b in measured) and {b["seed"] for b in measured} == {7, 8}


def test_rates_come_from_stats_under_one_name_each():
    """Decode tok/s is over the time after prefill, wall tok/s over the whole time: two names. The
    JSON keeps each old key, `tokens_per_second`, beside its new one for a release, the same value."""
    stats = Stats(method="chain", new_tokens=21, prefill_seconds=0.5, seconds=1.5, drafted=10, accepted=7)
    stats.time_to_first_token, stats.first_tokens = 0.5, 1
    assert stats.decode_tokens_per_second == pytest.approx(21.0) == stats.tokens_per_second
    assert stats.wall_tokens_per_second == pytest.approx(14.0)
    assert stats.after_first_tokens_per_second == pytest.approx(20.0)
    assert stats.seconds_per_token == pytest.approx(0.05)
    assert stats.acceptance == pytest.approx(0.7) and Stats(method="plain").acceptance is None
    data = stats.as_dict()
    assert data["decode_tokens_per_second"] == data["tokens_per_second"] == 21.0
    generation = Generation([1] * 21, 2.0, 0.5, 1, stats, bench_runners.Known.DRAFTS)
    record = generation.record()
    assert record["wall_tokens_per_second"] == record["tokens_per_second"] == pytest.approx(10.5)
    assert (
        record["after_first_tokens_per_second"]
        == record["decode_tokens_per_second"]
        == pytest.approx(20 / 1.5)
    )
    assert list(record).index("decode_tokens_per_second") + 1 == list(record).index(
        "after_first_tokens_per_second"
    )
    assert list(record).index("tokens_per_second") + 1 == list(record).index("wall_tokens_per_second")
    assert record["acceptance_rate"] == pytest.approx(0.7) and record["tokens_per_target_forward"] is None


def test_a_batch_cell_and_a_clients_cell_write_their_json_as_before():
    """Two cell types, each with the fields of its own command; the JSON keys as they were (in
    their order), the new name of the old `tokens_per_second` beside it."""
    from specgen.bench.concurrency import ClientsCell
    from specgen.bench.throughput import BatchCell

    totals = Stats(method="chain", new_tokens=40, seconds=4.0, drafted=20, accepted=10, verified_windows=2)
    totals.rollbacks, totals.rolled_back_tokens = 1, 10
    batch = BatchCell("chain", 4, "window 8", 3, totals, outputs=[[1], [2], [3]])
    record = batch.record()
    assert list(record) == [
        "method", "batch_size", "mode", "prompts", "new_tokens", "seconds", "tokens_per_second",
        "wall_tokens_per_second", "speedup", "deterministic_cost", "drafted", "accepted", "replays",
        "rollbacks", "rolled_back_tokens", "rollback_rate", "differs", "skipped", "interrupted",
        "failed", "outputs",
    ]  # fmt: skip
    assert record["tokens_per_second"] == record["wall_tokens_per_second"] == 10.0
    assert (record["replays"], record["rollback_rate"], batch.acceptance_rate) == (2, 0.2, 0.5)
    assert BatchCell("chain", 4, "off", 3, totals).rollback_rate is None  # a deterministic cell's only
    skipped = BatchCell("plain", 1, "window 8", 3, skipped="interrupted", interrupted=True).record()
    assert (skipped["new_tokens"], skipped["tokens_per_second"], skipped["rollback_rate"]) == (0, 0.0, None)

    def request(tokens, ttft, seconds, drafted=0, accepted=0):
        return Stats(
            method="chain",
            generations=1,
            new_tokens=tokens,
            time_to_first_token=ttft,
            seconds=seconds,
            first_tokens=1,
            drafted=drafted,
            accepted=accepted,
        )

    clients = ClientsCell("chain", 2, [request(5, 0.5, 1.5, 4, 3), request(1, 0.2, 0.2)], 2.0, runs=[3.0])
    record = clients.record()
    assert list(record) == [
        "method", "concurrency", "requests", "tokens", "seconds", "tokens_per_second",
        "wall_tokens_per_second", "ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95", "acceptance_rate",
        "speedup", "errors", "runs",
    ]  # fmt: skip
    assert (record["requests"], record["tokens"], record["tokens_per_second"]) == (2, 6, 3.0)
    assert record["tpot_p50"] == pytest.approx(0.25)  # only the request with tokens after its first
    assert record["ttft_p50"] == pytest.approx(0.35) and record["acceptance_rate"] == pytest.approx(0.75)


def test_a_quantile_interpolates_between_its_neighbours():
    from specgen.bench.summary import quantile

    assert quantile([1.0, 3.0], 0.5) == 2.0 and quantile([5.0], 0.95) == 5.0
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0 and quantile([0.0, 10.0], 0.95) == 9.5


def test_concurrency_mode_keeps_its_cells_on_ctrl_c_and_says_when_requests_failed(
    models, short_file, tmp_path, monkeypatch
):
    pytest.importorskip("fastapi")
    from specgen.bench import concurrency

    out = tmp_path / "conc.json"
    args = [
        "bench",
        "serve",
        *models,
        "--prompts",
        str(short_file),
        "--limit",
        "1",
        "-n",
        "4",
        "--methods",
        "plain,chain",
        "--concurrency",
        "1,2",
        "--requests-per-client",
        "1",
        "--json",
        str(out),
    ]
    real, calls = concurrency.drive, []

    def interrupted_at_the_second_level(*a, **k):
        calls.append(a[5])
        if a[5] == 2 and a[4] == "chain":  # plain's run at 2 clients finished: it is kept
            raise KeyboardInterrupt
        return real(*a, **k)

    with monkeypatch.context() as patch:
        patch.setattr(concurrency, "drive", interrupted_at_the_second_level)
        result = runner.invoke(app, args)
    assert result.exit_code == 130, result.output
    data = json.loads(out.read_text())
    assert data["interrupted"] and {(c["concurrency"], c["method"]) for c in data["cells"]} == {
        (1, "plain"),
        (1, "chain"),
        (2, "plain"),
    }
    with monkeypatch.context() as patch:  # every chain request fails: written, no speed-up, exit 1

        def failing(url, key, body):
            if body["speculative"]["method"] == "chain":
                raise RuntimeError("HTTP 500: the engine failed")
            return real_request(url, key, body)

        real_request = concurrency.one_request
        patch.setattr(concurrency, "one_request", failing)
        result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "requests failed" in result.stderr.strip().splitlines()[-1]
    cells = {(c["concurrency"], c["method"]): c for c in json.loads(out.read_text())["cells"]}
    assert cells[(1, "chain")]["errors"] and cells[(1, "chain")]["speedup"] is None


def test_throughput_mode_keeps_its_cells_when_one_fails(models, short_file, tmp_path, monkeypatch):
    from specgen.bench import throughput

    real = throughput._measure_cell

    def failing(pair, method, name, *rest):
        if name == "chain":
            raise ValueError("a kernel failed")
        return real(pair, method, name, *rest)

    monkeypatch.setattr(throughput, "_measure_cell", failing)
    out = tmp_path / "t.json"
    result = runner.invoke(
        app,
        [
            "bench",
            "batch",
            *models,
            "--prompts",
            str(short_file),
            "--limit",
            "1",
            "-n",
            "4",
            "--methods",
            "plain,chain,lookup",
            "--batch-sizes",
            "1",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 1, result.output
    assert "cells failed: chain b1 off: failed: ValueError: a kernel failed" in result.stderr
    cells = {c["method"]: c for c in json.loads(out.read_text())["cells"]}
    assert cells["chain"]["failed"] and cells["lookup"]["tokens_per_second"] > 0
    named = runner.invoke(
        app,
        [
            "bench",
            "batch",
            *models,
            "--prompts",
            str(short_file),
            "--methods",
            "plain,chain/k2",
            "--batch-sizes",
            "1",
        ],
    )
    assert named.exit_code == 1 and "'chain/k2' is not one" in named.stderr


@pytest.mark.parametrize(
    "command, mode", [([], []), (["batch"], ["--batch-sizes", "1"]), (["serve"], ["--concurrency", "1"])]
)
def test_a_prompt_past_the_context_is_one_line_before_any_mode_measures(models, tmp_path, command, mode):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "long", "category": "c", "prompt": "x " * 300}) + "\n")
    result = runner.invoke(
        app,
        [
            "bench",
            *command,
            *models,
            "--prompts",
            str(prompts),
            "-n",
            "4",
            "--methods",
            "plain,chain",
            *mode,
            "--json",
            str(tmp_path / "o.json"),
        ],
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "prompt long has" in errors[0] and "context holds" in errors[0], result.output
    assert not (tmp_path / "o.json").exists()


def test_a_long_output_path_is_said_on_one_line(tmp_path, capsys, monkeypatch):
    """`wrote PATH` keeps a path longer than the terminal on one line (Rich would break it into
    two, and a user copying it, or a script reading it, gets a path that does not exist)."""
    monkeypatch.setenv("COLUMNS", "60")
    path = tmp_path / ("a-folder-with-a-long-name-" * 4) / "b.json"
    assert bench_cli.save("--json", path, lambda out: out.write_text("{}"), fallback=True)
    assert f"wrote {path}\n" in capsys.readouterr().err
    console = bench_cli.Console
    monkeypatch.setattr(bench_cli, "Console", lambda **kw: console(**{**kw, "soft_wrap": False}))
    bench_cli.save("--json", path, lambda out: out.write_text("{}"), fallback=True)
    assert f"wrote {path}\n" not in capsys.readouterr().err  # control: wrapped without soft_wrap
