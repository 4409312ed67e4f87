"""Resolve a model argument and load it with its tokenizer, dtype and placement.

A model argument resolves in this order: an existing local path (a Hugging Face directory or
a .gguf file), a catalog name, a Hugging Face id (local HF cache, or the hub when reachable).
"""

from __future__ import annotations

import difflib
import enum
import hashlib
import json
import logging
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from specgen.errors import ModelError
from specgen.models import catalog, eagle_format, families, model_files
from specgen.models import placement as placement_mod
from specgen.models.convert import check_gguf, ensure_converted, file_key
from specgen.models.head_dir import is_head
from specgen.status import note, status
from specgen.text import json_value

TEXT_DRAFTING = "draft tokenizer differs: text-level drafting"
ROUND_TRIP = "Hello, world! 12 + 30 = 42.\n"  # text any tokenizer a draft may use must decode back


class Vocabulary(enum.Enum):
    """How a draft's token ids relate to its target's (decided once, at load).

    SHARED: the same tokenizer; the draft proposes target ids directly (the fast path).
    TEXT: another tokenizer; drafts go through text (decoding/drafters/text.py).
    HEAD: an EAGLE-3 head (models/eagle_head.py): no model of its own, it reads the target's
    features and maps its draft vocabulary to target ids."""

    SHARED = "shared"
    TEXT = "text"
    HEAD = "head"


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
        return None if self.gguf is None else str(_gguf_file(self.source, self.name, self.gguf, quiet))

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


@dataclass(frozen=True)
class Resolved:
    path: str | None  # a directory to load from, or a hub id; None for a GGUF source not yet converted
    source: str
    name: str
    gguf: str | None = None  # the GGUF file of a GGUF or catalog source (a catalog model may have dropped it)
    key: str | None = None  # what a GGUF source's derived files are named after

    def gguf_file(self, quiet: bool = False) -> Path:
        """The GGUF file, fetched again for a catalog model whose int8 store let it go."""
        return _gguf_file(self.source, self.name, self.gguf, quiet)

    def converted(self, dtype: torch.dtype, quiet: bool = False) -> "Resolved":
        """This source with a full-precision directory to load (a GGUF converted once, cached)."""
        if self.path is not None:
            return self
        key = self.key if self.source == "catalog" else None
        return replace(self, path=str(ensure_converted(self.gguf_file(quiet), dtype, key=key, quiet=quiet)))


def _gguf_file(source: str, name: str, gguf: str, quiet: bool) -> Path:
    """A GGUF or catalog source's file: a catalog model's is fetched (again, if its int8 store
    let it go; a no-op when it is in place), a user's file is what it is."""
    return catalog.fetch(catalog.CATALOG[name], quiet=quiet) if source == "catalog" else Path(gguf)


class Builder(Protocol):
    """Builds a model of a GGUF source in a form of its own instead of from a converted
    full-precision copy (runtime/int8_store.py: the int8 linears and the rest). The models
    layer calls it; the runtime layer that knows the form provides it."""

    def accepts(self, resolved: Resolved, device: torch.device, dtype: torch.dtype) -> bool: ...

    def prepare(self, resolved: Resolved, dtype: torch.dtype, quiet: bool) -> str: ...

    def load(self, resolved: Resolved, dtype: torch.dtype, quiet: bool) -> object: ...


class FullPrecision:
    """The usual form: every model loads from its (converted) full-precision files."""

    def accepts(self, resolved: Resolved, device: torch.device, dtype: torch.dtype) -> bool:
        return False

    def prepare(self, resolved: Resolved, dtype: torch.dtype, quiet: bool) -> str:
        raise AssertionError("never accepted")

    load = prepare


def resolve(arg: str, dtype: torch.dtype, quiet: bool = False, convert: bool = True) -> Resolved:
    """Turn a --target/--draft value into something from_pretrained can load (with `convert`
    False, a GGUF source is left unconverted and a catalog model unfetched: `Resolved.converted`)."""
    if not arg.strip():  # Path("") is the current directory
        raise ModelError("the name is empty; give a model directory, a .gguf file or a catalog name")
    path = Path(arg).expanduser()
    if path.exists():
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelError(f"{path} is a directory but has no config.json; not a model directory")
            return Resolved(str(path), "dir", path.name)
        if not os.access(path, os.R_OK):
            raise ModelError(f"cannot read {path}: permission denied")
        if not _has_gguf_magic(path):
            raise ModelError(f"{path} is not a GGUF file (no GGUF header) and not a model directory")
        check_gguf(path)
        found = Resolved(None, "gguf", path.name, str(path.resolve()), file_key(path))
    elif arg in catalog.CATALOG:
        model = catalog.CATALOG[arg]
        found = Resolved(None, "catalog", arg, str(catalog.gguf_path(model)), model.name)
    elif _looks_like_path(arg):
        raise ModelError(f"model path {arg} does not exist")
    elif arg.count("/") == 1 and not arg.startswith("/"):
        return Resolved(arg, "hub", arg)
    else:
        close = difflib.get_close_matches(arg, list(catalog.CATALOG), n=3, cutoff=0.4)
        hint = f"; did you mean: {', '.join(close)}?" if close else "; see `specgen models list`"
        raise ModelError(f"unknown model '{arg}': not a local path, a catalog name or a hub id{hint}")
    return found.converted(dtype, quiet) if convert else found


TOKENIZER_KEYS = (
    "eos_token",
    "bos_token",
    "pad_token",
    "unk_token",
    "added_tokens_decoder",
    "additional_special_tokens",
    "extra_special_tokens",
)


def tokenizer_fingerprint(path: str | None) -> str | None:
    """A digest of what defines a local model's tokenizer for decoding (tokenizer.json and the
    special tokens of tokenizer_config.json); None when it cannot be read that way (then the
    tokenizer is loaded and compared as usual)."""
    if path is None:
        return None
    try:
        digest = hashlib.sha256(Path(path, "tokenizer.json").read_bytes())
        config = json_value(Path(path, "tokenizer_config.json").read_bytes())
        digest.update(json.dumps({k: config.get(k) for k in TOKENIZER_KEYS}, sort_keys=True).encode())
    except (OSError, ValueError, AttributeError):  # AttributeError: a config that is not an object
        return None
    return digest.hexdigest()


def load_model(
    arg: str,
    *,
    dtype: torch.dtype,
    device_map,
    input_device: torch.device,
    quiet: bool = False,
    role: str = "model",
    share_tokenizer: LoadedModel | None = None,
    builder: Builder = FullPrecision(),
) -> LoadedModel:
    """Load one model and its tokenizer; any failure is a one-line ModelError naming `role`
    (target or draft) and the model. `share_tokenizer`: a model whose tokenizer to reuse when
    both tokenizers are built from the same files (a draft of the target's family: saves
    about a second per start), else the tokenizer is loaded.

    Every load passes trust_remote_code=False: specgen never runs Python code that comes with
    a model, and transformers then never asks on stdin whether to (see `foreign_code`).

    `builder`: a GGUF source it accepts is built in its form (int8 linears on the CPU) instead of
    converted to a full-precision copy."""
    try:
        resolved = resolve(arg, dtype, quiet=quiet, convert=False)
    except ModelError as exc:  # say which of the two it is
        raise ModelError(f"the {role} model: {exc}", hint=exc.hint) from None
    if resolved.source == "dir":  # before anything else reads its JSON: one line naming the file and field
        try:
            model_files.check_model_dir(resolved.path, role)
        except ModelError as exc:
            raise ModelError(f"the {role} model: {exc}", hint=exc.hint) from None
    if resolved.source == "dir" and resolved.path and is_head(resolved.path):
        raise ModelError(
            f"'{arg}' is an EAGLE-3 head, not a model: it drafts for its target",
            hint="give it as --draft, with the model it was trained for as --target",
        )
    built = (
        device_map is None
        and resolved.source in ("gguf", "catalog")
        and builder.accepts(resolved, input_device, dtype)
    )
    resolved = (
        replace(resolved, path=builder.prepare(resolved, dtype, quiet))
        if built
        else resolved.converted(dtype, quiet)
    )
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
            if built:
                model = builder.load(resolved, dtype, quiet)
            else:
                model = AutoModelForCausalLM.from_pretrained(
                    resolved.path, dtype=dtype, device_map=device_map, trust_remote_code=False, **local
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
        input_device,
        dtype,
        resolved.path if resolved.source != "hub" else None,
        gguf=resolved.gguf,
    )


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


def load_pair(
    target: str,
    draft: str | None,
    *,
    device: str = "auto",
    draft_device: str | None = None,
    dtype: str = "auto",
    quiet: bool = False,
    target_builder: Builder = FullPrecision(),
    draft_builder: Builder = FullPrecision(),
) -> tuple[LoadedModel, LoadedModel | None]:
    """Load target (and draft), placed with accelerate; check that their tokenizers agree. A
    builder builds the GGUF sources it accepts in its own form (`load_model`)."""
    # Dequantized GGUF weights drive some activations subnormal; on x86 CPUs those take a
    # microcode slow path (ten times slower forwards: benchmarks/code-choices.md).
    torch.set_flush_denormal(True)
    cuda_count, budgets = _gpus()
    kind, gpus, draft_dev = placement_mod.plan(device, draft_device, cuda_count, budgets)
    first = torch.device(f"cuda:{gpus[0]}") if gpus else torch.device("cpu")
    torch_dtype = placement_mod.resolve_dtype(dtype, first)
    if kind == "split":
        target_map = _split_map(target, torch_dtype, gpus, budgets, quiet)
        target_dev = placement_mod.first_device(target_map)
    else:
        target_map = {"": str(first)} if gpus else None
        target_dev = first
    loaded_target = load_model(
        target,
        dtype=torch_dtype,
        device_map=target_map,
        input_device=target_dev,
        quiet=quiet,
        role="target",
        builder=target_builder,
    )
    if draft is None:
        return loaded_target, None
    return loaded_target, _load_draft_on(draft, draft_dev, dtype, loaded_target, quiet, draft_builder)


def load_draft(
    draft: str,
    target: LoadedModel,
    *,
    device: str = "auto",
    draft_device: str | None = None,
    dtype: str = "auto",
    quiet: bool = False,
    builder: Builder = FullPrecision(),
) -> LoadedModel:
    """Load only the draft, placed as load_pair would place it (chat's /method and /load)."""
    cuda_count, budgets = _gpus()
    _, _, draft_dev = placement_mod.plan(device, draft_device, cuda_count, budgets)
    return _load_draft_on(draft, draft_dev, dtype, target, quiet, builder)


def _load_draft_on(
    draft: str, draft_dev: torch.device, dtype: str, target: LoadedModel, quiet: bool, builder: Builder
) -> LoadedModel:
    if is_head(draft):
        return _load_head(draft, draft_dev, target, quiet)
    draft_dtype = placement_mod.resolve_dtype(dtype, draft_dev)
    loaded = load_model(
        draft,
        dtype=draft_dtype,
        device_map={"": str(draft_dev)} if draft_dev.type == "cuda" else None,
        input_device=draft_dev,
        quiet=quiet,
        role="draft",
        share_tokenizer=target,
        builder=builder,
    )
    if loaded.tokenizer is target.tokenizer:  # a shared one is the same by construction
        return loaded
    vocabulary = compare_tokenizers(target.tokenizer, loaded.tokenizer)
    if vocabulary is Vocabulary.TEXT:
        note(TEXT_DRAFTING)
    return replace(loaded, vocabulary=vocabulary)


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


def _gpus() -> tuple[int, dict[int, int] | None]:
    """CUDA device count, and free memory per GPU when there are several."""
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    budgets = {i: torch.cuda.mem_get_info(i)[0] for i in range(cuda_count)} if cuda_count > 1 else None
    return cuda_count, budgets


def compare_tokenizers(target_tok, draft_tok) -> Vocabulary:
    """SHARED when both tokenizers map the same ids to the same tokens with the same special
    tokens, else TEXT (a draft of another family drafts through text). A draft tokenizer that
    cannot give text back (ROUND_TRIP does not survive encode + decode) is refused: text-level
    drafting needs it."""
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    same = target_vocab == draft_vocab and all(
        getattr(target_tok, attr, None) == getattr(draft_tok, attr, None)
        for attr in ("eos_token", "bos_token", "pad_token", "unk_token")
    )
    if same:
        return Vocabulary.SHARED
    try:
        text = draft_tok.decode(
            draft_tok.encode(ROUND_TRIP, add_special_tokens=False),
            skip_special_tokens=True,
            clean_up_tokenization_spaces=False,
        )
    except Exception as exc:  # a tokenizer without a decoder, a broken one
        raise ModelError(
            f"draft and target tokenizers differ, and the draft's cannot decode text: {_first_line(exc)}"
        ) from None
    if text.strip() != ROUND_TRIP.strip():
        raise ModelError(
            f"draft and target tokenizers differ, and the draft's does not give text back "
            f"({ROUND_TRIP.strip()!r} decodes to {text.strip()!r}); text-level drafting needs it"
        )
    return Vocabulary.TEXT


def _split_map(target: str, dtype: torch.dtype, gpus: list[int], budgets, quiet: bool) -> dict:
    resolved = resolve(target, dtype, quiet=quiet)
    try:
        config = AutoConfig.from_pretrained(resolved.path, trust_remote_code=False)
    except ValueError as exc:
        if "custom code" in str(exc):
            raise foreign_code("target", target) from None
        raise ModelError(f"cannot read the target model's config '{target}': {_first_line(exc)}") from None
    max_memory = {g: int(budgets[g] * 0.85) for g in gpus}
    return placement_mod.split_device_map(config, dtype, max_memory)


def foreign_code(role: str, arg: str) -> ModelError:
    """A model whose architecture exists only as Python code shipped with it (`auto_map`).
    Every load passes trust_remote_code=False: specgen never runs a model's own code, and
    transformers then never asks on stdin (where a scripted chat's lines would answer)."""
    return ModelError(
        f"the {role} model '{arg}' needs its own Python code to load (an auto_map to custom "
        "code); specgen never runs code that comes with a model",
        hint="use a model whose architecture transformers supports natively",
    )


def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def _looks_like_path(arg: str) -> bool:
    return arg.startswith((".", "/", "~")) or arg.lower().endswith(".gguf") or os.sep + os.sep in arg


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
