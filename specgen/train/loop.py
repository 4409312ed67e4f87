"""Train a head: choose its draft vocabulary, initialise it from the target, run the
training-time test (ttt.py) over recorded sequences, checkpoint, resume, write the head.

* Vocabulary: the `draft_vocab` target ids most often the target's greedy answer in the
  training data (then the lowest ids), sorted by id (d2t, t2d as EAGLE-3 builds them).
* Initialisation: lm_head from the target's output rows of those ids (kept frozen, as vLLM's
  speculators trainer does: the target's own output space, and a third less to train), the
  final norm from the target's, token embedding shared (frozen); fc and the layer random (std 0.02).
* Training: AdamW, one sequence per step, held-out sequences (every `holdout`-th) never
  trained on; their acceptance per draft position is measured every `evaluate_minutes` while
  training (the progress bar shows it) and at the end.
* Checkpoints: `DIR/checkpoint.pt` (head, optimiser, position) every `checkpoint_minutes`,
  written whole or not at all (`save_torch`); a rerun resumes from it; Ctrl-C writes one first.
  On a full disk the run stops with one line, the last complete checkpoint kept and no
  `checkpoint.tmp` left: a rerun with space resumes from it.
* Output: `DIR/config.json` and `DIR/model.safetensors` in the public format (`fmt`), and
  `DIR/training.json` (data, time, acceptance per position).
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from specgen.errors import ConfigError, DiskFullError
from specgen.files import atomic_write, write_text
from specgen.models.eagle_format import ORIGINAL, save_head
from specgen.models.eagle_head import Eagle3Head, HeadConfig
from specgen.models.families import text_config
from specgen.train.data import Shards
from specgen.train.ttt import CHAINED, CORRECT, COUNTED, unroll


@dataclass
class Settings:
    steps: int = 3  # draft steps unrolled (training-time test)
    draft_vocab: int = 32000
    lr: float = 3e-4
    epochs: int = 1
    minutes: float = 0.0  # stop after training this much longer (0: when the epochs are done)
    checkpoint_minutes: float = 5.0
    evaluate_minutes: float = (
        2.0  # the held-out acceptance is measured this often while training (0: at the end)
    )
    holdout: int = 10  # every holdout-th sequence is held out
    intermediate: int = 0  # the layer's MLP width (0: the target's)
    seed: int = 0
    fmt: str = ORIGINAL
    bf16: bool = False  # bfloat16 autocast for the products (CPUs with native bf16)
    layers: tuple[int, ...] = ()


def choose_vocabulary(shards: Shards, size: int, vocab: int, holdout: int) -> torch.Tensor:
    """[size] sorted target ids: the most frequent trained labels, then the lowest ids."""
    counts: Counter = Counter()
    for i, (_, start, _, labels) in enumerate(shards.sequences()):
        if i % holdout:
            counts.update(labels[max(start, 0) :].tolist())
    size = min(size, vocab)
    chosen = [t for t, _ in counts.most_common(size)]
    missing = size - len(chosen)
    if missing:
        have = set(chosen)
        chosen += [t for t in range(vocab) if t not in have][:missing]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def new_head(
    target_model, layers: tuple[int, ...], used: torch.Tensor, intermediate: int, seed: int
) -> Eagle3Head:
    config = text_config(target_model.config)
    vocab = target_model.get_input_embeddings().weight.shape[0]
    heads = config.num_attention_heads
    hc = HeadConfig(
        hidden_size=config.hidden_size,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate_size=intermediate or config.intermediate_size,
        vocab_size=vocab,
        draft_vocab_size=used.shape[0],
        layers=layers,
        rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
        rope_theta=float(getattr(config, "rope_theta", 10000.0) or 10000.0),
        max_position_embeddings=config.max_position_embeddings,
    )
    torch.manual_seed(seed)
    head = Eagle3Head(hc)
    for name, param in head.named_parameters():
        if param.dim() == 2:
            torch.nn.init.normal_(param, std=0.02)
    with torch.no_grad():
        head.d2t.copy_(used - torch.arange(used.shape[0]))
        head.t2d.zero_()
        head.t2d[used] = True
        output = target_model.get_output_embeddings()
        weight = getattr(output, "weight", None)
        if weight is None:  # an int8 head: its rows dequantized
            weight = output(torch.eye(config.hidden_size)).T
        head.lm_head.weight.copy_(weight[used].float())
        head.norm.weight.copy_(target_model.model.norm.weight.float())
    head.lm_head.weight.requires_grad_(False)
    head.use_embedding(target_model.get_input_embeddings())
    return head


def save_torch(state, path: Path, tmp: Path | None = None) -> None:
    """`state` written by torch.save, whole or not at all (atomic_write: on a failure the file at
    `path` is the one before, the temporary gone). torch's writer turns a failed write into
    RuntimeError("[enforce fail at inline_container.cc] unexpected pos ..."), which says neither
    why nor where: written through a file object of ours, the OSError it swallowed (a full disk's
    ENOSPC) is raised instead, and atomic_write makes it one line naming `path`."""

    def write(target: Path) -> None:
        with open(target, "wb") as handle:
            sink = _Sink(handle)
            try:
                torch.save(state, sink)
            except RuntimeError:
                if sink.error is not None:
                    raise sink.error from None
                raise

    atomic_write(path, write, tmp=tmp, parents=False)


class _Sink:
    """An open file as torch.save sees it, keeping the OSError of a write that failed."""

    def __init__(self, handle):
        self.handle, self.error = handle, None

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.handle.flush()


def draft_index(head: Eagle3Head) -> torch.Tensor:
    index = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    index[head.draft_to_target()] = torch.arange(head.config.draft_vocab_size)
    return index


class Diverged(ConfigError):
    """The loss stopped being a finite number: what the head learned since the last checkpoint
    is junk, so neither a checkpoint nor a head is written from it."""


class Trainer:
    """A head in training and how far it got (checkpointed, resumed). `progress(tokens, loss)`
    after each step; `heldout(acceptance per position)` after each measurement of the held-out
    sequences."""

    def __init__(self, target_model, directory: Path, settings: Settings, progress=None, heldout=None):
        self.target, self.dir, self.settings, self.progress = target_model, directory, settings, progress
        self.heldout = heldout
        self.shards = Shards(directory)
        self.checkpoint = directory / "checkpoint.pt"
        self.position = 0  # sequences trained in this epoch
        self.epoch = 0
        self.tokens, self.seconds, self.steps_done = 0, 0.0, 0  # trained so far, over every run
        self.acceptance: list[float] = []  # held out, as last measured: P(draft i accepted)
        self.accuracy: list[float] = []  # held out: P(step i's greedy draft is the target's token)
        if self.checkpoint.is_file():
            try:
                saved = torch.load(self.checkpoint, map_location="cpu", weights_only=True)
                used = saved["used"]
            except Exception as exc:  # noqa: BLE001 - a truncated or foreign file; torch raises many kinds
                raise ConfigError(
                    f"{self.checkpoint} cannot be read ({type(exc).__name__})",
                    hint="remove it to train the head from the start on the recorded data",
                ) from None
        else:
            saved, used = None, None
        vocab = target_model.get_input_embeddings().weight.shape[0]
        if used is None:
            used = choose_vocabulary(self.shards, settings.draft_vocab, vocab, settings.holdout)
        self.head = new_head(target_model, settings.layers, used, settings.intermediate, settings.seed)
        self.head.train()
        self.index = draft_index(self.head)
        params = [p for p in self.head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.used = used
        if saved is not None:
            self._check_resumable(saved["head"], vocab)
            self.head.load_state_dict(saved["head"])
            self.optimizer.load_state_dict(saved["optimizer"])
            self.position, self.epoch = saved["position"], saved["epoch"]
            tally = saved["report"]
            self.tokens, self.seconds, self.steps_done = (
                tally["tokens"],
                tally["seconds"],
                tally["steps_done"],
            )
            self.acceptance, self.accuracy = tally["acceptance"], tally["accuracy"]

    def _check_resumable(self, saved: dict, vocab: int) -> None:
        """A checkpoint resumes only the head it holds: a rerun asking for another shape is one
        line naming the setting (not a state_dict error, nor a silent keep of the old one)."""
        asked = min(self.settings.draft_vocab, vocab)
        if int(self.used.shape[0]) != asked:
            raise ConfigError(
                f"{self.dir} holds a head in training with --draft-vocab {int(self.used.shape[0])}; "
                f"this run asks for {asked}",
                hint="rerun with that --draft-vocab, or use another --out",
            )
        for key, tensor in self.head.state_dict().items():
            if key in saved and tuple(saved[key].shape) != tuple(tensor.shape):
                raise ConfigError(
                    f"{self.dir} holds a head in training of another shape ({key}: "
                    f"{tuple(saved[key].shape)}, this run's {tuple(tensor.shape)}: another "
                    "--intermediate?)",
                    hint="rerun with its settings, or use another --out",
                )

    def save_checkpoint(self) -> None:
        """The checkpoint replaced only once the new one is whole: a full disk (DiskFullError) keeps the last
        complete one for a rerun to resume from. Its temporary, `checkpoint.tmp`, has a fixed name: one left
        by
        a killed run is removed (its space freed) before the next is written."""
        save_torch(
            {
                "head": self.head.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "used": self.used,
                "position": self.position,
                "epoch": self.epoch,
                "report": {
                    "tokens": self.tokens,
                    "seconds": self.seconds,
                    "steps_done": self.steps_done,
                    "acceptance": self.acceptance,
                    "accuracy": self.accuracy,
                },
            },
            self.checkpoint,
            tmp=self.checkpoint.with_suffix(".tmp"),
        )

    def order(self, count: int) -> list[int]:
        """This epoch's order of the `count` recorded sequences' trained ones (held-out ones left out)."""
        train = [i for i in range(count) if i % self.settings.holdout]
        random.Random(self.settings.seed + self.epoch).shuffle(train)
        return train

    def run(self) -> None:
        """Train until the epochs or the minutes are spent; checkpoint as it goes."""
        settings = self.settings
        started = last_save = last_evaluation = time.monotonic()
        spent_before = self.seconds
        sequences = list(self.shards.sequences())
        if not self.order(len(sequences)):
            raise ConfigError(
                f"{len(sequences)} recorded sequence(s), none left to train on once every "
                f"{settings.holdout}th is held out to measure acceptance; give more --tokens"
            )
        failed = False
        try:
            while settings.minutes or self.epoch < settings.epochs:  # --minutes: as many passes as fit
                order = self.order(len(sequences))
                while self.position < len(order):
                    if settings.minutes and self.seconds - spent_before >= settings.minutes * 60:
                        return
                    ids, start, feats, labels = sequences[order[self.position]]
                    self._step(ids, start, feats, labels)
                    self.position += 1
                    self.seconds = spent_before + time.monotonic() - started
                    if (
                        settings.evaluate_minutes
                        and time.monotonic() - last_evaluation > settings.evaluate_minutes * 60
                    ):
                        self.evaluate()
                        last_evaluation = time.monotonic()
                    if time.monotonic() - last_save > settings.checkpoint_minutes * 60:
                        self.save_checkpoint()
                        last_save = time.monotonic()
                self.epoch, self.position = self.epoch + 1, 0
        except (Diverged, DiskFullError):  # junk to keep, or a checkpoint that did not fit: no second try
            failed = True
            raise
        finally:  # Ctrl-C included: the last checkpoint holds everything trained
            if not failed:
                self.save_checkpoint()

    def _step(self, ids, start, feats, labels) -> None:
        lr = self.settings.lr * min(1.0, (self.steps_done + 1) / 50)  # a short warm-up
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.settings.bf16):
            loss, _ = unroll(self.head, feats, ids, labels, start, self.settings.steps, self.index)
        self._finite(loss.detach(), "loss")
        if loss.requires_grad:
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            # a finite loss may still have infinite gradients: clipping them would write NaN weights
            self._finite(torch.nn.utils.clip_grad_norm_(self.head.parameters(), 0.5), "gradient")
            self.optimizer.step()
        self.tokens += int(ids.shape[0])
        self.steps_done += 1
        if self.progress is not None:
            self.progress(int(ids.shape[0]), float(loss.detach()))

    def _finite(self, value: torch.Tensor, what: str) -> None:
        """Diverged unless `value` is a finite number (one host sync a step: training, not decoding)."""
        if not bool(torch.isfinite(value)):
            kept = (
                "the last checkpoint keeps what came before"
                if self.checkpoint.is_file()
                else "nothing is kept"
            )
            raise Diverged(
                f"the training {what} is no longer finite at step {self.steps_done + 1}",
                hint=f"a smaller --lr than {self.settings.lr:g}; {kept}",
            )

    @torch.no_grad()
    def evaluate(self) -> None:
        """Measure the held-out acceptance per draft position (greedy chains) and accuracy per step."""
        totals = torch.zeros(3, self.settings.steps)
        self.head.eval()
        for i, (ids, start, feats, labels) in enumerate(self.shards.sequences()):
            if i % self.settings.holdout == 0:
                totals += unroll(self.head, feats, ids, labels, start, self.settings.steps, self.index)[1]
        self.head.train()
        chained, correct, counted = totals[CHAINED], totals[CORRECT], totals[COUNTED]
        self.acceptance = [round(float(c / max(n, 1)), 4) for c, n in zip(chained, counted)]
        self.accuracy = [round(float(c / max(n, 1)), 4) for c, n in zip(correct, counted)]
        if self.heldout is not None:
            self.heldout(self.acceptance)

    def write(self, extra: dict | None = None) -> None:
        """The head in its public format, and training.json."""
        self.head.eval()
        config = text_config(self.target.config)
        save_head(
            self.head,
            self.dir,
            self.settings.fmt,
            getattr(self.target, "name_or_path", "") or "",
            config.num_hidden_layers,
        )
        record = {
            "tokens_trained": self.tokens,
            "seconds": round(self.seconds, 1),
            "steps": self.steps_done,
            "epochs": self.epoch,
            "ttt_steps": self.settings.steps,
            "draft_vocab": int(self.used.shape[0]),
            "lr": self.settings.lr,
            "heldout_acceptance_per_position": self.acceptance,
            "heldout_accuracy_per_step": self.accuracy,
            **(extra or {}),
        }
        write_text(self.dir / "training.json", json.dumps(record, indent=1) + "\n", parents=False)


def expected_tokens(acceptance: list[float]) -> float:
    """Tokens a round emits with greedy chains at these per-position acceptances (+1: the target's)."""
    return 1.0 + sum(acceptance)
