"""The option groups the commands share, declared once: the models' (ModelSettings, the suffix
memory's MemorySettings within it) and a generation's (GenerationConfig); options.with_options
maps them onto those objects by keyword."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from specgen.config import DEFAULT_METHOD
from specgen.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET

# -- the option groups, declared once ------------------------------------------------------------
TargetOpt = Annotated[
    str, typer.Option("--target", "-t", help="Target model: directory, .gguf file, catalog name or HF id.")
]
DraftOpt = Annotated[
    str,
    typer.Option(
        "--draft",
        "-d",
        help="Draft model: a catalog name, a directory or a GGUF file. Another tokenizer than the target's "
        "works for chain and lookup-chain (it drafts text).",
    ),
]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu, cuda (all GPUs) or cuda:N.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto, bfloat16, float16 or float32.")]
TargetQuantOpt = Annotated[
    str,
    typer.Option(
        "--target-quant",
        help="The target's weights on the CPU: auto (int8 for a GGUF target when --dtype is auto), none, "
        "int8. Speculative output stays exact with respect to the target as quantized.",
    ),
]
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", "-n", help="Stop after this many new tokens.")]

# ModelSettings' fields, by keyword: (the option, its default)
MODEL_OPTIONS = {
    "target": (TargetOpt, DEFAULT_TARGET),
    "draft": (DraftOpt, DEFAULT_DRAFT),
    "device": (DeviceOpt, "auto"),
    "draft_device": (
        Annotated[
            Optional[str],
            typer.Option(
                "--draft-device",
                help="Device for the draft model (default: chosen with the target's placement).",
            ),
        ],
        None,
    ),
    "dtype": (DtypeOpt, "auto"),
    "draft_quant": (
        Annotated[
            str,
            typer.Option(
                "--draft-quant",
                help="A cheaper draft (CPU): auto (int8+prune for a draft on the CPU in bf16/fp16 or in the "
                "format --dtype auto chose, else none), none, int8, int8-wo, prune, int8+prune. The "
                "target is untouched; output stays exact.",
            ),
        ],
        "auto",
    ),
    "target_quant": (TargetQuantOpt, "auto"),
    "compile": (
        Annotated[
            str,
            typer.Option(
                "--compile",
                help="Fixed-shape steps: auto (inductor on CUDA, off on the CPU), on, off, graphs (CUDA "
                "graphs of eager kernels), inductor (compiled decoder layers, then CUDA graphs; measured "
                "slower than off on the CPU).",
            ),
        ],
        "auto",
    ),
    "threads": (
        Annotated[
            Optional[int],
            typer.Option(
                "--threads",
                envvar="SPECGEN_THREADS",
                help="torch threads for the forwards on the CPU (also $SPECGEN_THREADS). Default: one per "
                "core that other processes leave free, looked at again every second.",
            ),
        ],
        None,
    ),
}

# MemorySettings' fields (the suffix memory; a server adds --suffix-scope): (the option, its default)
MEMORY_OPTIONS = {
    "suffix_cache": (
        Annotated[
            float,
            typer.Option(
                "--suffix-cache",
                help="MiB of earlier requests' text that suffix drafting reads (evicted oldest first; "
                "at least 0.02).",
            ),
        ],
        256.0,
    ),
    "suffix_cache_file": (
        Annotated[
            Optional[str],
            typer.Option(
                "--suffix-cache-file",
                help="Keep the suffix memory in this file across runs (read at the start, written at "
                "the end; one that cannot be used is rebuilt with a notice).",
            ),
        ],
        None,
    ),
}

# generation_config's keywords: (the option, its default)
GENERATION_OPTIONS = {
    "method": (
        Annotated[
            str,
            typer.Option(
                "--method",
                "-m",
                help="plain, chain, lookup, lookup-chain, rsd-c, rsd-s, multi-draft, or eagle (with an "
                "EAGLE-3 head as --draft; chain means eagle there). lookup-chain: prompt lookup where the "
                "text repeats, the draft elsewhere.",
            ),
        ],
        DEFAULT_METHOD.value,
    ),
    "max_new_tokens": (MaxNewOpt, 256),
    "draft_tokens": (
        Annotated[
            str,
            typer.Option(
                "--draft-tokens",
                "-k",
                help="Draft tokens per round: N (fixed: every round drafts N), 'auto' (adaptive, up to 8) "
                "or 'device' (default: the k best for this device's measured costs; 4 on a GPU). Under "
                "'device' and 'auto' a row drafts less, down to none, where its rounds show it does not pay, "
                "and a draft model does not read a prompt whose reading would cost more than drafting "
                "--max-new-tokens can save (a server's reads serve later requests: always made).",
            ),
        ],
        "device",
    ),
    "draft_schedule": (
        Annotated[
            Optional[str],
            typer.Option(
                "--draft-schedule",
                help="fixed, additive or expected-gain (draft length per round, up to --draft-tokens).",
            ),
        ],
        None,
    ),
    "draft_confidence": (
        Annotated[
            Optional[float],
            typer.Option(
                "--draft-confidence",
                help="chain, lookup-chain and the trees: stop a draft early when the product of the "
                "draft's top probabilities over the round (its chance of still being right; a tree's "
                "likeliest path) falls below this "
                "(0: off; default with --draft-tokens device for a draft on the CPU: twice a draft "
                "step's measured cost in target steps, 0.5-0.8, about 0.7 for the default pair; "
                "else off).",
                show_default=False,
            ),
        ],
        None,
    ),
    "deterministic": (
        Annotated[
            bool,
            typer.Option(
                "--deterministic",
                help="Replay every window at a fixed shape; output independent of method, draft and batch.",
            ),
        ],
        False,
    ),
    "verify_window": (
        Annotated[
            int, typer.Option("--verify-window", help="Deterministic mode: tokens per replayed window.")
        ],
        32,
    ),
    "temperature": (
        Annotated[float, typer.Option("--temperature", help="0 is greedy; >0 samples (lossless).")],
        0.0,
    ),
    "top_k": (Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0: off).")], 0),
    "top_p": (Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (1: off).")], 1.0),
    "seed": (Annotated[Optional[int], typer.Option("--seed", help="Seed for every random draw.")], None),
    "branching": (
        Annotated[
            str, typer.Option("--branching", help="rsd-c/multi-draft: children per depth, e.g. 2,2,1.")
        ],
        "2,2,1",
    ),
    "beam_width": (Annotated[int, typer.Option("--beam-width", help="rsd-s: beam width W.")], 3),
    "depth": (Annotated[int, typer.Option("--depth", help="rsd-s: tree depth L.")], 4),
}
