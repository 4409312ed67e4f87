"""Where models go: parse --device, choose dtypes, and plan accelerate device maps.

The planning functions take plain numbers (device count, per-device memory budgets), so the
multi-GPU decision is testable on a machine without a GPU.
"""

from __future__ import annotations

import json
import platform
import re
import time
from dataclasses import dataclass

import torch

from specgen.errors import ConfigError
from specgen.files import cache_root, write_text
from specgen.status import note
from specgen.text import json_value

_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_device(value: str, option: str = "--device") -> str:
    value = value.strip().lower()
    if not _DEVICE.match(value):
        raise ConfigError(f"unknown device '{value}' for {option}; use auto, cpu, cuda or cuda:N")
    return value


def resolve_dtype(value: str, device: torch.device) -> torch.dtype:
    """'auto' -> bf16 on CUDA that supports it (else fp16); on the CPU, `cpu_format()`."""
    value = value.strip().lower()
    if value != "auto":
        if value not in _DTYPES:
            raise ConfigError(f"unknown dtype '{value}'; use auto, bfloat16, float16 or float32")
        return _DTYPES[value]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return cpu_format().dtype


@dataclass(frozen=True)
class CpuFormat:
    dtype: torch.dtype
    reason: str  # why, in a few words (shown in the stats)


def cpu_name() -> str:
    """The processor's model name from /proc/cpuinfo, else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (None where there is no such file)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def choose_cpu_dtype(flags: frozenset[str] | None, bf16_works: bool = True) -> CpuFormat | None:
    """The weight format for CPU decoding from the CPU's capabilities; None if they do not say.

    - native bf16 (avx512_bf16 or amx_bf16): bf16 (half the bytes, native dot products);
    - AVX-512 without native bf16: not conclusive (conversions are cheap there): measured;
    - AVX2 and below: fp32 (bf16 is emulated element by element there: several times slower,
      benchmarks/code-choices.md);
    - anything else (another architecture, no flags): not conclusive, measured.
    """
    if not bf16_works:
        return CpuFormat(torch.float32, "bf16 does not run on this CPU")
    if flags is None:
        return None
    if flags & {"avx512_bf16", "amx_bf16"}:
        return CpuFormat(torch.bfloat16, "native bf16 (avx512_bf16/amx_bf16)")
    if "avx512f" in flags:
        return None  # AVX-512 without native bf16: converting costs little; measure which wins
    if "avx2" in flags or "avx" in flags or "sse4_2" in flags:
        return CpuFormat(torch.float32, "no AVX-512 or native bf16: bf16 would be emulated")
    return None


_CHOSEN: CpuFormat | None = None


def cpu_format() -> CpuFormat:
    """The CPU's format, from its flags, else from a one-time measurement cached per machine."""
    global _CHOSEN
    if _CHOSEN is None:
        _CHOSEN = choose_cpu_dtype(cpu_flags(), cpu_supports_bf16()) or measured_cpu_format()
    return _CHOSEN


def cpu_supports_bf16() -> bool:
    """bf16 matmuls run (natively or through oneDNN's conversions) on this CPU."""
    try:
        a = torch.ones(4, 4, dtype=torch.bfloat16)
        return bool((a @ a)[0, 0] == 4)
    except RuntimeError:
        return False


def measured_cpu_format(cache_file=None) -> CpuFormat:
    """Time a decode step of one real-sized decoder layer in fp32 and bf16; cache the winner.

    Only used where the flags are not conclusive. The cache is keyed by the processor's name
    and torch's version, in $SPECGEN_CACHE/cpu-format.json; an entry that does not read back as
    one of the known formats is measured again (with a notice), never trusted.
    """
    key = format_key()
    cache_file = cache_file or cache_root() / "cpu-format.json"
    saved = _read_format(cache_file, key)
    if saved is not None:
        return saved
    seconds = {
        name: _decode_step_seconds(dtype)
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
    }
    name = min(seconds, key=seconds.get)
    result = CpuFormat(
        _DTYPES[name],
        f"measured one decoder layer: fp32 {seconds['float32'] * 1000:.1f} ms, "
        f"bf16 {seconds['bfloat16'] * 1000:.1f} ms per token",
    )
    try:
        write_text(cache_file, json.dumps({"key": key, "dtype": name, "reason": result.reason}))
    except OSError:
        pass  # an unwritable cache only means measuring again next time
    return result


def format_key() -> str:
    """What a measured format is cached under: the machine, the processor's model name and
    torch's version (`platform.processor()` is empty or just `x86_64` on Linux: every x86 CPU
    sharing a cache, as on a shared home, took the first one's measurement)."""
    return f"{platform.machine()} {cpu_name()} torch {torch.__version__}"


def _read_format(path, key: str) -> CpuFormat | None:
    """The cached choice for `key`, or None (absent, another machine's, or not valid)."""
    try:
        saved = json_value(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        saved = None
    if isinstance(saved, dict) and saved.get("key") != key:
        return None  # another CPU or torch: measured again, silently
    if (
        isinstance(saved, dict)
        and saved.get("dtype") in ("float32", "bfloat16")
        and isinstance(saved.get("reason"), str)
    ):
        return CpuFormat(_DTYPES[saved["dtype"]], saved["reason"])
    note(f"specgen: {path} is not a valid CPU format record; measuring again")
    return None


def plan(
    device: str, draft_device: str | None, cuda_count: int, budgets: dict[int, int] | None = None
) -> tuple[str, list[int], torch.device]:
    """Decide the placement kind without touching weights.

    Returns (kind, gpu ids for the target, draft device): kind is 'cpu', 'single' (one GPU)
    or 'split' (the target spread over several GPUs with a device map).
    """
    device = parse_device(device)
    if device == "auto":
        device = "cuda" if cuda_count > 0 else "cpu"
    if device.startswith("cuda") and cuda_count == 0:
        raise ConfigError(f"--device {device} asked for CUDA, but no CUDA device is available")
    if device == "cpu":
        gpus: list[int] = []
    elif device == "cuda":
        gpus = list(range(cuda_count))
    else:
        index = int(device.split(":")[1])
        if index >= cuda_count:
            raise ConfigError(
                f"--device {device} does not exist; this machine has {cuda_count} CUDA device(s)"
            )
        gpus = [index]
    kind = "cpu" if not gpus else ("single" if len(gpus) == 1 else "split")
    if draft_device is not None:
        draft = parse_device(draft_device, "--draft-device")
        if draft == "auto":
            draft_device = None
        elif draft.startswith("cuda") and (
            cuda_count == 0 or (":" in draft and int(draft.split(":")[1]) >= cuda_count)
        ):
            raise ConfigError(f"--draft-device {draft} is not available on this machine")
        else:
            return kind, gpus, torch.device(draft if draft != "cuda" else "cuda:0")
    if not gpus:
        return kind, gpus, torch.device("cpu")
    if len(gpus) == 1 or not budgets:
        return kind, gpus, torch.device(f"cuda:{gpus[-1]}")
    # Several GPUs: the draft goes where the most memory is free (ties: the last GPU).
    best = max(gpus, key=lambda g: (budgets.get(g, 0), g))
    return kind, gpus, torch.device(f"cuda:{best}")


def split_device_map(config, dtype: torch.dtype, max_memory: dict) -> dict:
    """A device map for `config`'s model across the budgets in max_memory (no weights loaded)."""
    from accelerate import infer_auto_device_map, init_empty_weights  # several GPUs only: rare
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return infer_auto_device_map(
        model, max_memory=max_memory, dtype=dtype, no_split_module_classes=model._no_split_modules or []
    )


def first_device(device_map: dict) -> torch.device:
    """The device of the input embedding (where input ids must go)."""
    for name, where in device_map.items():
        if "embed" in name or name in ("", "model"):
            return _as_device(where)
    return _as_device(next(iter(device_map.values())))


def _as_device(where) -> torch.device:
    return torch.device(f"cuda:{where}") if isinstance(where, int) else torch.device(where)


def _decode_step_seconds(dtype: torch.dtype) -> float:
    """Best of 5 single-token steps of a one-layer Qwen2 with the 1.5B's widths (64-token cache).

    A whole layer, not a matmul: norms, rotary and softmax decide as much as the products where
    bf16 is emulated (benchmarks/code-choices.md has the figures).
    """
    from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM  # only when measuring: rare

    from specgen.models.compat import CACHE_ARG  # imports transformers too

    config = Qwen2Config(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=1,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(dtype).eval()
    best = float("inf")
    with torch.inference_mode():
        cache = DynamicCache(config=config)
        model(input_ids=torch.arange(64).view(1, -1), **{CACHE_ARG: cache})
        for step in range(6):
            started = time.perf_counter()
            model(input_ids=torch.tensor([[step]]), **{CACHE_ARG: cache})
            if step:  # the first step warms up
                best = min(best, time.perf_counter() - started)
    return best
