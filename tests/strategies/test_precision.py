"""Precision on the demo task under meshlight's strategies: the MixedPrecision callback (bf16 parameters and
compute over fp32 master weights) and Lightning's own "bf16-mixed" (autocast over fp32 weights) track the fp32
loss curve within 2% over 200 steps; "bf16-true" trains bf16 weights."""

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

import meshlight as ml
from meshlight.callbacks import MixedPrecision
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig


class Losses(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.values.append(float(trainer.callback_metrics["train/loss"]))


def _train(precision: str, steps: int = 200, callbacks: tuple = ()) -> tuple[list[float], LitGPT]:
    pl.seed_everything(0, verbose=False)
    losses = Losses()
    config = GPTConfig(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, n_layers=2, dim=64, n_heads=4)
    module = LitGPT(config, weight_decay=0.0, warmup_steps=10)
    trainer = ml.Trainer(strategy="zero1", devices=1, accelerator="cpu", precision=precision, max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=[losses, *callbacks])
    trainer.fit(module, AdditionDataModule(3, batch_size=32, train_size=32 * steps))
    return losses.values, module


@pytest.fixture(scope="module")
def fp32() -> list[float]:
    return _train("32-true")[0]


def test_mixed_precision_callback_tracks_the_fp32_loss_curve(fp32):
    bf16, module = _train("32-true", callbacks=(MixedPrecision("bf16"),))
    assert bf16 != fp32  # bf16 compute: the values differ in the low bits
    assert all(p.dtype == torch.float32 for p in module.parameters())  # the master weights
    worst = max(abs(b - f) / f for b, f in zip(bf16, fp32))
    assert len(bf16) == 200 and worst <= 0.02, worst


def test_bf16_mixed_tracks_the_fp32_loss_curve(fp32):
    bf16, module = _train("bf16-mixed")
    assert bf16 != fp32  # autocast is active: the values differ in the low bits
    assert all(p.dtype == torch.float32 for p in module.parameters())
    worst = max(abs(b - f) / f for b, f in zip(bf16, fp32))
    assert len(bf16) == 200 and worst <= 0.02, worst


def test_bf16_true_trains_bf16_weights(fp32):
    bf16, module = _train("bf16-true", steps=50)
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert bf16[-1] < bf16[0] * 0.8
