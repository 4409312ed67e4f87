"""`specgen train-head`'s work: load the target, make and record the data once, train, write.

A rerun with the same DIR resumes: recorded shards are read back (when they come from the same
target, by a fingerprint of its weights), the checkpoint continues; `--minutes` adds that much
training to what the checkpoint holds. Ctrl-C stops training after its step, writes the
checkpoint and the head as trained so far, and exits 130; a failure (a diverged loss) writes no
head. A full disk, while recording or checkpointing, is one line naming the file that did not
fit (a DiskFullError); every file is written whole or not at all, so the shards recorded and the
last complete checkpoint stay, and a rerun with space continues from them.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from specgen.config import Method, ModelSettings
from specgen.decoding.engine import Engine
from specgen.errors import ConfigError
from specgen.models.eagle_head import check_layers, default_layers
from specgen.models.families import text_config
from specgen.runtime.pair import load
from specgen.train import data
from specgen.train.loop import Settings, Trainer, expected_tokens


def train_head(
    settings: ModelSettings,
    out: Path,
    source: str,
    tokens: int,
    answer_tokens: int,
    train: Settings,
    quiet: bool = False,
    prompts: list[str | list[dict]] | None = None,
) -> dict:
    """`source` is data.CODE, or the name of the prompt set whose prompts (a text, or a
    conversation's messages) are `prompts`."""
    check_out(out)
    target = load(settings, Method.PLAIN, quiet=quiet).target
    model = target.model
    config = text_config(model.config)
    count = config.num_hidden_layers
    layers = train.layers or default_layers(count)
    # before anything is written: a bad --layers must not leave a manifest behind. Layer 0 (the
    # embeddings' output) is one vLLM and SGLang never capture, and the original layout, which
    # numbers layer outputs, would write it as -1: a head reading it would run nowhere else
    if not train.layers and min(layers) < 1:
        raise ConfigError(
            f"the default --layers (2, L/2, L-3) need a target of at least 4 layers; this one "
            f"has {count}: give --layers"
        )
    if 0 in layers:
        raise ConfigError(
            "--layers 0 is the embeddings' output, which vLLM's and SGLang's EAGLE-3 do not "
            f"read: give layers 1 to {count}"
        )
    try:
        check_layers(tuple(layers), count)
    except ValueError as exc:
        raise ConfigError(f"--layers: {exc}") from None
    train = Settings(**{**train.__dict__, "layers": tuple(layers)})
    out.mkdir(parents=True, exist_ok=True)
    shards = data.Shards(out)
    manifest = shards.manifest()
    wanted = {
        "target": target.name,
        "source": source,
        "tokens": tokens,
        "layers": list(layers),
        "fingerprint": fingerprint(model),
    } | ({} if source == data.CODE else {"answer_tokens": answer_tokens})
    # a run stopped (or failed) before it recorded a sequence holds nothing to keep
    differs = [k for k, v in wanted.items() if k in manifest and manifest[k] != v]
    if manifest.get("sequences", 0) and differs:
        what = {
            "fingerprint": "another model of that name",
            "answer_tokens": f"answers of {manifest.get('answer_tokens')} tokens",
        }
        raise ConfigError(
            f"{out} holds data recorded for {manifest.get('target')} from {manifest.get('source')} "
            f"({manifest.get('tokens')} tokens, layers {manifest.get('layers')}"
            + "".join(f", {what[k]}" for k in differs if k in what)
            + "); use another --out"
        )
    if not manifest.get("sequences", 0):
        shards.write_manifest({**wanted, "sequences": 0, "shards": 0})
    started = time.monotonic()
    if not shards.manifest().get("complete"):  # a rerun of a whole recording skips making the data again
        # (for prompts, the target's own answers: minutes to hours of decoding on a CPU)
        sequences = _sequences(target, source, prompts or [], tokens, answer_tokens)
        if shards.manifest().get("sequences", 0) < len(sequences):
            with _bar(
                "recording the target's features", sum(len(s.ids) for s in sequences), quiet
            ) as advance:
                data.record(model, tuple(layers), sequences, shards, target.device, progress=advance)
        shards.write_manifest(
            {
                **shards.manifest(),
                "complete": True,
                "record_seconds": round(time.monotonic() - started, 1),
                "data_tokens": sum(len(s.ids) for s in sequences),
            }
        )
    data_tokens, recorded = shards.manifest()["data_tokens"], shards.manifest()["record_seconds"]
    with _bar("training the head", None, quiet) as advance:
        trainer = Trainer(model, out, train, progress=advance, heldout=advance.heldout)

        def write() -> None:
            trainer.evaluate()
            trainer.write(
                {
                    "target": target.name,
                    "source": source,
                    "data_tokens": data_tokens,
                    "record_seconds": recorded,
                    "layers": list(layers),
                    "expected_tokens_per_round": round(expected_tokens(trainer.acceptance), 3),
                }
            )

        try:
            trainer.run()
        except KeyboardInterrupt:  # the head as trained so far (a failure writes none: it may be junk)
            write()
            raise
        write()
    return json.loads((out / "training.json").read_text())


def fingerprint(model) -> str:
    """Which model the data was recorded from, beyond its directory's name: its config's shape
    and its first embedding rows (as bfloat16, so a load in another format agrees)."""
    config = text_config(model.config)
    rows = model.get_input_embeddings().weight[:64].detach().to(torch.bfloat16).float().cpu()
    shape = (config.hidden_size, config.num_hidden_layers, rows.shape)
    return hashlib.sha256(repr(shape).encode() + rows.numpy().tobytes()).hexdigest()[:16]


def check_out(out: Path) -> None:
    """--out is new, empty, or an earlier run's (which a rerun resumes): never a directory of
    other files, whose config.json and model.safetensors the head would overwrite."""
    try:
        str(out).encode("utf-8")
    except UnicodeEncodeError:  # safetensors (Rust) takes UTF-8 paths only: every shard would fail
        raise ConfigError(
            f"--out {str(out)!r} is not a UTF-8 path, which safetensors cannot write to; give another"
        ) from None
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "data" / "manifest.json").is_file():
        raise ConfigError(
            f"--out {out} holds other files, not an earlier train-head run's; give a new or empty directory"
        )


def _sequences(target, source: str, prompts: list, tokens: int, answer_tokens: int) -> list[data.Sequence]:
    if source == data.CODE:
        found = data.code_sequences(target.tokenizer, tokens, max_tokens=min(1024, target.context_length))
        if not found:
            raise ConfigError("no documented Python functions were found to train on")
        return found
    engine = Engine(target.model, target.device, target.stop_ids, target.context_length)
    sequences: list[data.Sequence] = []
    while sum(len(s.ids) for s in sequences) < tokens and prompts:
        take, prompts = prompts[:8], prompts[8:]
        sequences += data.prompt_sequences(engine, target.tokenizer, take, answer_tokens)
    return sequences


class _Advance:
    """What a bar's owner calls: (tokens, loss) per step, `heldout(acceptance)` per measurement."""

    def __init__(self, step=lambda tokens, loss=None: None, heldout=lambda acceptance: None):
        self.step, self.heldout = step, heldout

    def __call__(self, tokens: int, loss: float | None = None) -> None:
        self.step(tokens, loss)


class _bar:
    """A rich progress bar (tokens/s; while training, the last loss and the held-out acceptance
    per draft position as last measured), or nothing when quiet."""

    def __init__(self, label: str, total: int | None, quiet: bool):
        self.label, self.total, self.quiet = label, total, quiet

    def __enter__(self):
        if self.quiet:
            return _Advance()
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed} tokens"),
            TextColumn("{task.fields[rate]}"),
            TextColumn("{task.fields[loss]}"),
            TextColumn("{task.fields[heldout]}"),
            TimeElapsedColumn(),
            transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task(self.label, total=self.total, rate="", loss="", heldout="")
        self.started, self.done = time.monotonic(), 0

        def advance(tokens: int, loss: float | None = None) -> None:
            self.done += tokens
            rate = self.done / max(time.monotonic() - self.started, 1e-9)
            self.progress.update(
                self.task,
                advance=tokens,
                rate=f"{rate:.0f} tok/s",
                loss="" if loss is None else f"loss {loss:.3f}",
            )

        def heldout(acceptance: list[float]) -> None:
            self.progress.update(
                self.task, heldout="held-out acceptance " + "/".join(f"{a:.2f}" for a in acceptance)
            )

        return _Advance(advance, heldout)

    def __exit__(self, *exc):
        if not self.quiet:
            self.progress.stop()
        return False
