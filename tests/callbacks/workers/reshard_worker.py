"""torchrun worker: a checkpoint saved under (dp, pp, tp) = (2, 2, 2) resumes under other layouts.

    save DIR OUT        8 processes: train 10 steps under "3d" (2, 2, 2), checkpoint at step 5; rank 0 writes the
                        full weights at step 5 and the losses of steps 6–10
    resume DIR OUT NAME resume DIR's step-5 checkpoint under NAME (ddp, zero3 or single) to step 10; rank 0
                        writes the full weights right after loading and the losses of steps 6–10
"""

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

import meshlight as ml
from meshlight.callbacks import DistributedCheckpoint
from meshlight.demos import AdditionDataModule
from tests.callbacks.workers.resume_worker import GLOBAL_BATCH, STEPS_PER_EPOCH, model
from tests.strategies.parity import full_weights

SAVE_AT, MAX_STEPS = 5, 10


class Record(Callback):
    def __init__(self, weights_at: int) -> None:
        self.weights_at, self.weights, self.losses = weights_at, {}, {}

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.global_step == self.weights_at:
            self.weights = full_weights(module)

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: object) -> None:
        self.losses[trainer.global_step] = float(trainer.callback_metrics["train/loss"])
        if trainer.global_step == self.weights_at:
            self.weights = full_weights(module)


def main(mode: str, directory: Path, out: Path, name: str = "3d") -> None:
    world = int(os.environ["WORLD_SIZE"])
    strategy = {"3d": lambda: ml.Hybrid3DStrategy(dp=2, pp=2, tp=2, ep=1, zero=1), "ddp": lambda: "ddp",
                "zero3": lambda: "zero3", "single": lambda: "ddp"}[name]()
    dp = 2 if name == "3d" else world
    pl.seed_everything(0, verbose=False)
    record = Record(SAVE_AT)
    callbacks = [record]
    if mode == "save":
        callbacks.append(DistributedCheckpoint(directory, every_n_train_steps=SAVE_AT, save_top_k=-1,
                                               async_save=False))
    trainer = ml.Trainer(strategy=strategy, devices=world, accelerator="cpu", max_steps=MAX_STEPS, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         enable_checkpointing=mode == "save", callbacks=callbacks)
    data = AdditionDataModule(3, batch_size=GLOBAL_BATCH // dp, train_size=GLOBAL_BATCH * STEPS_PER_EPOCH)
    ckpt = None if mode == "save" else str(directory / f"step={SAVE_AT:09d}")
    trainer.fit(model(0), data, ckpt_path=ckpt)
    if dist.get_rank() == 0:
        losses = {step: loss for step, loss in record.losses.items() if step > SAVE_AT}
        torch.save({"weights": record.weights, "losses": losses}, out)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), *sys.argv[4:])
