"""Read what a plan names (plan.py): each model's tokenizer and weights, checked, as a `LoadedModel`.

Every read passes trust_remote_code=False: specgen never runs Python code that comes with a
model, and transformers then never asks on stdin whether to (see `plan.foreign_code`). A GGUF
source is converted to a full-precision copy (once, cached) unless the plan reads it from a
directory that keeps its linears apart (its int8 store, named by runtime/forms.py): then the
model is built around the tensors of the shards the plan names (the store's checked `rest`
shards; no other file of it is opened), its linears' weights left on the meta device for the
runtime to supply. `load_pair`, `load_draft` and `load_model` plan and read in one
call, every model at full precision.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from specgen.errors import ModelError
from specgen.models import eagle_format, families, model_files
from specgen.models.plan import PairPlan, Planned, foreign_code, plan_draft, plan_model, plan_pair
from specgen.models.resolve import gguf_file
from specgen.models.vocabulary import TEXT_DRAFTING, Vocabulary, compare_tokenizers, tokenizer_fingerprint
from specgen.status import note, status


@dataclass
class LoadedModel:
    model: object
    tokenizer: object
    name: str
    source: str  # "dir", "gguf", "catalog" or "hub"
    device: torch.device  # where input ids go
    dtype: torch.dtype
    path: str | None = None  # the directory the weights were loaded from (None: a hub id)
    weights: str = "none"  # int8 when its linears were quantized (runtime/quant.py)
    gguf: str | None = None  # the GGUF file the weights came from (llama.cpp reference columns)
    vocabulary: Vocabulary = Vocabulary.SHARED  # a draft: its ids against its target's (a target: SHARED)

    def gguf_file(self, quiet: bool = False) -> str | None:
        """The GGUF file the weights came from (a catalog model whose int8 store let it go
        fetches it again); None for sources without one."""
        return None if self.gguf is None else str(gguf_file(self.source, self.name, self.gguf, quiet))

    @property
    def context_length(self) -> int:
        """The longest sequence it runs: its config's, or the length up to which every path is
        exact (families.exact_context: a longrope model's original context)."""
        length = int(getattr(self.model.config, "max_position_embeddings", 0) or 2048)
        exact = families.exact_context(self.model.config)
        return min(length, exact[0]) if exact is not None else length

    @property
    def stop_ids(self) -> frozenset[int]:
        ids = set()
        for source in (
            self.tokenizer.eos_token_id,
            getattr(self.model.generation_config, "eos_token_id", None),
        ):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(i) for i in source)
        return frozenset(ids)


def load_pair(
    target: str,
    draft: str | None,
    *,
    device: str = "auto",
    draft_device: str | None = None,
    dtype: str = "auto",
    quiet: bool = False,
) -> tuple[LoadedModel, LoadedModel | None]:
    """Plan and read target (and draft) at full precision, placed with accelerate; check that
    their tokenizers agree."""
    plan = plan_pair(target, draft, device=device, draft_device=draft_device, dtype=dtype, quiet=quiet)
    return read_pair(plan, quiet)


def load_draft(
    draft: str,
    target: LoadedModel,
    *,
    device: str = "auto",
    draft_device: str | None = None,
    dtype: str = "auto",
    quiet: bool = False,
) -> LoadedModel:
    """Plan and read only the draft, placed as load_pair would place it."""
    return read_draft(plan_draft(draft, device=device, draft_device=draft_device, dtype=dtype), target, quiet)


def load_model(
    arg: str,
    *,
    dtype: torch.dtype,
    device_map,
    input_device: torch.device,
    quiet: bool = False,
    role: str = "model",
    share_tokenizer: LoadedModel | None = None,
) -> LoadedModel:
    """Plan and read one model at full precision (`read_model`)."""
    planned = plan_model(arg, dtype=dtype, device_map=device_map, input_device=input_device, role=role)
    return read_model(planned, quiet, share_tokenizer)


def read_pair(plan: PairPlan, quiet: bool = False) -> tuple[LoadedModel, LoadedModel | None]:
    """The target, then the draft (`read_draft`), as `plan` names them."""
    # Dequantized GGUF weights drive some activations subnormal; on x86 CPUs those take a
    # microcode slow path (ten times slower forwards: benchmarks/code-choices.md).
    torch.set_flush_denormal(True)
    target = read_model(plan.target, quiet)
    return target, None if plan.draft is None else read_draft(plan.draft, target, quiet)


def read_draft(planned: Planned, target: LoadedModel, quiet: bool = False) -> LoadedModel:
    """The draft beside `target`: an EAGLE-3 head, or a model whose tokenizer is compared with
    the target's (the same object when both are built from the same files)."""
    if planned.resolved is None:
        return _load_head(planned.arg, planned.device, target, quiet)
    loaded = read_model(planned, quiet, share_tokenizer=target)
    if loaded.tokenizer is target.tokenizer:  # a shared one is the same by construction
        return loaded
    vocabulary = compare_tokenizers(target.tokenizer, loaded.tokenizer)
    if vocabulary is Vocabulary.TEXT:
        note(TEXT_DRAFTING)
    return replace(loaded, vocabulary=vocabulary)


def read_model(
    planned: Planned, quiet: bool = False, share_tokenizer: LoadedModel | None = None
) -> LoadedModel:
    """Read one planned model and its tokenizer; any failure is a one-line ModelError naming its
    role (target or draft) and argument. `share_tokenizer`: a model whose tokenizer to reuse
    when both tokenizers are built from the same files (a draft of the target's family: saves
    about a second per start), else the tokenizer is loaded."""
    arg, role, dtype = planned.arg, planned.role, planned.dtype
    resolved = planned.resolved if planned.without_linears else planned.resolved.converted(dtype, quiet)
    # local directories (and the converted cache) load safetensors only: never a pickled .bin
    local = {"use_safetensors": True} if resolved.source != "hub" else {}
    tokenizer = None
    if share_tokenizer is not None and resolved.source != "hub":
        mine = tokenizer_fingerprint(resolved.path)
        if mine is not None and mine == tokenizer_fingerprint(share_tokenizer.path):
            tokenizer = share_tokenizer.tokenizer
    try:
        with status(f"loading {role} {resolved.name} ...", quiet), _quiet_transformers():
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(resolved.path, trust_remote_code=False)
            if planned.without_linears:
                model = _without_linears(Path(resolved.path), planned.shards, dtype)
            else:
                model = AutoModelForCausalLM.from_pretrained(
                    resolved.path,
                    dtype=dtype,
                    device_map=planned.device_map,
                    trust_remote_code=False,
                    **local,
                )
    except OSError as exc:
        if resolved.source == "hub":
            offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") else ""
            raise ModelError(
                f"cannot load the {role} model '{arg}' from the Hugging Face cache or hub{offline}: "
                f"{_first_line(exc)}"
            ) from exc
        raise ModelError(f"cannot load the {role} model from {resolved.path}: {_first_line(exc)}") from exc
    except ModelError:
        raise
    except Exception as exc:  # e.g. a truncated safetensors file: SafetensorError, not an OSError
        if "custom code" in str(exc):
            raise foreign_code(role, arg) from None
        broken = model_files.diagnose(resolved.path) if resolved.source != "hub" else None
        if broken:  # the library's own message does not say which file
            raise ModelError(f"cannot load the {role} model '{arg}': {broken}") from None
        if "mismatched" in str(exc) or "size mismatch" in str(exc):
            raise ModelError(
                f"cannot load the {role} model '{arg}': {_mismatch(resolved.path)}",
                hint="the config.json and the weights do not belong together",
            ) from None
        raise ModelError(f"cannot load the {role} model '{arg}': {_first_line(exc)}") from exc
    if len(tokenizer) < 2 or not tokenizer.encode("hello", add_special_tokens=False):
        # transformers builds an empty tokenizer for a directory without tokenizer files
        raise ModelError(
            f"the {role} model '{arg}' has no usable tokenizer (its tokenizer encodes no text)",
            hint="its directory needs tokenizer.json, or the files of a slow tokenizer",
        )
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None and (not isinstance(context, int) or isinstance(context, bool) or context < 2):
        raise ModelError(
            f"the {role} model '{arg}' has an invalid config: max_position_embeddings is {context!r}",
            hint="the context length must be an integer of at least 2",
        )
    rows = model.get_input_embeddings().num_embeddings
    if rows < len(tokenizer):
        raise ModelError(
            f"the {role} model '{arg}' has {rows} embedding rows but its tokenizer has "
            f"{len(tokenizer)} tokens: ids {rows} and up would have no embedding",
            hint="the model and tokenizer files do not belong together",
        )
    _masked_attention(model)
    model.eval()
    return LoadedModel(
        model,
        tokenizer,
        resolved.name,
        resolved.source,
        planned.device,
        dtype,
        resolved.path if resolved.source != "hub" else None,
        gguf=resolved.gguf,
    )


def _without_linears(directory: Path, shards: tuple[str, ...], dtype: torch.dtype) -> nn.Module:
    """The model of `directory`, built around the tensors of `shards` with every linear's weight on
    the meta device (they are kept apart, in int8: runtime/int8_store.py): the module tree is
    created on the meta device (buffers such as rotary tables computed as usual), the shards'
    tensors assigned, a tied output layer tied. No other file of the directory is opened: the
    linears' own are checked by the runtime before it reads them (a damaged one is rebuilt)."""
    config = AutoConfig.from_pretrained(directory, trust_remote_code=False)
    with init_empty_weights(include_buffers=False):  # buffers (rotary tables) are computed as usual
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    wanted = set(model.state_dict())
    tensors = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys() if name in wanted})
    linears = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    missing = wanted - set(tensors) - linears
    if missing:
        raise ModelError(
            f"the int8 store {directory.name} lacks {sorted(missing)[0]}",
            hint=f"remove {directory} to build it again",
        )
    model.load_state_dict(tensors, strict=False, assign=True)
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear) and model.config.get_text_config().tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def _masked_attention(model) -> None:
    """specgen passes every forward an explicit mask (runtime/kvcache.py): an attention that
    cannot take one (flash attention, flex attention, named in a model's config) becomes SDPA,
    or eager where the model has no SDPA path."""
    if model.config._attn_implementation in ("sdpa", "eager"):
        return
    try:
        model.set_attn_implementation("sdpa")
    except (ValueError, ImportError):
        model.set_attn_implementation("eager")


def _load_head(path: str, device: torch.device, target: LoadedModel, quiet: bool) -> LoadedModel:
    """An EAGLE-3 head for `target` (models/eagle_format.py; HeadError, one line, if it is for
    another target). Its weights in float32 on `device` (it shares the target's embedding)."""
    with status(f"loading EAGLE-3 head {Path(path).name} ...", quiet):
        head = eagle_format.load_head(path, target.model)
        head.to(device=device, dtype=torch.float32)
    if not quiet:
        note(f"specgen: {eagle_format.describe(head)}")
    return LoadedModel(
        head,
        target.tokenizer,
        Path(path).name,
        "dir",
        device,
        torch.float32,
        path=str(path),
        vocabulary=Vocabulary.HEAD,
    )


def _mismatch(path: str) -> str:
    """The first weight whose shape in the files differs from what config.json makes of it (the
    loader's report of it is a log it prints, silenced here)."""
    from safetensors import safe_open  # only once a load has failed

    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    with torch.device("meta"):
        wanted = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                shape = tuple(handle.get_slice(key).get_shape())
                name = next(
                    (k for k in (key, key.removeprefix("model."), f"model.{key}") if k in wanted), None
                )
                if name is not None and wanted[name] != shape:
                    return (
                        f"config.json does not match {file.name}: {key} is {list(shape)} in the file, "
                        f"{list(wanted[name])} by the config"
                    )
    return "config.json does not match the weights' shapes"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


class _quiet_transformers:
    """Silence transformers' load-time chatter (progress bars, advisory warnings)."""

    def __enter__(self):
        self._level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        logging.getLogger("accelerate").setLevel(logging.ERROR)
        return self

    def __exit__(self, *exc):
        self._warnings.__exit__(*exc)
        hf_logging.set_verbosity(self._level)
        return False
