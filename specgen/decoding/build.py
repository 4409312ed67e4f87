"""From a loaded pair and a generation config to a ready engine: the drafter the method needs
and the draft length the device favours."""

from __future__ import annotations

import enum
import functools
import os
from dataclasses import dataclass, replace
from typing import Callable

from specgen.config import SUFFIX_TOKENS, GenerationConfig, Method
from specgen.decoding import costs
from specgen.decoding.drafters.base import Drafter, NoDrafter, PerRow, ReadRule
from specgen.decoding.drafters.eagle import EagleDrafter, EagleTreeDrafter
from specgen.decoding.drafters.lookup import PromptLookupDrafter
from specgen.decoding.drafters.lookup_chain import LookupChain
from specgen.decoding.drafters.mixed import Mixed
from specgen.decoding.drafters.model import GAIN, GAIN_BESIDE_LOOKUP, ChainDrafter
from specgen.decoding.drafters.retokenize import Bridge
from specgen.decoding.drafters.suffix import SuffixDrafter
from specgen.decoding.drafters.text import TextDrafter
from specgen.decoding.drafters.tree import GAIN_TREE, MultiDraft, RSDConstant, RSDStochasticBeam
from specgen.decoding.engine import Engine
from specgen.decoding.policy import Policy
from specgen.errors import ConfigError
from specgen.models.families import text_config
from specgen.models.head_dir import is_head
from specgen.models.load import Vocabulary
from specgen.runtime import features, head_memory, pruned
from specgen.runtime.compiled import can_capture
from specgen.runtime.pair import Pair
from specgen.runtime.suffix import MIN_PROB
from specgen.status import note
from specgen.text import special_ids


def resolve_draft_length(pair: Pair, config: GenerationConfig, drafts: bool | None = None):
    """`--draft-tokens device` (the default): the k measured best for this pair on this device,
    with the floor under every row (decoding/floor.py): a k the device chose is only a ceiling.

    Returns (config with k set and the placeholder cleared, the costs.DraftLength or None).
    `drafts`: whether a method that drafts with the model will run (default: from
    config.method; bench, which runs several methods, says so itself). Chains take the device's k
    and stop; trees, whose size the floor sets, its stop, and the verify costs `choose` measures
    (floor.first_ceiling), which a first `--method rsd-c` on a machine would otherwise lack."""
    config = replace(config, method=runs_as(pair, config.method))
    if not config.device_draft_tokens:
        return config, None
    if drafts is None:
        drafts = config.method in (Method.CHAIN, Method.LOOKUP_CHAIN, Method.EAGLE) or config.method.is_tree
    if config.method is Method.SUFFIX:  # the memory's counts say how far a round drafts
        return replace(config, draft_tokens=SUFFIX_TOKENS, device_draft_tokens=False, floor=True), None
    if pair.draft is None or not drafts:
        return replace(config, device_draft_tokens=False, floor=True), None
    choice = costs.choose(pair)  # a few seconds, once per machine and pair; cached after that
    confidence = choice.confidence if config.device_confidence else config.draft_confidence
    return replace(
        config, draft_tokens=choice.k, device_draft_tokens=False, draft_confidence=confidence, floor=True
    ), choice


class DraftKind(enum.Enum):
    """What a pair's draft is, as a drafter sees it."""

    NONE = "none"  # no draft loaded
    MODEL = "model"  # a model of the target's tokenizer
    TEXT = "text"  # a model of another tokenizer: drafts go through text
    HEAD = "head"  # an EAGLE-3 head on the target's features


def draft_kind(pair: Pair) -> DraftKind:
    if pair.draft is None:
        return DraftKind.NONE
    return {
        Vocabulary.SHARED: DraftKind.MODEL,
        Vocabulary.TEXT: DraftKind.TEXT,
        Vocabulary.HEAD: DraftKind.HEAD,
    }[pair.draft.vocabulary]


@dataclass(frozen=True)
class Entry:
    """One cell of the table: the drafter of a method for a kind of draft, what one draft token
    costs against a target step (the adaptive schedules' cost; measured on the default pair on a
    CPU), and the method it runs as (chain with a head is eagle: a head drafts chains)."""

    make: Callable[[Pair, GenerationConfig], Drafter]
    cost: float
    runs: Method


def _chain(pair: Pair, config: GenerationConfig, vocab: int | None = None) -> ChainDrafter:
    """The draft model's chains (`vocab`: the ids it may propose; the pair's by default), with
    the device's price of reading a prompt token (None where unmeasured) and what its drafts save
    a token beside lookup (lookup-chain) or alone: a row whose read costs more than its drafts
    can save drafts nothing with the model (drafters/model.py)."""
    draft = pair.draft
    return ChainDrafter(
        draft.model,
        draft.device,
        pair.vocab if vocab is None else vocab,
        config.draft_confidence,
        pair.compile,
        pair.draft_prefixes,
        read_price=costs.read_price(pair),
        gain=GAIN_BESIDE_LOOKUP if config.method is Method.LOOKUP_CHAIN else GAIN,
    )


def _text(pair: Pair, config: GenerationConfig) -> Drafter:
    """A draft of another tokenizer: chains drafted in its own ids, proposed to the target
    through text (drafters/text.py); never an id its tokenizer lacks."""
    draft = pair.draft
    vocab = min(len(draft.tokenizer), text_config(draft.model.config).vocab_size)
    return TextDrafter(_chain(pair, config, vocab), Bridge(pair.target.tokenizer, draft.tokenizer))


def _head(pair: Pair, config: GenerationConfig) -> Drafter:
    features.install(pair.target.model)
    vocab = pair.target.model.get_input_embeddings().weight.shape[0]
    return EagleDrafter(
        pair.draft.model, pair.draft.device, vocab, pair.draft_prefixes, pair.compile, config.draft_confidence
    )


def _head_tree(pair: Pair, config: GenerationConfig) -> Drafter:
    features.install(pair.target.model)
    vocab = pair.target.model.get_input_embeddings().weight.shape[0]
    return EagleTreeDrafter(
        pair.draft.model,
        pair.draft.device,
        vocab,
        config.tree_levels,
        pair.draft_prefixes,
        pair.compile,
        config.draft_confidence,
    )


def _then_lookup(chain: Callable[[Pair, GenerationConfig], Drafter]):
    """lookup-chain: prompt lookup where the tail repeats, then the suffix memory, `chain`'s
    drafts otherwise."""
    return lambda pair, config: LookupChain(
        chain(pair, config),
        model_tokens=config.draft_tokens,
        make_lookup=_priced(pair),
        memories=pair.memories,
    )


def _lookup(pair: Pair, config: GenerationConfig) -> Drafter:
    """lookup: the row's own text (any n-gram match), then the suffix memory; no model."""
    return LookupChain(NoDrafter(), min_match=1, make_lookup=_priced(pair), memories=pair.memories)


def _priced(pair: Pair) -> Callable[[], PromptLookupDrafter]:
    """Each row's lookup, its copies cut to what a verify costs here and before the target
    tokenizer's control tokens (lookup.py)."""
    never = frozenset(special_ids(pair.target.tokenizer))
    return functools.partial(PromptLookupDrafter, cost=costs.lookup_cost(pair), never=never)


def _per_row(kind) -> Callable[[Pair, GenerationConfig], Drafter]:
    def make(pair: Pair, config: GenerationConfig) -> Drafter:
        draft = pair.draft
        # the rows' searches share the draft model's head: its widening and its memory
        widening, remember = pruned.widening(draft.model), head_memory.keeper(draft.model)
        stop = config.draft_confidence  # a tree's stop on its depth, as a chain's on its length
        return PerRow(
            lambda: kind(draft.model, draft.device, config.tree_levels, pair.vocab, pair.compile, stop),
            widening,
            remember,
            ReadRule(costs.read_price(pair), GAIN_TREE),  # a row reads its prompt where that pays
        )

    return make


MODEL_COST, LOOKUP_COST = 0.38, 0.05  # a draft model's token, a lookup token (verify only)
SUFFIX_BRANCHES = 3  # siblings per node of a suffix draft's tree
SUFFIX_BRANCHES_ENV = "SPECGEN_SUFFIX_BRANCHES"


def suffix_branches(pair: Pair) -> int:
    """Siblings per node of `--method suffix`'s drafts: a tree of the most frequent continuations
    wherever the verify's cost allows, else chains. Every node of the tree is at least
    suffix.MIN_PROB likely, so it pays where one more verified token costs less than that many
    target steps: on a GPU next to nothing, on the CPUs measured 0.07-0.1 (where trees ran
    2.85x plain against 2.73x for chains on the suffix workload: benchmarks/suffix.md). Chains
    where the device's measured verify slope says otherwise. SUFFIX_BRANCHES_ENV=N sets it (1:
    chains), to measure either; another value is ignored with a note."""
    chosen = os.environ.get(SUFFIX_BRANCHES_ENV, "").strip()
    if chosen.isdigit() and int(chosen) > 0:
        return int(chosen)
    if chosen:
        note(f"specgen: {SUFFIX_BRANCHES_ENV}={chosen!r} is not a positive whole number; ignored")
    slope = costs.verify_slope(pair)  # None where unmeasured (a GPU, a pair without a draft)
    return 1 if slope is not None and slope >= MIN_PROB else SUFFIX_BRANCHES


_ANY = tuple(DraftKind)
# (method, kind of draft) -> the drafter that serves it; a pair missing from the table is refused
TABLE: dict[tuple[Method, DraftKind], Entry] = {
    **{(Method.PLAIN, kind): Entry(lambda pair, config: NoDrafter(), 0.0, Method.PLAIN) for kind in _ANY},
    **{(Method.LOOKUP, kind): Entry(_lookup, LOOKUP_COST, Method.LOOKUP) for kind in _ANY},
    **{
        (Method.SUFFIX, kind): Entry(
            lambda pair, config: SuffixDrafter(pair.memories, suffix_branches(pair)),
            LOOKUP_COST,
            Method.SUFFIX,
        )
        for kind in _ANY
    },
    (Method.CHAIN, DraftKind.MODEL): Entry(_chain, MODEL_COST, Method.CHAIN),
    (Method.CHAIN, DraftKind.TEXT): Entry(_text, MODEL_COST, Method.CHAIN),
    (Method.CHAIN, DraftKind.HEAD): Entry(_head, MODEL_COST, Method.EAGLE),  # a head's chains: eagle
    (Method.EAGLE, DraftKind.HEAD): Entry(_head, MODEL_COST, Method.EAGLE),
    (Method.LOOKUP_CHAIN, DraftKind.MODEL): Entry(_then_lookup(_chain), MODEL_COST, Method.LOOKUP_CHAIN),
    (Method.LOOKUP_CHAIN, DraftKind.TEXT): Entry(_then_lookup(_text), MODEL_COST, Method.LOOKUP_CHAIN),
    (Method.LOOKUP_CHAIN, DraftKind.HEAD): Entry(_then_lookup(_head), MODEL_COST, Method.LOOKUP_CHAIN),
    (Method.RSD_C, DraftKind.MODEL): Entry(_per_row(RSDConstant), MODEL_COST, Method.RSD_C),
    (Method.RSD_C, DraftKind.HEAD): Entry(_head_tree, MODEL_COST, Method.RSD_C),
    (Method.MULTI_DRAFT, DraftKind.MODEL): Entry(_per_row(MultiDraft), MODEL_COST, Method.MULTI_DRAFT),
    (Method.RSD_S, DraftKind.MODEL): Entry(_per_row(RSDStochasticBeam), MODEL_COST, Method.RSD_S),
}


def why_not(pair: Pair, method: Method) -> str | None:
    """Why this pair's draft cannot run `method` (None when it can): the table has no cell for
    them, said in the words of what is missing."""
    kind = draft_kind(pair)
    if (method, kind) in TABLE:
        return None
    return _refused(method, kind, None if pair.draft is None else pair.draft.name)


def why_not_draft(draft: str | None, method: Method) -> str | None:
    """What `why_not` will say of `method` with the draft `draft` (a --draft argument; None: no
    draft), where the argument alone tells before anything is loaded: whether it is an EAGLE-3
    head's directory or a model (whether a model shares the target's tokenizer is known only
    once both are loaded, so a model is refused here only where neither kind of model could
    serve). `specgen run --method eagle` without a head said so only after the pair's 15-second
    load."""
    if not method.needs_draft_model:
        return None
    if draft is None:
        kinds = (DraftKind.NONE,)
    elif is_head(draft):
        kinds = (DraftKind.HEAD,)
    else:
        kinds = (DraftKind.MODEL, DraftKind.TEXT)
    if any((method, kind) in TABLE for kind in kinds):
        return None
    return _refused(method, kinds[0], draft)


def check_draft(draft: str | None, method: Method) -> None:
    """A ConfigError before the pair loads where `why_not_draft` already knows the answer."""
    why = why_not_draft(draft, method)
    if why is not None:
        raise ConfigError(why)


def _refused(method: Method, kind: DraftKind, name: str | None) -> str:
    """Why a draft of `kind` named `name` cannot run `method`, in the words of what is missing."""
    if kind is DraftKind.NONE:
        return f"method {method.value} needs a draft model; plain, lookup and suffix need none"
    if kind is DraftKind.TEXT:
        return (
            f"method {method.value} drafts trees, which need a draft with the target's tokenizer; "
            f"{name}'s differs (use chain or lookup-chain: they draft its text)"
        )
    if method is Method.EAGLE:
        return (
            f"method eagle needs an EAGLE-3 head as the draft (a directory; `specgen train-head` writes "
            f"one); {name} is a model"
        )
    heads = ", ".join(m.value for m in Method if (m, DraftKind.HEAD) in TABLE and m.needs_draft_model)
    return f"method {method.value} needs a draft model; an EAGLE-3 head drafts {heads}"


def make_drafter(pair: Pair, config: GenerationConfig) -> Drafter:
    """The drafter of `config.method` for the rows of a batch (one row or many)."""
    why = why_not(pair, config.method)
    if why is not None:
        raise ConfigError(why)
    return TABLE[config.method, draft_kind(pair)].make(pair, config)


def runs_as(pair: Pair, method: Method) -> Method:
    """The method `method` runs as on this pair (chain with an EAGLE-3 head is eagle)."""
    entry = TABLE.get((method, draft_kind(pair)))
    return entry.runs if entry is not None else method


def draft_cost(pair: Pair, method: Method) -> float:
    """What one draft token of `method` costs against a target step, for the adaptive schedules."""
    entry = TABLE.get((method, draft_kind(pair)))
    return entry.cost if entry is not None else MODEL_COST


def mixed(pair: Pair) -> Mixed:
    """The drafter of a batch whose rows each bring their own drafting (drafters/mixed.py): the
    table's drafter of a row's method, built on its first row; a head's layers tapped."""
    taps = ()
    if draft_kind(pair) is DraftKind.HEAD:  # the target cache keeps the head's features from the start
        features.install(pair.target.model)
        taps = tuple(pair.draft.model.config.layers)
    return Mixed(lambda config: make_drafter(pair, config), taps)


def build_engine(
    pair: Pair, config: GenerationConfig, after: Engine | None = None, policy: Policy = Policy()
) -> Engine:
    """An engine for the pair whose rows draft each as their own config says (every method the
    table gives this pair, in one batch), checked for `config.method`; `after`: an engine whose
    target cache (and the rows it parked) it continues from; `policy`: how it schedules rounds
    (a server's)."""
    why = why_not(pair, config.method)
    if why is not None:
        raise ConfigError(why)
    target = pair.target
    engine = Engine(
        target.model,
        target.device,
        target.stop_ids,
        target.context_length,
        mixed(pair),
        pair.vocab,
        compile=pair.compile,
        after=after,
        prefixes=pair.target_prefixes,
        policy=policy,
        draft_cost=lambda method: draft_cost(pair, method),
        verify_cost=costs.verify_cost(pair),
        threads=pair.threads,
    )
    drafts = config.method.needs_draft_model and pair.draft.vocabulary is not Vocabulary.HEAD
    models = [("target", target.model)] + ([("draft", pair.draft.model)] if drafts else [])
    for role, model in models:
        why = can_capture(model) if pair.compile in ("graphs", "inductor") else None
        if why is not None:
            note(f"specgen: {role} runs eagerly (no CUDA graphs): {why}")
    return engine
