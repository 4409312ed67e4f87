"""Training data for a head: token sequences, and what the target computes over them, recorded once.

Sequences come from one of two sources:

* `code` (offline, the default): instructions made from the functions of the Python packages
  installed here ("Write a Python function `name(args)`: <its docstring>"), answered with the
  function's own source, in the target's chat template; trained on at every position (the
  labels are the target's own greedy tokens there, whatever the text says);
* a prompt set or file (`--prompts`): self-distillation, the target's own greedy answers (the
  text it will later verify), `--answer-tokens` each, made by the engine (lookup-chain when a
  draft is loaded would be faster; plain keeps this module free of a draft).

`record` runs the target once over each sequence with a tapped cache (the same forward the
engine runs: the lean int8 path on a CPU) and keeps, per position, the head's input features
(float16) and the target's greedy next token there (the label a head is trained toward), in
shards of `shard_tokens` under `DIR/data/`: a rerun reads them back instead of recording again.
"""

from __future__ import annotations

import ast
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file

from specgen.config import GenerationConfig, Method
from specgen.decoding.engine import Engine
from specgen.decoding.events import Finished
from specgen.decoding.prompts import encode_prompt, render_chat
from specgen.errors import ConfigError
from specgen.files import atomic_write, remove, write_text
from specgen.runtime import features as taps
from specgen.runtime import kvcache
from specgen.runtime.lean import call_for
from specgen.text import json_value

CODE = "code"
CHUNK = 512  # positions the target reads per forward while recording
SHARD_TOKENS = 16384  # tokens per shard, about (a full disk or Ctrl-C loses at most one shard's recording)


@dataclass(frozen=True)
class Sequence:
    ids: list[int]
    start: int  # first position whose label is trained on (the answer's; 0: all)


def code_sequences(tokenizer, tokens: int, seed: int = 0, max_tokens: int = 1024) -> list[Sequence]:
    """Instruction/answer pairs from installed packages' documented functions, about `tokens`
    tokens in all (an answer cut at `max_tokens` in all)."""
    out, total = [], 0
    for name, args, doc, source in _documented_functions(seed):
        prompt = f"Write a Python function `{name}({args})`. {doc[:500]}"
        ids = render_chat(tokenizer, [{"role": "user", "content": prompt}])
        if len(ids) > max_tokens // 2:
            continue
        answer = tokenizer.encode(f"```python\n{source}\n```", add_special_tokens=False)[
            : max_tokens - len(ids)
        ]
        out.append(Sequence(ids + answer, 0))  # every position: the docstring's prose and the code
        total += len(ids) + len(answer)
        if total >= tokens:
            break
    return out


def _documented_functions(seed: int) -> Iterator[tuple[str, str, str, str]]:
    """(name, args, first docstring paragraph, source) of top-level functions in the standard
    library and site-packages' pure-Python modules, in a shuffled but fixed order."""
    roots = [
        Path(p)
        for p in sys.path
        if p
        and Path(p).is_dir()
        and ("site-packages" in p or p.endswith(f"python{sys.version_info.major}.{sys.version_info.minor}"))
    ]
    files = sorted(
        {
            f
            for root in roots
            for f in root.rglob("*.py")
            if "test" not in f.name and f.stat().st_size < 200_000
        }
    )
    random.Random(seed).shuffle(files)
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            source = ast.get_source_segment(text, node)
            if not doc or not source or len(source) > 3000:
                continue
            args = ", ".join(a.arg for a in node.args.args)
            yield node.name, args, doc.strip().split("\n\n")[0].replace("\n", " "), source


def prompt_sequences(
    engine: Engine, tokenizer, texts: list[str | list[dict]], answer_tokens: int
) -> list[Sequence]:
    """Each prompt (a user message, or a whole conversation: every turn is context) with the
    target's own greedy answer (plain decoding through `engine`)."""
    prompts = [
        render_chat(tokenizer, text) if isinstance(text, list) else encode_prompt(tokenizer, text)
        for text in texts
    ]
    config = GenerationConfig(method=Method.PLAIN, max_new_tokens=answer_tokens)
    done = {}
    for report in engine.generate(prompts, config, batch_size=4):
        if isinstance(report.event, Finished):
            done[report.index] = report.state.ids
    return [Sequence(done[i], len(prompts[i]) - 1) for i in range(len(prompts))]


@torch.inference_mode()
def record_one(
    model, call, layers: tuple[int, ...], ids: list[int], device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [T, taps * H] float16, the target's greedy token after each position [T]) of one sequence."""
    cache = kvcache.SlotCache(model.config, rows=1, taps=layers)
    cache.reserve(len(ids))
    labels = []
    for start in range(0, len(ids), CHUNK):
        logits = kvcache.forward(call, cache, torch.tensor([ids[start : start + CHUNK]], device=device))
        labels.append(logits[0].argmax(-1).cpu())
    return cache.features.read(0, 0, len(ids)).to(torch.float16).cpu(), torch.cat(labels)


class Shards:
    """Recorded sequences on disk: `DIR/data/shard-N.safetensors` (ids, starts, features, labels),
    and `manifest.json`, which counts the sequences and shards recorded. Each file is written whole
    or not at all (atomic_write): a full disk is one line naming the shard, and leaves no part of
    one that a rerun would read as recorded."""

    def __init__(self, directory: Path):
        self.dir = directory / "data"
        self.dir.mkdir(parents=True, exist_ok=True)

    def files(self) -> list[Path]:
        return sorted(self.dir.glob("shard-*.safetensors"), key=lambda p: int(p.stem.split("-")[1]))

    def manifest(self) -> dict:
        """What was recorded ({} before anything); one that cannot be read is one line."""
        path = self.dir / "manifest.json"
        try:
            manifest = json_value(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):  # unreadable, not UTF-8, not JSON
            manifest = None
        if not isinstance(manifest, dict):
            raise ConfigError(f"{path} cannot be read", hint=f"remove {self.dir} to record the data again")
        return manifest

    def write_manifest(self, manifest: dict) -> None:
        write_text(self.dir / "manifest.json", json.dumps(manifest, indent=1) + "\n", parents=False)

    def tidy(self, manifest: dict) -> None:
        """Remove what the manifest does not count: a shard written just before the disk filled (or
        a kill came) while the manifest was updated, whose sequences are recorded again (never
        twice), and the temporaries of a killed run (the space they hold)."""
        listed = manifest.get("shards", None if manifest.get("sequences") else 0)
        if listed is not None:  # an older run's manifest (no count) counts every shard
            for file in self.files()[listed:]:
                remove(file)
        for stale in self.dir.glob(".shard-*.tmp"):
            remove(stale)

    def tokens(self) -> int:
        return sum(int(self._read(f)["ids"].numel()) for f in self.files())

    def _read(self, file: Path) -> dict[str, torch.Tensor]:
        """A shard's tensors; one that cannot be read (a disk filled, a copy cut short) is one line."""
        try:
            return load_file(str(file))
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own kinds, and OSError
            raise ConfigError(
                f"the recorded shard {file} cannot be read ({type(exc).__name__})",
                hint=f"remove {self.dir} to record the data again",
            ) from None

    def write(self, batch: list[tuple[Sequence, torch.Tensor, torch.Tensor]]) -> None:
        index = len(self.files())
        ids = torch.cat([torch.tensor(s.ids) for s, _, _ in batch])
        tensors = {
            "ids": ids,
            "lengths": torch.tensor([len(s.ids) for s, _, _ in batch]),
            "starts": torch.tensor([s.start for s, _, _ in batch]),
            "features": torch.cat([f for _, f, _ in batch]),
            "labels": torch.cat([lab for _, _, lab in batch]),
        }
        atomic_write(
            self.dir / f"shard-{index}.safetensors",
            lambda tmp: save_file(tensors, str(tmp)),
            tmp=self.dir / f".shard-{index}.tmp",
            parents=False,
        )

    def sequences(self) -> Iterator[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]]:
        """(ids [T], start, features [T, F], labels [T]) of every recorded sequence."""
        for file in self.files():
            data = self._read(file)
            offset = 0
            for length, start in zip(data["lengths"].tolist(), data["starts"].tolist()):
                end = offset + length
                yield data["ids"][offset:end], start, data["features"][offset:end], data["labels"][offset:end]
                offset = end


def record(
    model,
    layers: tuple[int, ...],
    sequences: list[Sequence],
    shards: Shards,
    device,
    progress=None,
    shard_tokens: int | None = None,
) -> None:
    """Record the sequences not yet on disk (the manifest counts those done) into shards of about
    `shard_tokens` (SHARD_TOKENS) tokens each; the manifest is updated after each shard."""
    shard_tokens = shard_tokens or SHARD_TOKENS
    taps.install(model)
    call = call_for(model)
    manifest = shards.manifest()
    shards.tidy(manifest)
    done = manifest.get("sequences", 0)
    batch, held = [], 0
    for i, sequence in enumerate(sequences[done:], start=done):
        feats, labels = record_one(model, call, layers, sequence.ids, device)
        batch.append((sequence, feats, labels))
        held += len(sequence.ids)
        if progress is not None:
            progress(len(sequence.ids))
        if held >= shard_tokens or i == len(sequences) - 1:
            shards.write(batch)
            manifest["sequences"], manifest["shards"] = i + 1, len(shards.files())
            shards.write_manifest(manifest)
            batch, held = [], 0
