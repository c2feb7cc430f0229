"""torchrun worker: Lightning's features under pp=2 — validation with a torchmetrics metric, sanity checking,
ModelCheckpoint(monitor="val/loss"), TensorBoard on rank 0 (with TrainingMonitor's pipeline timeline), the progress
bar, predict, validating with a second Trainer, saving and resuming; then a small model whose forward takes a padding
mask by keyword, trained with validation inside a gradient-accumulation window, logging with reduce_fx sum, max, min.
Each rank saves what it saw; the test compares ranks with each other and with one process."""

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler

import meshlight as ml
from meshlight.callbacks import TrainingMonitor
from meshlight.demos import AdditionDataModule
from tests.strategies.parity import SEED, full_weights
from tests.strategies.workers.pipeline_worker import gpt8

BATCH, EPOCHS = 16, 2


class Observer(Callback):
    """Per epoch: the logged validation metrics and the last training loss; sanity batches seen; modules of the
    strategy's model (the stages) that ran forward in the wrong mode (eval while training, train while evaluating)."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, float]] = []
        self.sanity_batches = 0
        self.wrong_modes: set[str] = set()
        self.forwards: dict[bool, int] = {True: 0, False: 0}  # by mode
        self.handles: list[Any] = []

    def setup(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        def check(mod: torch.nn.Module, *_: Any) -> None:
            evaluating = trainer.sanity_checking or trainer.validating or trainer.predicting
            self.forwards[mod.training] += 1
            if mod.training == evaluating:
                self.wrong_modes.add(f"{type(mod).__name__} training={mod.training} in {trainer.state.stage}")

        self.handles = [mod.register_forward_pre_hook(check) for mod in trainer.strategy.model.modules()]

    def teardown(self, trainer: pl.Trainer, module: pl.LightningModule, stage: str) -> None:
        for handle in self.handles:
            handle.remove()

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.sanity_batches += int(trainer.sanity_checking)

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        names = ("train/loss", "val/loss", "val/answer_accuracy")
        self.epochs.append({name: float(trainer.callback_metrics[name]) for name in names})


def data(control: bool, batches: int = 5) -> AdditionDataModule:
    module = AdditionDataModule(3, batch_size=BATCH, train_size=BATCH * batches, val_size=32, seed=SEED)
    if control:  # the permutation Lightning's DistributedSampler draws (one data-parallel replica)
        module.setup()
        sampler = DistributedSampler(module.train_set, num_replicas=1, rank=0, shuffle=True, seed=SEED)
        module.train_dataloader = lambda: DataLoader(module.train_set, batch_size=BATCH, sampler=sampler)
    return module


class CausalMaskedMean(nn.Module):
    """Adds to each position a projection of the mean of the unpadded positions up to it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        keep = (x.new_ones(x.shape[:2]) if padding_mask is None else padding_mask.to(x.dtype)).unsqueeze(-1)
        return x + torch.tanh(self.proj((x * keep).cumsum(1) / keep.cumsum(1).clamp_min(1.0)))


class PaddedNet(nn.Module):
    """Embedding, two blocks reading a padding mask passed by keyword (one per stage at pp=2), head."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(AdditionDataModule.vocab_size, dim)
        self.blocks = nn.ModuleList(CausalMaskedMean(dim) for _ in range(2))
        self.head = nn.Linear(dim, AdditionDataModule.vocab_size)

    def forward(self, tokens: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, padding_mask=padding_mask)
        return self.head(x)


class PaddedLM(pl.LightningModule):
    """Digit 0 plays the padding token. Logs the samples of the batch (reduce_fx sum) and the largest and smallest
    loss of a sample (max, min): under pipelining these combine over microbatches as Lightning combines steps."""

    def __init__(self) -> None:
        super().__init__()
        self.net = PaddedNet()

    def losses(self, batch: Any) -> Tensor:
        inputs, targets = batch
        logits = self.net(inputs, padding_mask=inputs != 0)
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").sum(1) / (targets >= 0).sum(1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        losses = self.losses(batch)
        self.log("window/loss", losses.mean())
        self.log("window/samples", float(len(losses)), reduce_fx="sum")
        self.log("window/max_loss", losses.max(), reduce_fx="max")
        self.log("window/min_loss", losses.min(), reduce_fx="min")
        return losses.mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("window/val_loss", self.losses(batch).mean())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Metrics(Callback):
    """The named callback metrics after every training batch, and the validation loss after each validation."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names, self.batches, self.validations = names, [], []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.batches.append({name: float(trainer.callback_metrics[name]) for name in self.names})

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.validations.append(float(trainer.callback_metrics["window/val_loss"]))


def train_padded(strategy: Any, devices: int) -> dict[str, Any]:
    """PaddedLM for 4 batches with accumulate_grad_batches=2 and a validation after the third: inside a window."""
    control = strategy == "auto"
    pl.seed_everything(SEED, verbose=False)
    module = PaddedLM()
    metrics = Metrics(("window/loss", "window/samples", "window/max_loss", "window/min_loss"))
    ml.Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_epochs=1, accumulate_grad_batches=2,
               val_check_interval=3, limit_val_batches=1, num_sanity_val_steps=0, logger=False, callbacks=[metrics],
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               ).fit(module, data(control, batches=4))
    return {"batches": metrics.batches, "validations": metrics.validations,
            "weights": full_weights(module) if not control else dict(module.state_dict())}


def run(strategy: Callable[[], Any], devices: int, out: Path) -> dict[str, Any]:
    """``strategy``: makes a strategy for each Trainer (``lambda: "auto"`` for the single-process control)."""
    control = strategy() == "auto"
    pl.seed_everything(SEED, verbose=False)
    module, observer = gpt8(), Observer()
    best = ModelCheckpoint(dirpath=out / "best", monitor="val/loss", mode="min", save_top_k=1)
    every = ModelCheckpoint(dirpath=out / "every", every_n_epochs=1, save_top_k=-1)
    trainer = ml.Trainer(strategy=strategy(), devices=devices, accelerator="cpu", max_epochs=EPOCHS,
                         num_sanity_val_steps=2, logger=TensorBoardLogger(out, name="tb"), enable_model_summary=False,
                         callbacks=[observer, best, every, TrainingMonitor(timeline_step=2)], log_every_n_steps=1)
    trainer.fit(module, data(control))
    result = {
        "epochs": observer.epochs, "sanity_batches": observer.sanity_batches,
        "wrong_modes": sorted(observer.wrong_modes), "forwards": observer.forwards,
        "progress_bar": sorted(trainer.progress_bar_metrics), "best": Path(best.best_model_path).name,
        "weights": full_weights(module) if not control else dict(module.state_dict()),
        "predictions": torch.cat(trainer.predict(module, datamodule=data(control))),
    }
    # a second Trainer with the same module reuses its stages
    again = ml.Trainer(strategy=strategy(), devices=devices, accelerator="cpu", logger=False,
                       enable_progress_bar=False, enable_model_summary=False)
    result["validated_again"] = again.validate(module, data(control), verbose=False)[0]
    trainer.save_checkpoint(out / "final.ckpt")
    pl.seed_everything(SEED, verbose=False)
    resumed = gpt8()
    first_epoch = sorted((out / "every").glob("epoch=0-*.ckpt"))[0]
    ml.Trainer(strategy=strategy(), devices=devices, accelerator="cpu", max_epochs=EPOCHS, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0).fit(
        resumed, data(control), ckpt_path=first_epoch)
    result["resumed_weights"] = full_weights(resumed) if not control else dict(resumed.state_dict())
    result["padded"] = train_padded(strategy(), devices)
    return result


if __name__ == "__main__":
    out = Path(sys.argv[1])
    result = run(lambda: ml.PipelineStrategy(pp=2, schedule="1f1b", microbatches=4), 2, out)
    torch.save(result, out / f"rank{dist.get_rank()}.pt")
