"""torchrun worker (4 processes): the same 8 steps under "3d" (pp=2 × tp=2, ZeRO-1) and zero3 × 4, each without
and with ActivationCheckpointing, on a GPT with dropout; rank 0 writes {run: (losses, full weights, blocks
recomputed on rank 0)} to OUT."""

import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

import meshlight as ml
from meshlight.callbacks import ActivationCheckpointing
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig
from tests.strategies.parity import full_weights


class Losses(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.values.append(float(trainer.callback_metrics["train/loss"]))


def run(strategy: object, recompute: bool, dp: int) -> tuple[list[float], dict[str, torch.Tensor], int]:
    pl.seed_everything(0, verbose=False)
    config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=32, n_layers=4,
                            dropout=0.1)
    module, losses = LitGPT(config, lr=1e-2, warmup_steps=2), Losses()
    callbacks = [losses, ActivationCheckpointing()] if recompute else [losses]
    trainer = ml.Trainer(strategy=strategy, devices=4, accelerator="cpu", max_steps=8, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, callbacks=callbacks)
    trainer.fit(module, AdditionDataModule(3, batch_size=16 // dp, train_size=16 * 8))
    recomputed = sum(getattr(m, "_meshlight_recompute", False) for m in trainer.strategy.model.modules())
    return losses.values, full_weights(module), recomputed


if __name__ == "__main__":
    results = {}
    for recompute in (False, True):
        results["3d", recompute] = run(ml.Hybrid3DStrategy(dp=1, pp=2, tp=2, ep=1, zero=1), recompute, dp=1)
        results["zero3", recompute] = run("zero3", recompute, dp=4)
    if dist.get_rank() == 0:
        torch.save(results, sys.argv[1])
