"""From a loaded pair and a generation config to a ready engine: the drafter the method needs
and the draft length the device favours."""

from __future__ import annotations

from dataclasses import replace

from specgen.config import GenerationConfig, Method
from specgen.decoding import costs
from specgen.decoding.drafters.base import Drafter, NoDrafter, PerRow
from specgen.decoding.drafters.eagle import EagleDrafter, EagleTreeDrafter
from specgen.decoding.drafters.lookup import LookupChain, lookup_drafters
from specgen.decoding.drafters.model import ChainDrafter
from specgen.decoding.drafters.retokenize import Bridge
from specgen.decoding.drafters.text import TextDrafter
from specgen.decoding.drafters.tree import MultiDraft, RSDConstant, RSDStochasticBeam
from specgen.decoding.engine import Engine, Policy
from specgen.errors import ConfigError
from specgen.models.families import text_config
from specgen.models.load import Vocabulary
from specgen.runtime import features
from specgen.runtime.compiled import can_capture
from specgen.runtime.pair import Pair
from specgen.status import note


def resolve_draft_length(pair: Pair, config: GenerationConfig, drafts: bool | None = None):
    """`--draft-tokens device` (the default): the k measured best for this pair on this device,
    with the floor under every row (decoding/floor.py): a k the device chose is only a ceiling.

    Returns (config with k set and the placeholder cleared, the costs.DraftLength or None).
    `drafts`: whether a model-drafting method with a fixed k will run (default: from
    config.method; bench, which runs several methods, says so itself)."""
    if not config.device_draft_tokens:
        return config, None
    if drafts is None:
        drafts = config.method in (Method.CHAIN, Method.LOOKUP_CHAIN)
    if pair.draft is None or not drafts or pair.draft.vocabulary is Vocabulary.HEAD:
        return replace(config, device_draft_tokens=False, floor=True), None
    choice = costs.choose(pair)  # a few seconds, once per machine and pair; cached after that
    confidence = choice.confidence if config.device_confidence else config.draft_confidence
    return replace(
        config, draft_tokens=choice.k, device_draft_tokens=False, draft_confidence=confidence, floor=True
    ), choice


def why_not(pair: Pair, method: Method) -> str | None:
    """Why this pair's draft cannot run `method` (None when it can): eagle needs an EAGLE-3
    head, and a head drafts chains (eagle, chain, lookup-chain's model rounds) and RSD-C trees."""
    draft = pair.draft
    if not method.needs_draft_model or draft is None:
        return None
    head = draft.vocabulary is Vocabulary.HEAD
    if method.is_tree and draft.vocabulary is Vocabulary.TEXT:
        return (
            f"method {method.value} drafts trees, which need a draft with the target's tokenizer; "
            f"{draft.name}'s differs (use chain or lookup-chain: they draft its text)"
        )
    if method is Method.EAGLE and not head:
        return (
            f"method eagle needs an EAGLE-3 head as the draft (a directory; `specgen train-head` writes "
            f"one); {draft.name} is a model"
        )
    if head and method not in (Method.EAGLE, Method.CHAIN, Method.LOOKUP_CHAIN, Method.RSD_C):
        return (
            f"method {method.value} needs a draft model; an EAGLE-3 head drafts eagle (chains), rsd-c "
            "(trees) and lookup-chain"
        )
    return None


def make_drafter(pair: Pair, config: GenerationConfig) -> Drafter:
    """The drafter of `config.method` for the rows of a batch (one row or many)."""
    method, draft, vocab = config.method, pair.draft, pair.vocab
    if method is Method.PLAIN:
        return NoDrafter()
    if method is Method.LOOKUP:
        return lookup_drafters()
    why = why_not(pair, method)
    if why is not None:
        raise ConfigError(why)
    if draft.vocabulary is Vocabulary.HEAD:
        return _head_drafter(pair, config)
    if draft.vocabulary is Vocabulary.TEXT:
        return _text_drafter(pair, config)
    if method is Method.RSD_C:
        return PerRow(lambda: RSDConstant(draft.model, draft.device, config.branching, vocab, pair.compile))
    if method is Method.MULTI_DRAFT:
        return PerRow(lambda: MultiDraft(draft.model, draft.device, config.branching, vocab, pair.compile))
    if method is Method.RSD_S:
        return PerRow(
            lambda: RSDStochasticBeam(
                draft.model, draft.device, config.beam_width, config.depth, vocab, pair.compile
            )
        )
    chain = ChainDrafter(
        draft.model, draft.device, vocab, config.draft_confidence, pair.compile, pair.draft_prefixes
    )
    if method is Method.LOOKUP_CHAIN:
        return LookupChain(chain, model_tokens=config.draft_tokens)
    return chain


def _head_drafter(pair: Pair, config: GenerationConfig) -> Drafter:
    """An EAGLE-3 head drafts chains (eagle; chain means the same with a head), RSD-C trees and
    lookup-chain's model rounds."""
    features.install(pair.target.model)
    vocab = pair.target.model.get_input_embeddings().weight.shape[0]
    if config.method is Method.RSD_C:
        return EagleTreeDrafter(
            pair.draft.model, pair.draft.device, vocab, config.branching, pair.draft_prefixes, pair.compile
        )
    drafter = EagleDrafter(pair.draft.model, pair.draft.device, vocab, pair.draft_prefixes, pair.compile)
    if config.method is Method.LOOKUP_CHAIN:
        return LookupChain(drafter, model_tokens=config.draft_tokens)
    return drafter


def _text_drafter(pair: Pair, config: GenerationConfig) -> Drafter:
    """A draft of another tokenizer: chains drafted in its own ids, proposed to the target
    through text (drafters/text.py). Trees would need the draft's laws over target ids (`why_not`)."""
    draft = pair.draft
    vocab = min(
        len(draft.tokenizer), text_config(draft.model.config).vocab_size
    )  # never an id the tokenizer lacks
    chain = ChainDrafter(
        draft.model, draft.device, vocab, config.draft_confidence, pair.compile, pair.draft_prefixes
    )
    drafter = TextDrafter(chain, Bridge(pair.target.tokenizer, draft.tokenizer))
    if config.method is Method.LOOKUP_CHAIN:
        return LookupChain(drafter, model_tokens=config.draft_tokens)
    return drafter


def build_engine(
    pair: Pair, config: GenerationConfig, after: Engine | None = None, policy: Policy = Policy()
) -> Engine:
    """An engine running `config.method` on the pair; `after`: an engine whose target cache (and
    the rows it parked) it continues from; `policy`: how it schedules rounds (a server's)."""
    target = pair.target
    engine = Engine(
        target.model,
        target.device,
        target.stop_ids,
        target.context_length,
        make_drafter(pair, config),
        pair.vocab,
        compile=pair.compile,
        after=after,
        prefixes=pair.target_prefixes,
        policy=policy,
    )
    drafts = config.method.needs_draft_model and pair.draft.vocabulary is not Vocabulary.HEAD
    models = [("target", target.model)] + ([("draft", pair.draft.model)] if drafts else [])
    for role, model in models:
        why = can_capture(model) if pair.compile in ("graphs", "inductor") else None
        if why is not None:
            note(f"specgen: {role} runs eagerly (no CUDA graphs): {why}")
    return engine
