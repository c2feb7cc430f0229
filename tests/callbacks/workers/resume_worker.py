"""torchrun worker: resume exactness of DistributedCheckpoint under every strategy.

    full OUT NAMES...   train each strategy 20 steps uninterrupted (checkpoints every 5 steps too); rank 0 writes
                        {name: {step: loss}} to OUT
    kill DIR NAME       train NAME with checkpoints every 5 steps into DIR/NAME; every rank SIGKILLs itself
                        right after step 12 (the async save of step 10 may still be in flight)
    resume DIR OUT NAMES...  fit(ckpt_path="last") each to step 20; rank 0 writes the losses of the steps run

Epochs are 8 steps long, so step 10 is mid-epoch: the resumed data position comes from the sampler skipping
what the epoch consumed.
"""

import os
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

import meshlight as ml
from meshlight.callbacks import DistributedCheckpoint
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig
from meshlight.nn import MoEConfig

GLOBAL_BATCH, STEPS_PER_EPOCH, MAX_STEPS, KILL_AFTER = 16, 8, 20, 12

# name -> (world size, strategy factory, experts)
STRATEGIES = {
    "ddp": (2, lambda: "ddp", 0),
    "zero1": (2, lambda: "zero1", 0),
    "zero2": (2, lambda: "zero2", 0),
    "zero3": (2, lambda: "zero3", 0),
    "tp": (2, lambda: "tp", 0),
    "pipeline": (2, lambda: "pipeline", 0),
    "moe": (2, lambda: "moe", 4),
    "3d": (4, lambda: ml.Hybrid3DStrategy(dp=1, pp=2, tp=2, ep=1, zero=1), 0),
}


def model(experts: int) -> LitGPT:
    config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=32, n_layers=2, bias=False,
                            moe=MoEConfig(num_experts=experts) if experts else None)
    return LitGPT(config, lr=1e-2, warmup_steps=2)


class Losses(Callback):
    def __init__(self, kill: bool = False) -> None:
        self.losses: dict[int, float] = {}
        self.kill = kill

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.losses[trainer.global_step] = float(trainer.callback_metrics["train/loss"])
        if self.kill and trainer.global_step == KILL_AFTER:
            os.kill(os.getpid(), signal.SIGKILL)


def train(name: str, directory: Path, *, kill: bool = False, resume: bool = False) -> dict[int, float]:
    world, strategy, experts = STRATEGIES[name]
    pl.seed_everything(0, verbose=False)
    dp = world // {"tp": 2, "pipeline": 2, "3d": 4}.get(name, 1)
    data = AdditionDataModule(3, batch_size=GLOBAL_BATCH // dp, train_size=GLOBAL_BATCH * STEPS_PER_EPOCH)
    losses = Losses(kill)
    checkpoint = DistributedCheckpoint(directory / name, every_n_train_steps=5, keep_last_k=2)
    trainer = ml.Trainer(strategy=strategy(), devices=world, accelerator="cpu", max_steps=MAX_STEPS, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[losses, checkpoint])
    trainer.fit(model(experts), data, ckpt_path="last" if resume else None)
    return losses.losses


def main(mode: str, args: list[str]) -> None:
    if mode == "kill":
        train(args[1], Path(args[0]), kill=True)
        return
    resume = mode == "resume"
    directory, out, names = (Path(args[0]), Path(args[1]), args[2:]) if resume else (None, Path(args[0]), args[1:])
    results = {}
    for name in names:
        results[name] = train(name, directory or out.parent / "full-checkpoints", resume=resume)
    if dist.get_rank() == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
