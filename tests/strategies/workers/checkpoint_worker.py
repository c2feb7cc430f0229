"""torchrun worker for checkpoint portability and failure modes.

    save DIR      train 2 epochs under ZeRO-3, checkpoint every epoch; rank 0 writes weights and losses
    load DIR      load the first epoch's checkpoint under DDP, then resume from it; rank 0 writes the same
    layouts DIR   load it under tensor parallelism (tp=2) and save it again from there; then resume training
                  from it under pipeline parallelism (pp=2); rank 0 writes the weights tp=2 loaded, and the
                  pipeline's losses and final weights
    mismatch DIR  load that checkpoint into a model with other parameter names: must fail on every rank
    badlayout     a layout that does not fit the world: must fail on every rank before any collective
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import meshlight as ml
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig
from tests.strategies.parity import full_weights

GLOBAL_BATCH = 16
STEPS_PER_EPOCH = 5


def model(n_layers: int = 2) -> LitGPT:
    config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=32, n_layers=n_layers,
                            bias=False)
    return LitGPT(config, lr=1e-2, warmup_steps=2)


def data(world: int) -> AdditionDataModule:
    return AdditionDataModule(3, batch_size=GLOBAL_BATCH // world, train_size=GLOBAL_BATCH * STEPS_PER_EPOCH,
                              val_size=32)


class Record(Callback):
    """Losses of the second epoch, and the full weights at the end of the first (when it is checkpointed)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.first_epoch_weights: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.current_epoch == 1:
            self.losses.append(float(trainer.callback_metrics["train/loss"]))

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.current_epoch == 0:
            self.first_epoch_weights = full_weights(module)


def trainer(strategy: object, world: int, **kwargs: object) -> ml.Trainer:
    return ml.Trainer(strategy=strategy, devices=world, accelerator="cpu", max_epochs=2, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, **kwargs)


def main(mode: str, out: Path) -> None:
    world = int(__import__("os").environ["WORLD_SIZE"])
    pl.seed_everything(0, verbose=False)
    if mode == "badlayout":
        ml.Trainer(strategy=ml.MeshStrategy(dp_replicate=3), devices=world, accelerator="cpu")
        return
    record = Record()
    if mode == "save":
        module = model()
        every_epoch = ModelCheckpoint(dirpath=out / "ckpt", every_n_epochs=1, save_top_k=-1)
        trainer("zero3", world, callbacks=[every_epoch, record]).fit(module, data(world))
    elif mode == "layouts":
        module = model()
        first_epoch = sorted((out / "ckpt").glob("epoch=0-*.ckpt"))[0]
        tensor_parallel = trainer(ml.TensorParallelStrategy(tp=world), world, enable_checkpointing=False)
        tensor_parallel.validate(module, data(1), ckpt_path=first_epoch, verbose=False)
        tensor_parallel.save_checkpoint(out / "from_tp.ckpt")
        loaded = full_weights(module)
        if dist.get_rank() == 0:
            torch.save(loaded, out / "tp_weights.pt")
        module = model()  # every rank reads the whole batch: the second epoch sees what ZeRO-3's did
        pipelined = trainer(ml.PipelineStrategy(pp=world, microbatches=4), world, callbacks=[record],
                            enable_checkpointing=False)
        pipelined.fit(module, data(1), ckpt_path=first_epoch)
    else:
        module = model(n_layers=3 if mode == "mismatch" else 2)
        first_epoch = sorted((out / "ckpt").glob("epoch=0-*.ckpt"))[0]
        fit = trainer("ddp", world, callbacks=[record], enable_checkpointing=False)
        fit.validate(module, data(world), ckpt_path=first_epoch, verbose=False)
        loaded = full_weights(module)
        if dist.get_rank() == 0:
            torch.save(loaded, out / "loaded_weights.pt")
        module = model()
        fit.fit(module, data(world), ckpt_path=first_epoch)
    weights = full_weights(module)
    if dist.get_rank() == 0:
        torch.save({"weights": weights, "losses": record.losses, "first_epoch_weights": record.first_epoch_weights},
                   out / f"{mode}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else Path("."))
