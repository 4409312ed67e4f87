"""`specgen train-head` shows the acceptance a held-out set would get while it trains, not only
at the end: the trainer measures its held-out sequences every `evaluate_minutes` and hands the
acceptance per draft position to the progress bar."""

from __future__ import annotations

import torch
from tiny import save_tiny

from specgen.models.eagle_head import default_layers
from specgen.models.load import load_pair
from specgen.train import data
from specgen.train.head import _bar
from specgen.train.loop import Settings, Trainer

LAYERS = 4


def test_the_held_out_acceptance_is_measured_while_training(tmp_path):
    target = load_pair(
        str(save_tiny(tmp_path / "target", seed=1, layers=LAYERS)),
        None,
        device="cpu",
        dtype="float32",
        quiet=True,
    )[0]
    torch.manual_seed(0)
    sequences = [data.Sequence(torch.randint(0, 256, (40,)).tolist(), 8) for _ in range(8)]
    data.record(
        target.model, default_layers(LAYERS), sequences, data.Shards(tmp_path / "head"), target.device
    )
    measured, steps = [], []
    trainer = Trainer(
        target.model,
        tmp_path / "head",
        Settings(
            steps=2,
            draft_vocab=100,
            epochs=3,
            holdout=4,
            evaluate_minutes=1e-9,
            checkpoint_minutes=60,
            layers=default_layers(LAYERS),
        ),
        progress=lambda tokens, loss: steps.append(loss),
        heldout=measured.append,
    )
    trainer.run()
    assert len(measured) >= len(steps) - 1 > 0  # after (nearly) every step, at this cadence
    assert all(len(a) == 2 and all(0.0 <= x <= 1.0 for x in a) for a in measured)
    assert trainer.acceptance == measured[-1]


def test_the_bar_shows_the_held_out_acceptance():
    bar = _bar("training the head", None, quiet=False)
    with bar as advance:
        advance(100, 2.5)
        advance.heldout([0.5, 0.25, 0.125])
    fields = bar.progress.tasks[0].fields
    assert fields["heldout"] == "held-out acceptance 0.50/0.25/0.12" and fields["loss"] == "loss 2.500"
    with _bar("quiet", None, quiet=True) as quiet:
        quiet(5, 1.0)
        quiet.heldout([0.1])  # nothing shown, nothing fails
