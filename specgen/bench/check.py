"""`specgen check`: specgen's greedy output against transformers' own `generate`, on your pair.

The promise is that every method, batched or alone, beside rows of other methods in one batch
(as `specgen serve` batches them), from a fresh cache or a cached prefix, is token for token
what the target alone would produce. This runs the same prompts through
transformers' `generate(do_sample=False)` on the loaded target (the reference, which equals a
full recompute), then through each `Case` (a method and a path through the engine), and
reports for each: identical, or the first token that differs, with the reference's logit gap
there (a gap of a few thousandths is a rounding near-tie of a 16-bit format; a large one is a
bug). The prompts are longer than the model's longest sliding window, so windows are crossed.

The family matrix of the tests (tests/test_families.py) runs the same machinery on tiny models
of every family.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from specgen.bench.references import _quiet_generate, hf_generate_kwargs
from specgen.config import GenerationConfig, Method, SamplingConfig
from specgen.decoding.build import build_engine
from specgen.decoding.engine import Engine
from specgen.decoding.events import Finished
from specgen.decoding.feed import ListFeed, Request
from specgen.decoding.policy import Policy
from specgen.decoding.prompts import encode_prompt
from specgen.errors import ConfigError
from specgen.models import families
from specgen.models.load import Vocabulary
from specgen.runtime.pair import Pair
from specgen.runtime.prefixes import PrefixStore

TEXTS = (
    "Rewrite this function so that it streams the file instead of reading it whole, and explain the "
    "change:\n\n"
    "def count_words(path):\n    with open(path) as f:\n        text = f.read()\n    counts = {}\n"
    "    for word in text.split():\n        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
    "Continue the story in the same voice. The lighthouse keeper had not seen a ship in eleven days. Each "
    "evening he climbed the hundred and twelve steps, trimmed the wick, wound the clockwork and wrote a line "
    "in the log: no ships, wind from the west, the lamp burning clear.",
    "Extend this list in the same format for ten more items.\n- apple: red, sweet, grows on trees\n"
    "- lemon: yellow, sour, grows on trees\n- carrot: orange, sweet, grows in the ground\n"
    "- potato: brown, starchy, grows in the ground\n",
)
FOLLOW_UP = "Now say the same thing in half as many words."
CHUNK = 8  # the CHUNKED path: prompts prefilled this many tokens per round beside decoding rows


class Path(str, enum.Enum):
    """How a case's prompts go through the engine."""

    ALONE = "alone"  # one prompt at a time, fresh caches
    BATCHED = "batched"  # every prompt in one batch: rows of different lengths side by side
    CACHED = "cached"  # run twice through a prefix store: the second run's prompts come from it
    CHUNKED = "chunked"  # one row at a time beside a decoding row, its prompt prefilled in chunks
    CHAT = "chat turn"  # a second turn (prompt, answer, follow-up) that keeps the first turn's cache
    # one batch of rows of every checked method (a server's clients asking for different methods),
    # every prompt among them: the case's method is the first row's; every row is compared
    MIXED = "mixed batch"


@dataclass(frozen=True)
class Mismatch:
    prompt: int  # which prompt (0-based; the text line counts from 1)
    position: int  # the first new token that differs (0-based; the text line counts from 1)
    expected: int | None  # the reference's token there (None: the reference had ended)
    got: int | None  # specgen's (None: specgen had ended)
    method: Method  # the row's method: the case's, or in a mixed batch its own
    gap: float | None = None  # the reference's logit(expected) - logit(got) there


@dataclass(frozen=True)
class Case:
    """One case of `specgen check`: a method and a path through the engine; once `check` has
    run it, also what it found (its first mismatch on each prompt that differs) and its seconds."""

    method: Method
    path: Path = Path.ALONE
    deterministic: bool = False
    # what `check` found (a case compares equal to the case it ran)
    mismatches: tuple[Mismatch, ...] = field(default=(), compare=False)
    seconds: float = field(default=0.0, compare=False)

    @property
    def label(self) -> str:
        parts = [self.method.value] + ([self.path.value] if self.path is not Path.ALONE else [])
        return ", ".join(parts + (["deterministic"] if self.deterministic else []))

    @property
    def identical(self) -> bool:
        return not self.mismatches


def standard_cases(pair: Pair) -> list[Case]:
    """Every method the pair can run, and each path once: what `specgen check` runs."""
    cases = [
        Case(Method.PLAIN),
        Case(Method.PLAIN, Path.BATCHED),
        Case(Method.PLAIN, Path.CACHED),
        Case(Method.PLAIN, Path.CHUNKED),
        Case(Method.PLAIN, Path.CHAT),
        Case(Method.LOOKUP),
        Case(Method.SUFFIX),  # the memory fills across the cases' prompts: later ones draft from it
        Case(Method.SUFFIX, Path.BATCHED),
    ]
    head = pair.draft is not None and pair.draft.vocabulary is Vocabulary.HEAD
    chain = Method.EAGLE if head else Method.CHAIN
    if pair.draft is not None:
        cases += [Case(chain), Case(chain, Path.BATCHED), Case(Method.LOOKUP_CHAIN)]
        if pair.draft.vocabulary is not Vocabulary.TEXT:  # trees: a draft model's or a head's
            cases.append(Case(Method.RSD_C))
        if pair.draft.vocabulary is Vocabulary.SHARED:  # a draft model's beams and sibling drafts
            cases += [Case(Method.RSD_S), Case(Method.MULTI_DRAFT)]
        if head:  # a head reads the target's features, which the cache carries through these paths too
            cases += [Case(chain, Path.CACHED), Case(chain, Path.CHUNKED), Case(chain, Path.CHAT)]
    cases.append(Case(chain if pair.draft is not None else Method.PLAIN, deterministic=True))
    cases.append(Case(chain if pair.draft is not None else Method.PLAIN, Path.MIXED))
    return cases


def mixed_methods(cases: list[Case]) -> list[Method]:
    """The methods a mixed batch's rows take turns in: those of the cases checked, the case's
    own first."""
    mixed = [c.method for c in cases if c.path is Path.MIXED]
    return list(dict.fromkeys(mixed + [c.method for c in cases if not c.deterministic]))


def check_prompts(pair: Pair, count: int, new_tokens: int) -> list[list[int]]:
    """`count` prompts through the target's chat template, each longer than its longest sliding
    window (within the context, leaving room for the chat case's second turn), of different
    lengths."""
    tokenizer, config = pair.target.tokenizer, pair.target.model.config
    windows = [w for w in families.windows(config).values() if w is not None]
    follow_up = len(encode_prompt(tokenizer, FOLLOW_UP, raw=True))
    room = pair.target.context_length - 2 * new_tokens - follow_up - 1  # a chat turn's second prompt fits
    if room < 2 + 8 * count:
        raise ConfigError(
            f"the target's context ({pair.target.context_length} tokens) leaves no room for "
            f"prompts and {new_tokens} new tokens in two turns",
            hint="use fewer --max-new-tokens",
        )
    prompts = []
    for i in range(count):
        text = TEXTS[i % len(TEXTS)]
        ids = encode_prompt(tokenizer, text)
        want = min(room, max(windows) + 16 + 8 * i) if windows else 0
        while len(ids) < want:
            text += "\n\n" + TEXTS[i % len(TEXTS)]
            ids = encode_prompt(tokenizer, text)
        limit = room - 8 * i  # prompts cut to fit still differ in length
        prompts.append(ids[-limit:] if len(ids) > limit else ids)
    return prompts


@torch.inference_mode()
def reference(pair: Pair, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy `generate` on the target: the tokens after `prompt`."""
    target = pair.target
    kwargs = hf_generate_kwargs(target, SamplingConfig(), new_tokens)
    ids = torch.tensor([prompt], device=target.device)
    with _quiet_generate():
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    return out[0, len(prompt) :].tolist()


def check(
    pair: Pair,
    prompts: list[list[int]],
    cases: list[Case],
    new_tokens: int,
    on_result: Callable[[Case], None] = lambda result: None,
    make_engine: Callable[..., Engine] = build_engine,
) -> list[Case]:
    """Each case run on `prompts` and compared with the reference: the cases with what they
    found; `on_result` is told of each as it ends. `make_engine(pair, config, policy=...)` builds
    an engine (build_engine's signature)."""
    expected = [reference(pair, p, new_tokens) for p in prompts]
    follow_up = encode_prompt(pair.target.tokenizer, FOLLOW_UP, raw=True)
    second = [p + e + follow_up for p, e in zip(prompts, expected)]
    chat_expected: list[list[int]] | None = None
    results = []
    for case in cases:
        started = time.perf_counter()
        config = GenerationConfig(
            method=case.method,
            max_new_tokens=new_tokens,
            draft_tokens=4,
            deterministic=case.deterministic,
            verify_window=8,
        )
        if case.path is Path.CHAT:
            if chat_expected is None:
                chat_expected = [reference(pair, p, new_tokens) for p in second]
            got = _chat(pair, config, prompts, second, make_engine)
            found = _compare(pair, case.method, second, chat_expected, got)
        elif case.path is Path.MIXED:
            found = _mixed(pair, config, mixed_methods(cases), prompts, expected, make_engine)
        else:
            got = _run(pair, config, case.path, prompts, make_engine)
            found = _compare(pair, case.method, prompts, expected, got)
        result = replace(case, mismatches=found, seconds=time.perf_counter() - started)
        on_result(result)
        results.append(result)
    return results


def _compare(pair: Pair, method: Method, asked, want, got) -> tuple[Mismatch, ...]:
    """Each prompt's first mismatch, for the prompts whose output differs."""
    return tuple(
        m
        for i in range(len(asked))
        if (m := _mismatch(pair, method, i, asked[i], want[i], got[i])) is not None
    )


def _mixed(
    pair: Pair,
    config: GenerationConfig,
    methods: list[Method],
    prompts: list[list[int]],
    expected: list[list[int]],
    make_engine: Callable[..., Engine],
) -> tuple[Mismatch, ...]:
    """Rows of every method, each prompt at least once, all in one batch (row j: method j and
    prompt j, each list taken in turn): each prompt's first row that differs."""
    rows = [(j % len(prompts), methods[j % len(methods)]) for j in range(max(len(methods), len(prompts)))]
    requests = [Request(prompts[i], j, replace(config, method=m)) for j, (i, m) in enumerate(rows)]
    finished = {
        r.index: r.state.final_ids()
        for r in make_engine(pair, config).drive(ListFeed(requests), len(requests))
        if isinstance(r.event, Finished)
    }
    found = {}
    for j, (i, method) in enumerate(rows):
        if i not in found:
            mismatch = _mismatch(pair, method, i, prompts[i], expected[i], finished[j])
            if mismatch is not None:
                found[i] = mismatch
    return tuple(found[i] for i in sorted(found))


def _run(
    pair: Pair,
    config: GenerationConfig,
    path: Path,
    prompts: list[list[int]],
    make_engine: Callable[..., Engine],
) -> list[list[int]]:
    if path is Path.CACHED:  # a store of its own: the first run fills it, the second is compared
        pair = replace(
            pair, target_prefixes=PrefixStore(budget=1 << 30), draft_prefixes=PrefixStore(budget=1 << 30)
        )
        _finals(make_engine(pair, config), prompts, config, 1)
        return _finals(make_engine(pair, config), prompts, config, 1)
    if path is Path.CHUNKED:  # each prompt joins a row that decodes: its prefill comes a chunk per round
        engine = make_engine(pair, config, policy=Policy(prefill_chunk=CHUNK))
        outputs = []
        for prompt in prompts:
            feed = _Staggered(prompt[: max(1, CHUNK // 2)], prompt, config, len(prompt) // CHUNK + 4)
            finished = {
                r.index: r.state.final_ids() for r in engine.drive(feed, 2) if isinstance(r.event, Finished)
            }
            outputs.append(finished[1])
        return outputs
    engine = make_engine(pair, config)
    return _finals(engine, prompts, config, len(prompts) if path is Path.BATCHED else 1)


class _Staggered:
    """A feed that gives a short lead prompt first and `prompt` once the lead decodes, so that
    `prompt` is staged (prefilled a chunk per round beside it) instead of joining at once."""

    def __init__(self, lead: list[int], prompt: list[int], config: GenerationConfig, lead_tokens: int):
        self.waiting = [
            Request(lead, 0, replace(config, max_new_tokens=config.max_new_tokens + lead_tokens)),
            Request(prompt, 1, config),
        ]

    def take(self, room: int) -> list[Request]:
        return [self.waiting.pop(0)] if self.waiting and room else []

    def dropped(self) -> set[int]:
        return set()


def _finals(
    engine: Engine, prompts: list[list[int]], config: GenerationConfig, batch_size: int
) -> list[list[int]]:
    finished = {
        r.index: r.state.final_ids()
        for r in engine.generate(prompts, config, batch_size)
        if isinstance(r.event, Finished)
    }
    return [finished[i] for i in range(len(prompts))]


def _chat(
    pair: Pair, config: GenerationConfig, prompts, second, make_engine: Callable[..., Engine]
) -> list[list[int]]:
    """Turn 1, then turn 2 (turn 1's prompt and the reference's answer, and a follow-up)
    resuming that engine's cache: what turn 1 left that turn 2 shares is kept, not prefilled."""
    outputs = []
    for prompt, follow in zip(prompts, second):
        engine = make_engine(pair, config)
        state = None
        for report in engine.generate([prompt], config):
            state = report.state
        for report in engine.generate([follow], config, resume=state):
            state = report.state
        outputs.append(state.final_ids())
    return outputs


def _mismatch(
    pair: Pair, method: Method, index: int, prompt: list[int], expected: list[int], got: list[int]
) -> Mismatch | None:
    if got == expected:
        return None
    position = next(
        (i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got))
    )
    want = expected[position] if position < len(expected) else None
    have = got[position] if position < len(got) else None
    gap = None
    if want is not None and have is not None:
        with torch.inference_mode():
            ids = torch.tensor([prompt + expected[:position]], device=pair.target.device)
            logits = pair.target.model(ids, use_cache=False).logits[0, -1].float()
        gap = float(logits[want] - logits[have])
    return Mismatch(index, position, want, have, method, gap)


def near_tie(pair: Pair) -> float:
    """Logit gaps below this are within the rounding of the target's format: a 16-bit format's
    last bits, or fp32's (the int8 path computes in fp32)."""
    return 0.1 if pair.target.dtype in (torch.bfloat16, torch.float16) else 1e-3


def describe(result: Case, pair: Pair, prompts: int) -> str:
    """One line: identical, or where it first differs and by what."""
    if result.identical:
        return f"identical on {prompts} of {prompts} prompts"
    first = result.mismatches[0]
    tokenizer = pair.target.tokenizer

    def text(token: int | None) -> str:
        return "the end" if token is None else f"{tokenizer.decode([token])!r} (id {token})"

    row = f" ({first.method.value}'s row)" if first.method is not result.method else ""
    line = (
        f"differs on {len(result.mismatches)} of {prompts} prompts; prompt {first.prompt + 1}{row}, new "
        f"token {first.position + 1}: {text(first.got)} where transformers gives {text(first.expected)}"
    )
    if first.gap is not None:
        kind = "a rounding near-tie" if abs(first.gap) < near_tie(pair) else "not a near-tie"
        line += f"; the reference's logits {first.gap:.3g} apart there, {kind}"
    return line
