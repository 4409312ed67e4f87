"""The methods bench can run: specgen's engine methods (and variants of their draft length,
schedule and confidence stop), transformers' speculative modes and llama.cpp as references."""

from __future__ import annotations

from dataclasses import dataclass, replace

from specgen.bench import llamacpp as bench_llamacpp
from specgen.bench.references import REFERENCES
from specgen.bench.runners import EngineRunner, MethodSpec, Runner
from specgen.config import MAX_DRAFT_TOKENS, GenerationConfig, Method, Schedule
from specgen.decoding.build import why_not, why_not_draft
from specgen.errors import ConfigError
from specgen.models.families import text_config
from specgen.models.head_dir import is_head
from specgen.models.load import Vocabulary

PLAIN = Method.PLAIN.value


def registry() -> dict[str, MethodSpec]:
    """Every method bench can run, in the default order: specgen's engine methods, then the
    transformers references. New engine methods appear here as they land in `Method`."""
    specs = {}
    for method in Method:
        specs[method.value] = MethodSpec(
            method.value,
            method.needs_draft_model,
            lambda pair, m=method: EngineRunner(pair, m),
            f"specgen {method.value} decoding",
        )
    for reference in REFERENCES:
        specs[reference.name] = reference
    if bench_llamacpp.installed():  # optional extra: listed (and in the default run) once installed
        for name, description in bench_llamacpp.METHODS.items():
            specs[name] = MethodSpec(
                name, False, lambda pair, n=name: bench_llamacpp.LlamaCppRunner(pair, n), description
            )
    return specs


def variant(name: str) -> tuple[Method, dict] | None:
    """'chain/k2' -> (CHAIN, {draft_tokens: 2, schedule: fixed}); 'chain/additive' or
    'lookup/expected-gain' -> an adaptive schedule (up to the run's --draft-tokens, or 8 with
    'auto'); 'chain/c0.5' -> a draft confidence stop at 0.5 (--draft-confidence; c0: none); suffixes
    combine ('lookup-chain/k4/c0.5'). A tree method takes the stop only ('rsd-c/c0'). None when
    `name` is not a variant; a ConfigError when its method takes variants but a suffix is not one.
    Lets one bench run compare draft lengths, schedules and confidence stops of the same method,
    each against the same plain runs."""
    base, *suffixes = name.split("/")
    methods = {m.value: m for m in Method}
    if not suffixes or base not in methods or base == PLAIN:
        return None
    overrides: dict = {}
    for suffix in suffixes:
        if methods[base].is_tree and not (suffix[:1] == "c" and _fraction(suffix[1:]) is not None):
            raise ConfigError(
                f"'{name}' in --methods: /{suffix} is not a variant of {base}; a tree's size is its "
                "floor's, so its only variant is /cX (X in [0, 1): a confidence stop on its depth)"
            )
        if (
            suffix[:1] == "k"
            and suffix[1:].isascii()
            and suffix[1:].isdigit()
            and "draft_tokens" not in overrides
        ):
            if not 1 <= int(suffix[1:]) <= MAX_DRAFT_TOKENS:
                raise ConfigError(
                    f"'{name}' in --methods: /{suffix} drafts {int(suffix[1:])} tokens; a variant's k "
                    f"must be in 1..{MAX_DRAFT_TOKENS}"
                )
            overrides.update(draft_tokens=int(suffix[1:]), schedule=overrides.get("schedule", Schedule.FIXED))
        elif suffix[:1] == "c" and _fraction(suffix[1:]) is not None and "draft_confidence" not in overrides:
            overrides["draft_confidence"] = _fraction(suffix[1:])
        elif suffix in {s.value for s in Schedule} and "schedule_named" not in overrides:
            overrides.update(schedule=Schedule(suffix), schedule_named=True)
        else:  # a method that takes variants, with a suffix that is not one (or one given twice)
            raise ConfigError(
                f"'{name}' in --methods: /{suffix} is not a variant of {base} (or repeats one); "
                f"use /kN (N in 1..{MAX_DRAFT_TOKENS}), /cX (X in [0, 1): a confidence stop) or /fixed, "
                "/additive, /expected-gain"
            )
    overrides.pop("schedule_named", None)
    if "draft_tokens" in overrides:  # a k of the column's own: fixed means k, adaptive has the floor
        overrides["floor"] = overrides["schedule"] is not Schedule.FIXED
    return methods[base], overrides


def _fraction(text: str) -> float | None:
    """A confidence stop in [0, 1) (0: off), else None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 <= value < 1.0 else None


DRAFT_MARK = "@"


@dataclass(frozen=True)
class ExtraDraft:
    """A METHOD@DRAFT column's draft model, and the draft length measured for it with the
    target when the run's k is the device's (`--draft-tokens device`): its columns take that
    unless their variant names a k (`chain/k3@DRAFT`)."""

    model: object  # a LoadedModel
    overrides: dict  # draft_tokens / draft_confidence for this pair; {} when the run set k itself


def split_draft(name: str) -> tuple[str, str | None]:
    """'chain@smollm2-135m-instruct' -> ('chain', 'smollm2-135m-instruct'): a column that runs
    its method with another draft model than the run's --draft (loaded once beside it), so one
    bench run compares drafts against the same plain runs. ('chain', None) without a mark."""
    base, mark, draft = name.partition(DRAFT_MARK)
    return (base, draft) if mark else (name, None)


def extra_drafts(names: list[str]) -> list[str]:
    """The other draft models the columns name, each once, in order."""
    return list(dict.fromkeys(d for d in (split_draft(n)[1] for n in names) if d))


def _engine_method(name: str) -> Method | None:
    methods = {m.value: m for m in Method}
    return methods.get(name) or (variant(name) or (None,))[0]


def in_turn(items: list, turn: int) -> list:
    """The order a measurement's methods (or cells) run in on its `turn`-th pass: as given, then
    reversed, alternately (plain, chain, chain, plain, ...). A machine whose speed drifts
    steadily then costs every one of them the same over an even number of passes; in a fixed
    order the last would always run on the most drifted machine (benchmarks/methodology.md)."""
    return items if turn % 2 == 0 else items[::-1]


def parse_methods(text: str | None) -> list[str]:
    """A comma list -> method names, plain first (always measured: it is every denominator).

    Besides the registry's names, chain and lookup take variants: `chain/k2` (fixed k = 2),
    `chain/additive`, `chain/expected-gain`, `chain/fixed`, `chain/c0.5` (a confidence stop),
    combined as `chain/k4/c0.5` (see `variant`).
    """
    specs = registry()
    if text is not None and not [n for n in text.split(",") if n.strip()]:
        raise ConfigError(
            "--methods is empty; name methods (e.g. plain,chain) or leave it out for all of them"
        )
    # the default run: every method but eagle, which needs a head (--draft HEAD_DIR or eagle@HEAD_DIR)
    names = (
        [n for n in specs if n != Method.EAGLE.value]
        if text is None
        else [n.strip() if DRAFT_MARK in n else n.strip().lower() for n in text.split(",") if n.strip()]
    )
    for name in names:
        base, draft = split_draft(name)
        if draft is None:
            continue
        method = _engine_method(base.lower())
        if method is None or not method.needs_draft_model or not draft.strip():
            raise ConfigError(
                f"'{name}' in --methods: METHOD@DRAFT takes a specgen method that drafts with a "
                "model (chain, lookup-chain, rsd-c, ...) and a draft model after the @"
            )
    names = [
        f"{split_draft(n)[0].lower()}{DRAFT_MARK}{split_draft(n)[1]}" if split_draft(n)[1] else n
        for n in names
    ]
    # a llama.cpp column is known whether or not its package is installed (llamacpp.refuse_early)
    unknown = [
        n
        for n in names
        if n not in specs
        and n not in bench_llamacpp.METHODS
        and split_draft(n)[1] is None
        and variant(n) is None
    ]
    if unknown:
        raise ConfigError(
            f"unknown method '{unknown[0]}' in --methods; choose from: {', '.join(specs)} "
            "(chain and lookup also take /kN, /cX (confidence stop) or /fixed, /additive, /expected-gain; "
            "a method that drafts with a model takes @DRAFT for another draft model)"
        )
    ordered = [PLAIN] + [n for n in names if n != PLAIN]
    return list(dict.fromkeys(ordered))


def check_settings(names: list[str], config: GenerationConfig) -> None:
    """Validate `config` as each engine method would see it, before any model is loaded."""
    engine_methods = {m.value: m for m in Method}
    for name in (split_draft(n)[0] for n in names):
        if name in engine_methods:
            replace(config, method=engine_methods[name])
        elif variant(name) is not None:
            method, overrides = variant(name)
            replace(config, method=method, **overrides)


def needs_draft(names: list[str]) -> bool:
    """Whether a column runs with the run's own --draft (a METHOD@DRAFT column brings its own)."""
    specs = registry()
    return any(
        specs[n].needs_draft if n in specs else variant(n)[0].needs_draft_model
        for n in names
        if split_draft(n)[1] is None
    )


def unsupported(pair, name: str, drafts: dict[str, ExtraDraft] | None = None) -> str | None:
    """Why column `name` cannot run on this pair, or None: llama.cpp without a GGUF target; what
    the engine refuses of its draft
    (build.why_not: trees of a draft with another tokenizer, eagle without a head, a head's
    beams), transformers' assisted generation with a head or with a draft of another tokenizer
    or vocabulary size (it refuses them)."""
    if name in bench_llamacpp.METHODS and not pair.target.gguf:
        return f"{name} (llama.cpp) needs a GGUF target; {pair.target.name} was not loaded from one"
    base, draft_name = split_draft(name)
    draft = (drafts or {})[draft_name].model if draft_name is not None else pair.draft
    if draft is None:
        return None
    other = draft.vocabulary is Vocabulary.TEXT
    method = _engine_method(base.lower())
    if method is Method.EAGLE and draft.vocabulary is not Vocabulary.HEAD:
        return _needs_head(name)
    if method is not None:  # what the engine itself refuses of this draft (decoding/build.why_not)
        why = why_not(replace(pair, draft=draft), method)
        return None if why is None else f"{name}: {why}"
    assisted = any(r.name == name and r.needs_draft for r in REFERENCES)
    if assisted and draft.vocabulary is Vocabulary.HEAD:
        return f"{name} (transformers' assisted generation) needs a draft model, not an EAGLE-3 head"
    if assisted and (
        other
        or text_config(draft.model.config).vocab_size != text_config(pair.target.model.config).vocab_size
    ):
        return (
            f"{name} (transformers' assisted generation) needs a draft with the target's tokenizer and "
            "vocabulary size; this draft's differ"
        )
    return None


def unsupported_before_load(name: str, draft: str | None) -> str | None:
    """What `unsupported` will say of column `name` that its draft's argument tells before
    anything loads (the run's --draft, or the column's own @DRAFT): eagle without a head, a
    method no draft of that kind serves (build.why_not_draft). A bench run that names such a
    column was refused only after loading the pair (22 s of the default pair's)."""
    base, own = split_draft(name)
    method = _engine_method(base.lower())
    spec = own if own is not None else draft
    if method is None or spec is None:
        return None
    if method is Method.EAGLE and not is_head(spec):
        return _needs_head(name)
    why = why_not_draft(spec, method)
    return None if why is None else f"{name}: {why}"


def _needs_head(name: str) -> str:
    return f"{name} needs an EAGLE-3 head as its draft: --draft HEAD_DIR, or eagle@HEAD_DIR"


def build_runner(pair, name: str, drafts: dict[str, ExtraDraft] | None = None) -> Runner:
    """The runner of column `name`; `drafts` maps each METHOD@DRAFT column's draft to its
    ExtraDraft (the model from runtime.pair.load_draft_alone). A column that cannot run on this
    pair (`unsupported`) is a ConfigError before anything is measured."""
    why = unsupported(pair, name, drafts)
    if why is not None:
        raise ConfigError(why, hint="leave it out of --methods")
    specs = registry()
    base, draft = split_draft(name)
    if draft is not None:
        extra = (drafts or {})[draft]
        method = _engine_method(base)
        overrides = extra.overrides | (variant(base)[1] if variant(base) is not None else {})
        return EngineRunner(replace(pair, draft=extra.model), method, name, overrides)
    if name in specs:
        return specs[name].build(pair)
    if name in bench_llamacpp.METHODS:  # named, its package not installed: LlamaCppRunner says so
        return bench_llamacpp.LlamaCppRunner(pair, name)
    method, overrides = variant(name)
    return EngineRunner(pair, method, name, overrides)
