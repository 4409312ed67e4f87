"""Glue shared by run, chat and bench: load a pair, build the engine, drive one generation.

It turns engine rounds (token ids) into RoundViews (text) for a renderer, and keeps what was
generated when the user presses Ctrl-C.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from specgen.config import GenerationConfig, Method, ModelSettings  # noqa: F401 (ModelSettings: session's API)
from specgen.drafters import ModelDrafter
from specgen.engine import DecodeState, Engine, RoundResult
from specgen.errors import PromptError
from specgen.models import LoadedModel, load_pair
from specgen.render import Outcome, ReplayView, RoundView, TreeView
from specgen.replay import ReplayResult
from specgen.stats import Stats
from specgen.text import TextStream


@dataclass
class Pair:
    target: LoadedModel
    draft: LoadedModel | None
    compile: str = "off"  # compiled.py: off, graphs (CUDA graphs), inductor, fixed


def load(settings: ModelSettings, method: Method, quiet: bool = False) -> Pair:
    from specgen.compiled import resolve_compile

    draft = settings.draft if method.needs_draft_model else None
    resolve_compile(settings.compile, "cpu")  # a bad value fails before minutes of loading
    if draft is not None and (settings.draft_quant or "auto").strip().lower() != "auto":
        from specgen.draft_quant import parse_quant

        parse_quant(settings.draft_quant)  # a bad spec fails before minutes of loading
    from specgen import int8

    int8.parse_target_quant(settings.target_quant)
    dtype_auto = (settings.dtype or "auto").strip().lower() == "auto"
    target, loaded_draft = load_pair(settings.target, draft, device=settings.device,
                                     draft_device=settings.draft_device, dtype=settings.dtype, quiet=quiet)
    target_quant = int8.resolve_target_quant(settings.target_quant, target, dtype_auto=dtype_auto)
    if target_quant == "int8":
        with _status(f"int8 weights for target {target.name} ...", quiet):
            model = int8.quantize_model(target.model, int8.cache_file_for(target.path, "target") if target.path else None,
                                        quiet)
            from specgen.exact_attention import use_exact_attention

            use_exact_attention(model)  # int8 rows are exact; attention must not undo it
        target = replace(target, model=model, dtype=torch.float32, weights="int8")
    quant = settings.draft_quant
    if loaded_draft is not None and quant not in (None, "none"):
        from specgen.draft_quant import apply_draft_quant, describe, resolve_auto

        quant = resolve_auto(quant, loaded_draft.device, loaded_draft.dtype, dtype_auto=dtype_auto)
    if loaded_draft is not None and quant not in (None, "none"):
        specials = tuple(sorted(set(target.stop_ids) | set(target.tokenizer.all_special_ids)))
        with _status(f"{quant} weights for draft {loaded_draft.name} ...", quiet):
            model = apply_draft_quant(loaded_draft.model, quant, special_ids=specials, source=loaded_draft.path)
        loaded_draft = replace(loaded_draft, model=model, dtype=next(model.parameters()).dtype,
                               weights=describe(quant, model))
    return Pair(target, loaded_draft, resolve_compile(settings.compile, target.device))


def resolve_draft_length(pair: Pair, config: GenerationConfig, drafts: bool | None = None):
    """`--draft-tokens device` (the default): the k measured best for this pair on this device.

    Returns (config with k set and the placeholder cleared, the draft_length.Choice or None).
    `drafts`: whether a model-drafting method with a fixed k will run (default: from
    config.method; bench, which runs several methods, says so itself)."""
    if not config.device_draft_tokens:
        return config, None
    if drafts is None:
        drafts = config.method in (Method.CHAIN, Method.LOOKUP_CHAIN)
    if pair.draft is None or not drafts:
        return replace(config, device_draft_tokens=False), None
    from specgen.draft_length import choose

    choice = choose(pair)  # a few seconds, once per machine and pair; cached after that
    confidence = choice.confidence if config.device_confidence else config.draft_confidence
    return replace(config, draft_tokens=choice.k, device_draft_tokens=False, draft_confidence=confidence), choice


def _status(message: str, quiet: bool):
    from specgen.convert import status

    return status(message, quiet)


def make_drafter(draft: LoadedModel, method: Method, vocab: int | None, config: GenerationConfig | None,
                 compile: str = "off"):
    from specgen import tree_drafters

    config = config or GenerationConfig(method=method)
    if method is Method.LOOKUP:
        from specgen.lookup import PromptLookupDrafter

        return PromptLookupDrafter()
    if method is Method.LOOKUP_CHAIN:
        from specgen.lookup import CombinedDrafter, PromptLookupDrafter

        return CombinedDrafter(PromptLookupDrafter(), make_drafter(draft, Method.CHAIN, vocab, config, compile),
                               model_tokens=config.draft_tokens)
    if method is Method.RSD_C:
        return tree_drafters.RSDConstant(draft.model, draft.device, config.branching, vocab, compile)
    if method is Method.MULTI_DRAFT:
        return tree_drafters.MultiDraft(draft.model, draft.device, config.branching, vocab, compile)
    if method is Method.RSD_S:
        return tree_drafters.RSDStochasticBeam(draft.model, draft.device, config.beam_width, config.depth, vocab,
                                                  compile)
    confidence = None
    if config.draft_confidence > 0:
        from specgen.adaptive import ConfidenceStop

        confidence = ConfidenceStop(config.draft_confidence)
    return ModelDrafter(draft.model, draft.device, vocab, confidence, compile)


def build_engine(pair: Pair, method: Method, config: GenerationConfig | None = None) -> Engine:
    drafter, vocab = None, None
    target = pair.target
    if method is Method.LOOKUP:
        drafter = make_drafter(None, method, None, config)
    elif method.needs_draft_model:
        sizes = (target.model.config.vocab_size, pair.draft.model.config.vocab_size)
        # heads padded to different sizes (same tokenizer): compare over the shared ids only
        vocab = min(sizes) if sizes[0] != sizes[1] else None
        drafter = make_drafter(pair.draft, method, vocab, config, pair.compile)
    engine = Engine(target.model, target.device, target.stop_ids, target.context_length, drafter, vocab,
                    compile=pair.compile)
    for role, steps in (("target", engine.steps), ("draft", getattr(drafter, "steps", None))):
        if steps is not None and steps.notice:
            import sys

            sys.stderr.write(f"specgen: {role} runs eagerly (no CUDA graphs): {steps.notice}\n")
    return engine


def encode_prompt(tokenizer, prompt: str, raw: bool = False, system: str | None = None) -> list[int]:
    """Apply the chat template (unless raw) and tokenize once."""
    if not prompt.strip():
        raise PromptError("the prompt is empty")
    if raw or not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(prompt, add_special_tokens=False) or tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              return_dict=True)["input_ids"])


def replay_view(replay: ReplayResult, stream: TextStream) -> ReplayView:
    """Roll the text stream back past discarded tokens, then push the correction."""
    rolled = [stream.token_text(t) for t in replay.rolled_back]
    correction = None
    if replay.rolled_back:
        stream.truncate(len(stream.ids) - len(replay.rolled_back))
    if replay.correction is not None:
        correction = stream.push(replay.correction)
    return ReplayView(rolled, correction)


def view_of(result: RoundResult, stream: TextStream, pending: bool = False) -> RoundView:
    """Text for one round: each committed token pushed once through the stream."""
    accepted = [stream.push(t) for t in result.emitted[: result.accepted_emitted]]
    target = stream.push(result.emitted[-1]) if result.target_emitted else ""
    rejected = [stream.token_text(t) for t in result.rejected]
    tree = None
    if result.tree is not None:
        info = result.tree
        tree = TreeView([stream.token_text(t) for t in info.tokens], info.parents,
                        frozenset(info.accepted_nodes), frozenset(info.tried))
    return RoundView(accepted, target, rejected, tree, pending)


def generate(engine: Engine, tokenizer, prompt_ids: list[int], config: GenerationConfig,
             renderer, state: DecodeState | None = None) -> Outcome:
    """Run one generation into `renderer`; Ctrl-C ends it early and keeps what was made.

    With `state` (from a previous Outcome) the caches are reused where the new prompt agrees
    with what they hold; the returned Outcome carries the state for the next turn.
    """
    stats = Stats(method=config.method.value, prompt_tokens=len(prompt_ids),
                  dtype=str(next(engine.model.parameters()).dtype).removeprefix("torch."))
    stream = TextStream(tokenizer)
    started = time.perf_counter()
    interrupted = False
    setup = engine.setup_seconds()
    with renderer:
        try:
            state = engine.resume(state, prompt_ids, config)
            stats.prefill_seconds = state.prefill_seconds
            for event in engine.rounds(state, config):
                elapsed = time.perf_counter() - started
                if isinstance(event, ReplayResult):
                    stats.update_replay(event, elapsed)
                    renderer.on_replay(replay_view(event, stream), stats)
                    continue
                stats.update(event, elapsed)
                stats.setup_seconds = engine.setup_seconds() - setup
                renderer.on_round(view_of(event, stream, pending=config.deterministic), stats)
        except KeyboardInterrupt:
            interrupted = True
    ids = stream.ids
    if config.deterministic and state is not None:
        ids = ids[: max(state.verified - len(prompt_ids), 0)]  # only replay-verified tokens are final
    outcome = Outcome(tokenizer.decode(ids, skip_special_tokens=True), ids, stats, interrupted, state=state)
    renderer.finish(outcome)
    return outcome


def read_prompts_file(path) -> list[str]:
    """One prompt per line, or JSONL objects with a `prompt` field; blank lines skipped.

    Anything else is one PromptError naming the file and line: a non-string or empty prompt,
    invalid JSON, bytes that are not UTF-8.
    """
    import json

    from specgen.errors import PromptError

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise PromptError(f"cannot read prompts file {path}: {exc.strerror or exc}") from None
    prompts = []
    for number, raw in enumerate(data.splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PromptError(f"{path}:{number}: not valid UTF-8 text (byte 0x{raw[exc.start]:02x})") from None
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            prompts.append(line)
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise PromptError(f"{path}:{number}: not valid JSON") from None
        if not isinstance(record, dict) or "prompt" not in record:
            raise PromptError(f"{path}:{number}: expected a JSON object with a 'prompt' field")
        prompt = record["prompt"]
        if not isinstance(prompt, str):  # null, 3, [..] are not prompts, and str() would hide that
            raise PromptError(f"{path}:{number}: 'prompt' must be a string, got {json.dumps(prompt)[:40]}")
        if not prompt.strip():
            raise PromptError(f"{path}:{number}: the prompt is empty")
        prompts.append(prompt)
    if not prompts:
        raise PromptError(f"{path} holds no prompts")
    return prompts


def make_row_drafters(pair: Pair, method: Method, config: GenerationConfig):
    """(row drafters, shared vocab) for batched decoding: chains share one draft cache, every
    other method (lookup, lookup-chain, the trees) drafts each row with its own drafter."""
    from specgen.row_drafters import PerRow, SharedChain

    if method is Method.PLAIN:
        return None, None
    if method is Method.LOOKUP:
        return PerRow(make=lambda: make_drafter(None, method, None, config)), None
    target, draft = pair.target, pair.draft
    sizes = (target.model.config.vocab_size, draft.model.config.vocab_size)
    vocab = min(sizes) if sizes[0] != sizes[1] else None
    if method is not Method.CHAIN:
        return PerRow(make=lambda: make_drafter(draft, method, vocab, config, pair.compile)), vocab
    confidence = None
    if config.draft_confidence > 0:
        from specgen.adaptive import ConfidenceStop

        confidence = ConfidenceStop(config.draft_confidence)
    return SharedChain(draft.model, draft.device, vocab, confidence, pair.compile), vocab


def run_batch(pair: Pair, prompts: list[list[int]], config: GenerationConfig, batch_size: int):
    """Yield (index, Outcome) in input order; the engine itself finishes rows in any order.

    Ctrl-C (raised while decoding, or thrown in at a yield by the caller) ends the decoding; the
    rows finished so far are still yielded in order, every other row as `unfinished`.
    """
    target = pair.target
    drafts, vocab = make_row_drafters(pair, config.method, config)
    engine = Engine(target.model, target.device, target.stop_ids, target.context_length, None, vocab,
                    compile=pair.compile)
    dtype = str(next(target.model.parameters()).dtype).removeprefix("torch.")
    stats: dict[int, Stats] = {}
    done, next_index = {}, 0
    try:
        for report in engine.generate_batch(prompts, config, batch_size, drafts):
            row = stats.setdefault(report.index, Stats(method=config.method.value,
                                                       prompt_tokens=len(prompts[report.index]), dtype=dtype))
            if isinstance(report.event, ReplayResult):
                row.update_replay(report.event, report.elapsed)
            elif report.event is not None:
                row.update(report.event, report.elapsed)
            else:
                state = report.state
                row.prefill_seconds = state.prefill_seconds
                ids = state.ids[state.prompt_length: state.verified if config.deterministic else None]
                text = target.tokenizer.decode(ids, skip_special_tokens=True)
                done[report.index] = Outcome(text, ids, row)
            while next_index in done:
                yield next_index, done.pop(next_index)
                next_index += 1
    except KeyboardInterrupt:
        for index in range(next_index, len(prompts)):
            yield index, done.pop(index) if index in done else unfinished(prompts[index], config)


def unfinished(prompt_ids: list[int], config: GenerationConfig) -> Outcome:
    """A prompt that Ctrl-C stopped before it finished: no text, marked interrupted."""
    return Outcome("", [], Stats(method=config.method.value, prompt_tokens=len(prompt_ids)), interrupted=True)
