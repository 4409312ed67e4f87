"""The per-device default draft length: chosen from measured costs, deterministic, cached."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specgen.config import parse_draft_tokens
from specgen.decoding import costs as draft_length
from specgen.decoding import probes, widths


def verify(slope: float) -> dict[int, float]:
    return {n: 1.0 + slope * (n - 1) for n in range(1, draft_length.MAX_K + 2)}


def test_cheap_draft_and_flat_verify_draft_long():
    assert draft_length.best_k(0.05, verify(0.0)) >= 4


def test_costly_draft_drafts_short():
    # the default pair on an AVX2 CPU, int8: draft step 0.5 of a target step, verify(5) 1.17 steps
    assert draft_length.best_k(0.5, verify(0.04)) == 2
    assert draft_length.best_k(0.9, verify(0.3)) == 1


def test_choice_is_deterministic_for_given_costs():
    assert {draft_length.best_k(0.3, verify(0.1)) for _ in range(5)} == {
        draft_length.best_k(0.3, verify(0.1))
    }


def test_device_keyword_parses():
    assert parse_draft_tokens("device") == (4, None)


def test_gpu_and_no_draft_need_no_measurement():
    cuda = SimpleNamespace(device=torch.device("cuda"))
    assert draft_length.choose(SimpleNamespace(target=cuda, draft=cuda)).k == draft_length.GPU_K
    assert draft_length.choose(SimpleNamespace(target=cuda, draft=None)).k == draft_length.GPU_K


def test_measured_once_then_cached(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    target, draft = tiny_pair
    pair = SimpleNamespace(target=target, draft=draft)
    first = draft_length.choose(pair)
    assert 1 <= first.k <= draft_length.MAX_K and "measured" in first.reason
    assert (tmp_path / "draft-length.json").is_file()
    monkeypatch.setattr(
        draft_length, "ratios", lambda *a, **k: (_ for _ in ()).throw(AssertionError("re-measured"))
    )
    assert draft_length.choose(pair) == first


def test_the_confidence_stop_is_priced_by_the_draft_step():
    """A token more is worth drafting while the round's chance of being right still beats what a
    draft step costs: twice that, within [0.5, 0.8]."""
    assert draft_length.stop_for(0.34) == 0.68  # the default pair on a Zen 4 CPU
    assert draft_length.stop_for(0.05) == draft_length.STOP_MIN  # a cheap draft: the old fixed 0.5 at least
    assert draft_length.stop_for(0.6) == draft_length.STOP_MAX  # a dear one still drafts its surest
    assert draft_length.stop_for(0.3) < draft_length.stop_for(0.36)


def test_a_cpu_draft_gets_a_confidence_stop_and_room_past_k(tiny_pair, tmp_path, monkeypatch):
    from dataclasses import replace

    from specgen.cli.options import generation_config
    from specgen.config import GenerationConfig, Method
    from specgen.decoding.build import resolve_draft_length

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    # the AVX2 EPYC's costs: a draft step, verifies of 2, 3 and 5 tokens (linear there), of 13
    monkeypatch.setattr(draft_length, "ratios", lambda *a, **k: (0.38, 1.02, 1.04, 1.08, 1.4, 0.045))
    target, draft = tiny_pair
    pair = SimpleNamespace(target=target, draft=draft)
    choice = draft_length.choose(pair)
    best = draft_length.best_k(
        0.38, draft_length.verify_steps(draft_length._verify_cost(1.02, 1.04, 1.08, 1.4))
    )
    assert choice.k == min(draft_length.MAX_K, best + draft_length.STOP_EXTRA)
    stop = draft_length.stop_for(0.38)
    assert choice.confidence == stop == 0.76 and "stays at 0.76 or above" in choice.reason
    # no --draft-confidence: the device's k brings its stop; an explicit value (0 included) wins
    default = generation_config(method="chain", max_new_tokens=16)
    assert default.device_confidence and default.draft_confidence == 0.0
    config, _ = resolve_draft_length(pair, default)
    assert (config.draft_tokens, config.draft_confidence) == (choice.k, stop)
    config, _ = resolve_draft_length(
        pair, generation_config(method="chain", max_new_tokens=16, draft_confidence=0.0)
    )
    assert config.draft_confidence == 0.0
    config, _ = resolve_draft_length(pair, replace(GenerationConfig(method=Method.CHAIN, draft_tokens=3)))
    assert (config.draft_tokens, config.draft_confidence) == (3, 0.0)  # a given k: as given, no stop
    # a tree's size is its floor's, but it takes the device's stop, and its verify costs are
    # measured by the first run that drafts one (floor.first_ceiling reads them)
    for method in ("rsd-c", "rsd-s", "multi-draft"):
        config, chosen = resolve_draft_length(pair, generation_config(method=method, max_new_tokens=16))
        assert config.draft_confidence == stop and chosen is not None and chosen.verify.wide > 0
    assert draft_length.verify_cost(pair) == choice.verify


BAD_ENTRIES = [
    {"k": "five"},
    {"k": None},
    {"k": 3, "confidence": "x"},
    {"k": 0},
    {"k": -3},
    {"k": 1000000},
    {"k": True},
    {"k": 3.5},
    {"k": 3, "confidence": 1.5},
    {"k": 3, "reason": 7},
    {"k": 3, "verify_first": -0.1},
    {"k": 3, "verify_first": "x"},
    {"k": 3, "verify_slope": 12.0},
    {"k": 3, "verify_kink": "x"},
    {"k": 3, "verify_slope": 0.02, "verify_kink": -0.05},  # a second token that costs less than none
    {"k": 3, "verify_wide": -0.2},
    {"k": 3, "read": -0.01},
    {"k": 3, "read": "0.05"},
    None,
    [3],
    "k",
]


def test_a_cached_entry_that_does_not_validate_is_measured_again_with_a_notice(
    tiny_pair, tmp_path, monkeypatch, capsys
):
    """A hand-edited or damaged draft-length.json never crashes a run nor sets a k the user did
    not ask for: the entry is measured again, with one notice, and written back valid."""
    import json

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(draft_length, "ratios", lambda *a, **k: (0.38, 1.02, 1.04, 1.08, 1.4, 0.045))
    target, draft = tiny_pair
    pair = SimpleNamespace(target=target, draft=draft)
    good = draft_length.choose(pair)
    path = tmp_path / "draft-length.json"
    key = next(iter(json.loads(path.read_text())))
    for entry in BAD_ENTRIES:
        path.write_text(json.dumps({key: entry}))
        capsys.readouterr()
        assert draft_length.choose(pair) == good, entry
        assert "not valid; measuring it again" in capsys.readouterr().err, entry
        assert json.loads(path.read_text())[key]["k"] == good.k  # repaired
    for text in ("{not json", "[1, 2]", "null"):  # a file that is not a cache at all: measured, rewritten
        path.write_text(text)
        assert draft_length.choose(pair) == good
        assert json.loads(path.read_text())[key]["k"] == good.k


def test_width_costs_draft_only_while_a_wide_verify_stays_cheap():
    """Memory-bound verifies (flat in tokens) keep drafting at every width; verifies whose cost
    grows with the tokens fed stop it once a plain round does as well; a promised gain under
    the margin does not draft."""
    from specgen.decoding.widths import WidthCosts

    flat = WidthCosts({1: 1.0, 16: 1.2}, {1: 1.05, 16: 1.3}, {1: 0.3, 16: 0.35})
    assert all(flat.cap(width) >= 3 for width in (1, 2, 4, 8, 16))
    compute_bound = WidthCosts(
        {1: 1.0, 4: 1.06, 16: 1.76}, {1: 1.13, 4: 2.75, 16: 6.6}, {1: 0.39, 4: 0.47, 16: 0.63}
    )
    caps = [compute_bound.cap(width) for width in (1, 2, 4, 8, 16)]
    assert caps[0] >= 3 and caps == sorted(caps, reverse=True) and caps[-1] == 0
    assert compute_bound.cap(4) == 0  # k = 1 promises under WIDTH_MARGIN over plain rounds


def test_few_rows_of_a_wide_batch_do_not_draft_with_the_model_alone():
    """The model's step holds up every row of the batch: where few rows draft with it, their
    tokens cannot repay it. `cap` at `drafting` rows of a width: all of them is the width's own
    cap, and it grows with the rows that share the step; `least` is the fewest that promise the
    margin. On the 2-core Xeon with AMX's costs (its cache, 2026-12-03) one row of two, one of
    three and two of four do not, and a lone row of four would not pay even if every token it
    drafted were accepted; with verifies that stay flat the rows needed grow with the width,
    the slower the cheaper the draft's step."""
    from specgen.decoding.widths import WidthCaps, WidthCosts

    xeon = WidthCosts(
        {1: 0.997, 4: 1.228, 16: 1.504}, {1: 1.171, 4: 1.818, 16: 2.885}, {1: 0.316, 4: 0.460, 16: 0.618}
    )
    for width in (1, 2, 3, 4, 8, 16):
        assert xeon.cap(width, drafting=width) == xeon.cap(width)
        caps = [xeon.cap(width, drafting=rows) for rows in range(1, width + 1)]
        assert caps == sorted(caps), (width, caps)
        assert xeon.least(width) == next((r for r, k in enumerate(caps, 1) if k), width + 1)
    assert [xeon.least(width) for width in (1, 2, 3, 4, 8)] == [1, 2, 2, 3, 6]
    assert xeon.cap(4, drafting=1, acceptance=0.999) == 0  # however good the draft
    # memory-bound verifies: the company needed grows with the width, slower the cheaper the step
    flat = WidthCosts({1: 1.0, 16: 1.2}, {1: 1.05, 16: 1.3}, {1: 0.3, 16: 0.35})
    assert [flat.least(width) for width in (1, 2, 4, 8, 16)] == [1, 1, 2, 4, 8]
    cheap = WidthCosts({1: 1.0, 16: 1.05}, {1: 1.01, 16: 1.1}, {1: 0.05, 16: 0.06})
    assert [cheap.least(width) for width in (1, 2, 4, 8, 16)] == [1, 1, 1, 1, 2]
    # a server's caps: past its widest width the widest's entries hold; none: anything goes
    caps = WidthCaps({1: 6, 2: 6, 4: 4}, {1: 1, 2: 2, 4: 3})
    assert caps and caps.at(9) == 4 and caps.together(1, 1) and not caps.together(2, 1)
    assert caps.together(9, 3) and not caps.together(9, 2) and not caps.together(4, 2)
    assert not WidthCaps() and WidthCaps().together(8, 1)


GOOD_WIDTHS = {
    "verify_one": {"1": 1.0, "4": 1.1},
    "verify_five": {"1": 1.1, "4": 1.9},
    "draft": {"1": 0.3, "4": 0.4},
}
BAD_WIDTHS = [
    None,
    [1],
    "x",
    {},
    {**GOOD_WIDTHS, "draft": None},
    {**GOOD_WIDTHS, "draft": {"1": "0.3"}},
    {**GOOD_WIDTHS, "draft": {"1": -0.3}},
    {**GOOD_WIDTHS, "draft": {"one": 0.3}},
    {**GOOD_WIDTHS, "draft": {"1": float("inf")}},
    {**GOOD_WIDTHS, "draft": {"1": float("nan")}},
    {**GOOD_WIDTHS, "draft": {"0": 0.3, "1": 0.3}},
    {**GOOD_WIDTHS, "draft": {"4": 0.4}},
    {**GOOD_WIDTHS, "draft": {"1": True}},
]


def test_batch_width_costs_are_measured_once_and_a_bad_entry_again_with_a_notice(
    tiny_pair, tmp_path, monkeypatch, capsys
):
    """The server's width costs share draft-length.json: measured once, then read back; an entry
    that does not validate (a hand edit: strings, negatives, Infinity, NaN, a width of 0, no
    single-row cost) is measured again with one notice, never a crash or a nonsense cap."""
    import json

    from specgen.decoding.widths import WidthCosts, width_costs

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    measured = WidthCosts({1: 1.0, 4: 1.2}, {1: 1.1, 4: 2.0}, {1: 0.3, 4: 0.35})
    calls = []
    monkeypatch.setattr(widths, "_measure_widths", lambda pair: calls.append(1) or measured)
    target, draft = tiny_pair
    pair = SimpleNamespace(target=target, draft=draft)
    assert width_costs(pair) == measured and len(calls) == 1
    assert width_costs(pair) == measured and len(calls) == 1  # read back
    path = tmp_path / "draft-length.json"
    key = next(k for k in json.loads(path.read_text()) if k.startswith("width "))
    path.write_text(json.dumps({key: GOOD_WIDTHS}))
    assert width_costs(pair).verify_five == {1: 1.1, 4: 1.9} and len(calls) == 1
    for entry in BAD_WIDTHS:
        path.write_text(json.dumps({key: entry}))
        capsys.readouterr()
        before = len(calls)
        assert width_costs(pair) == measured and len(calls) == before + 1, entry
        assert "not valid; measuring them again" in capsys.readouterr().err, entry
        assert width_costs(pair) == measured and len(calls) == before + 1  # written back valid


def test_lookup_cost_is_the_targets_measured_verify_cost(tiny_pair, tmp_path, monkeypatch):
    """What lookup tokens cost: the measured verify of this target on this machine (whichever
    draft it was measured with, also for a pair with no draft); else CPU_PRICE a token on a CPU;
    None on a GPU."""
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    target, draft = tiny_pair
    alone, paired = SimpleNamespace(target=target, draft=None), SimpleNamespace(target=target, draft=draft)
    price = draft_length.CPU_PRICE  # nothing measured yet
    assert draft_length.lookup_cost(alone) == draft_length.VerifyCost(price, price)
    # verifies of 2, 3 and 5 tokens at 1.08, 1.12 and 1.2 steps
    monkeypatch.setattr(draft_length, "ratios", lambda *a, **k: (0.38, 1.08, 1.12, 1.2, 1.6, 0.045))
    draft_length.choose(paired)
    measured = draft_length.lookup_cost(paired)
    assert measured == draft_length.lookup_cost(alone) == draft_length.verify_cost(paired)
    assert [measured.steps(n) for n in (1, 2, 4)] == pytest.approx([1.08, 1.12, 1.2])
    cuda = SimpleNamespace(device=torch.device("cuda"))
    assert draft_length.lookup_cost(SimpleNamespace(target=cuda, draft=None)) is None
    # the verify is the target's: a pair with no draft, or a head (no entry of its own), prices
    # its rounds with what another draft measured for the same target
    head = SimpleNamespace(name="a-head", dtype="float32", weights="bf16", device=target.device)
    measured = draft_length.verify_cost(paired)
    assert measured is not None and measured.wide > 0
    assert (
        draft_length.verify_cost(alone)
        == draft_length.verify_cost(SimpleNamespace(target=target, draft=head))
        == measured
    )
    assert draft_length.verify_cost(SimpleNamespace(target=cuda, draft=None)) is None


def test_a_verify_costs_its_first_two_proposed_tokens_apart(tiny_pair, tmp_path, monkeypatch):
    """On a CPU a verify's cost steps rather than following a line: the first proposed token
    costs more than the others (the step leaves its single-row kernels), and on a Xeon with AMX
    a 3-token verify costs about what a 5-token one does. So the cost is measured at 2, 3 and 5
    tokens, cached with k, and read back as a VerifyCost that goes through all three; nothing is
    measured where nothing was cached."""
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    target, draft = tiny_pair
    pair = SimpleNamespace(target=target, draft=draft)
    assert draft_length.verify_cost(pair) is None and draft_length.verify_slope(pair) is None
    # a draft step, verifies of 2, 3 and 5 tokens (the second token dearer than the line's), of 13
    monkeypatch.setattr(draft_length, "ratios", lambda *a, **k: (0.36, 1.08, 1.14, 1.17, 1.49, 0.02))
    choice = draft_length.choose(pair)
    # the line from 3 to 5 tokens: 0.015 a token, the second 0.045 more; a chain's longest (6
    # proposed) then costs 1.20, and each token past it (1.49 - 1.20) / 6
    expected = draft_length.VerifyCost(
        pytest.approx(0.08), pytest.approx(0.015), pytest.approx(0.29 / 6), pytest.approx(0.045)
    )
    assert choice.verify == expected and "verifies of 2, 3, 5 and 13 tokens" in choice.reason
    cost = draft_length.verify_cost(pair)
    assert cost == expected
    assert [cost.steps(n) for n in (0, 1, 2, 3, 4, 5, 6, 12)] == [
        1.0,
        pytest.approx(1.08),
        pytest.approx(1.14),
        pytest.approx(1.155),
        pytest.approx(1.17),
        pytest.approx(1.185),
        pytest.approx(1.20),
        pytest.approx(1.49),
    ]
    assert draft_length.verify_slope(pair) == pytest.approx(0.17 / 4)  # a 5-token verify's, per token
    # a wide slope measured below the slope before it (noise) never makes wide verifies cheaper
    assert draft_length.VerifyCost(0.08, 0.03, 0.01).steps(8) == pytest.approx(1.29)
    cuda = SimpleNamespace(device=torch.device("cuda"))
    assert draft_length.verify_cost(SimpleNamespace(target=cuda, draft=cuda)) is None


def test_the_drafts_read_of_a_prompt_token_is_measured_with_the_draft_length(
    tiny_pair, tmp_path, monkeypatch
):
    """`choose` times the draft's reading of a prompt (in turn with a target step) on a CPU and
    keeps it with the draft length; `read_price` reads it back, never measuring; None where
    nothing was measured (another machine's cache, a GPU)."""
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))  # measured for real, on the tiny pair
    target, draft = tiny_pair
    pair = SimpleNamespace(target=target, draft=draft)
    assert draft_length.read_price(pair) is None  # not measured yet: not measured here either
    choice = draft_length.choose(pair)
    assert 0 < choice.read < 1 and "a prompt token read by the draft" in choice.reason
    assert draft_length.read_price(pair) == choice.read
    cuda = SimpleNamespace(device=torch.device("cuda"))
    assert draft_length.read_price(SimpleNamespace(target=cuda, draft=cuda)) is None


def test_prices_measured_at_another_thread_count_serve_a_drafter_built_at_this_one(
    tiny_pair, tmp_path, monkeypatch
):
    """The engine fits its threads to the free cores, so a drafter may be built at fewer threads
    than `choose` measured at: it takes this machine's entry of the most threads, never another
    machine's or another pair's."""
    import json

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    target, draft = tiny_pair
    pair = SimpleNamespace(target=target, draft=draft)
    parts = draft_length.pair_key(pair).split(draft_length.SEP)
    entry = {"k": 3, "reason": "measured", "verify_first": 0.05, "verify_slope": 0.02, "read": 0.03}

    def key(threads: str, **changed) -> str:
        return draft_length.SEP.join(
            changed.get(str(i), threads if i == draft_length.THREADS else part)
            for i, part in enumerate(parts)
        )

    count = int(parts[draft_length.THREADS])  # this process's thread count
    other = str(count + 16)  # counts it does not run at
    cache = {
        key(other): entry,
        key(str(count + 8)): dict(entry, read=0.01),  # fewer threads than `other`: not taken
        key(other, **{"1": "another CPU"}): dict(entry, read=0.09),
    }
    (tmp_path / "draft-length.json").write_text(json.dumps(cache))
    assert draft_length.read_price(pair) == 0.03
    assert draft_length.verify_cost(pair) == draft_length.VerifyCost(0.05, 0.02)
    # this thread count's own entry, where there is one, comes first
    cache[key(parts[draft_length.THREADS])] = dict(entry, read=0.02)
    (tmp_path / "draft-length.json").write_text(json.dumps(cache))
    assert draft_length.read_price(pair) == 0.02
    # another machine's entry alone prices nothing
    (tmp_path / "draft-length.json").write_text(json.dumps({key(other, **{"1": "another CPU"}): entry}))
    assert draft_length.read_price(pair) is None and draft_length.verify_cost(pair) is None


def test_the_verifies_are_timed_with_every_positions_logits(tiny_pair, monkeypatch):
    """The decode loop's verify reads the logits of every position it feeds (verify.forward), a
    plain step only its last, over a context of a prompt and an answer: the probes time each as
    the loop runs it, so that a verify's price in plain steps (the floor's, lookup's, the draft
    length's) is not a cheaper forward's."""
    target, draft = tiny_pair
    built = []
    real = probes.Probe.__init__

    def probe(self, model, width, *args, **kwargs):
        built.append((model is target.model, width, kwargs.get("keep", 1), kwargs.get("context", 32)))
        real(self, model, width, *args, **kwargs)

    monkeypatch.setattr(probes.Probe, "__init__", probe)
    ratios = probes.ratios(SimpleNamespace(target=target, draft=draft), repeats=1)
    assert all(r > 0 for r in ratios[:5])
    widths = [(width, keep) for on_target, width, keep, _ in built if on_target]
    assert widths == [(1, 1), (2, 0), (3, 0), (5, 0), (probes.WIDE, 0)]
    # over the context verifies meet (CONTEXT, or half a short model's), the draft step's too
    context = min(probes.CONTEXT, target.context_length // 2, draft.context_length // 2)
    assert [c for on_target, width, _, c in built if on_target or width == 1] == [context] * 6
