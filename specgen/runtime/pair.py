"""A loaded pair, ready to run: target and draft placed, their weights in the formats the
runtime runs (int8 target, cheaper draft), and the fixed-shape mode of their steps."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from specgen import files
from specgen.config import Method, ModelSettings
from specgen.models.families import text_config
from specgen.models.load import LoadedModel, Vocabulary, read_draft, read_pair
from specgen.models.plan import plan_draft, plan_pair
from specgen.runtime import forms, fp32, int8, int8_store, memories, quant
from specgen.runtime.compiled import resolve_compile
from specgen.runtime.exact_attention import use_exact_attention
from specgen.runtime.memories import Memories
from specgen.runtime.prefixes import DEFAULT_MIB, PrefixStore
from specgen.runtime.probe import require_exact
from specgen.status import status


@dataclass
class Pair:
    target: LoadedModel
    draft: LoadedModel | None
    compile: str = "off"  # compiled.py: off, graphs (CUDA graphs), inductor, fixed
    threads: int | None = (
        None  # the forwards' torch threads (runtime/threads.py); None: fitted to the free cores
    )
    # rows' K/V by their tokens (runtime/prefixes.py), one store per model, shared by every engine on the pair
    # (empty until `keep_prefixes`)
    target_prefixes: PrefixStore = field(default_factory=PrefixStore)
    draft_prefixes: PrefixStore = field(default_factory=PrefixStore)
    # what earlier requests wrote, by tenant (runtime/memories.py): --method suffix drafts from it
    memories: Memories = field(default_factory=Memories)

    def keep_prefixes(self, mib: int = DEFAULT_MIB) -> None:
        """Let each model's prefix store keep `mib` MiB of rows' K/V (0: none)."""
        self.target_prefixes.budget = self.draft_prefixes.budget = mib << 20

    @property
    def vocab(self) -> int | None:
        """The ids target and draft share when their heads are padded to different sizes (same
        tokenizer): logits are compared over these only. None when the sizes agree, and for a
        draft of another tokenizer (it proposes target ids made from text: the target's whole
        vocabulary counts)."""
        if self.draft is None or self.draft.vocabulary in (Vocabulary.TEXT, Vocabulary.HEAD):
            return None
        sizes = (
            text_config(self.target.model.config).vocab_size,
            text_config(self.draft.model.config).vocab_size,
        )
        return min(sizes) if sizes[0] != sizes[1] else None


def check(settings: ModelSettings) -> None:
    """Settings that would fail only after minutes of loading fail now."""
    resolve_compile(settings.compile, "cpu")
    quant.check_draft_quant(settings.draft_quant)
    quant.parse_target_quant(settings.target_quant)


def load(settings: ModelSettings, method: Method, quiet: bool = False) -> Pair:
    """Load the pair `method` needs (no draft for plain and lookup), in the formats `settings` ask.
    A straight path, each step called once with what the last returned (no callbacks): models/
    plans the pair (plan.py), the runtime chooses each model's form (forms.py: the int8 path's
    stores, built once), models/ reads what the plan names (load.py), and the runtime checks the
    models and puts their weights in the formats they run in (below)."""
    check(settings)
    draft = settings.draft if method.needs_draft_model else None
    plan = plan_pair(
        settings.target,
        draft,
        device=settings.device,
        draft_device=settings.draft_device,
        dtype=settings.dtype,
        quiet=quiet,
    )
    plan = forms.choose(plan, settings, quiet)
    target, loaded_draft = read_pair(plan, quiet)
    dtype_auto = forms.dtype_auto(settings)
    for role, loaded in (("target", target), ("draft", loaded_draft)):
        if loaded is not None and loaded.vocabulary is not Vocabulary.HEAD:
            require_exact(loaded.model, loaded.name, role)
    if quant.resolve_target_quant(settings.target_quant, target, dtype_auto=dtype_auto) == "int8":
        with status(f"int8 weights for target {target.name} ...", quiet):
            model = quant.quantize_target(target.model, target.path, quiet)
            use_exact_attention(model)  # int8 rows are exact; attention must not undo it
        target = replace(target, model=model, dtype=torch.float32, weights="int8")
    elif int8_store.is_store(target.path):
        raise AssertionError("a target built from its int8 store must run with int8 linears")
    if loaded_draft is not None:
        loaded_draft = quantize_draft(loaded_draft, target, settings.draft_quant, dtype_auto, quiet)
    pair = Pair(target, loaded_draft, resolve_compile(settings.compile, target.device), settings.threads)
    if settings.memory.suffix_cache_file:  # the ids' meaning, for the file; written when the process ends
        pair.memories.configure(settings.memory, memories.fingerprint(target.tokenizer))
        files.at_exit(pair.memories.save)
    else:
        pair.memories.configure(settings.memory)
    return pair


def quantize_draft(
    draft: LoadedModel, target: LoadedModel, spec: str | None, dtype_auto: bool, quiet: bool
) -> LoadedModel:
    """The draft in its `--draft-quant` format (chat's /method loads a draft later: same path)."""
    spec = quant.resolve_draft_quant(spec, draft.device, draft.dtype, dtype_auto=dtype_auto)
    if spec in (None, "none"):
        return draft
    # int8 linears (a head has no vocabulary to prune: its own is small)
    if draft.vocabulary is Vocabulary.HEAD:
        if "int8" not in spec or draft.device.type != "cpu" or not int8.available():
            return draft
        with status(f"int8 weights for head {draft.name} ...", quiet):
            model = quant.quantize_head(draft.model)
        return replace(draft, model=model, weights="int8")
    # the ids a pruned head must keep are the draft's own: the target's when they share a tokenizer
    owner = target if draft.vocabulary is Vocabulary.SHARED else draft
    specials = tuple(sorted(set(owner.stop_ids) | set(owner.tokenizer.all_special_ids)))
    with status(f"{spec} weights for draft {draft.name} ...", quiet):
        model = quant.apply_draft_quant(
            draft.model, spec, special_ids=specials, source=draft.path, tokenizer=owner.tokenizer
        )
    return replace(
        draft, model=model, dtype=fp32.compute_dtype(model), weights=quant.describe_draft_quant(spec, model)
    )


def load_draft_alone(settings: ModelSettings, target: LoadedModel, quiet: bool = False) -> LoadedModel:
    """`settings.draft` loaded beside an already loaded target, placed and in the format a
    pair's draft would be (chat's /method and /load, bench's `method@draft` columns)."""
    planned = plan_draft(
        settings.draft, device=settings.device, draft_device=settings.draft_device, dtype=settings.dtype
    )
    draft = read_draft(forms.choose_draft(planned, settings, quiet), target, quiet)
    if draft.vocabulary is not Vocabulary.HEAD:
        require_exact(draft.model, draft.name, "draft")
    return quantize_draft(draft, target, settings.draft_quant, forms.dtype_auto(settings), quiet)
