"""Lightning features under each strategy, with a LightningModule that is not meshlight's GPT.

Shared by the distributed worker and the single-process control in ``test_lightning_compat.py``: the
same scenarios run in both and every logged value, prediction and weight is compared.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

import meshlight as ml
from tests.strategies.parity import full_weights

SEED = 0
GLOBAL_BATCH = 16
EPOCHS = 2


class Classifier(pl.LightningModule):
    """An MLP classifier with residual blocks in a ModuleList, a torchmetrics accuracy and a StepLR."""

    def __init__(self, manual_optimization: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = not manual_optimization
        self.embed = nn.Linear(8, 32)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(32, 4)
        self.val_accuracy = MulticlassAccuracy(num_classes=4, average="micro")
        self.test_accuracy = MulticlassAccuracy(num_classes=4, average="micro")
        self.sanity_batches = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, sync_dist=True, prog_bar=True, on_epoch=True)
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            optimizer.step()
            if self.trainer.is_last_batch:
                self.lr_schedulers().step()
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.sanity_batches += int(self.trainer.sanity_checking)
        self._evaluate(batch, "val", self.val_accuracy)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_accuracy)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def _evaluate(self, batch: Any, split: str, accuracy: MulticlassAccuracy) -> None:
        x, y = batch
        logits = self(x)
        self.log(f"{split}/loss", F.cross_entropy(logits, y), sync_dist=True)
        accuracy(logits, y)
        self.log(f"{split}/accuracy", accuracy)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


def dataset(size: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(8, 4, generator=torch.Generator().manual_seed(123))
    x = torch.randn(size, 8, generator=generator)
    return TensorDataset(x, (x @ weight).argmax(-1))


class ClassificationData(pl.LightningDataModule):
    """128 training, 64 validation and 64 test samples; ``batch_size`` per data-parallel rank."""

    def __init__(self, batch_size: int, control: bool = False) -> None:
        super().__init__()
        self.batch_size, self.control = batch_size, control
        self.train, self.val, self.test = dataset(128, 1), dataset(64, 2), dataset(64, 3)

    def train_dataloader(self) -> DataLoader:
        if self.control:  # read the permutation Lightning's DistributedSampler uses under any world size
            sampler = DistributedSampler(self.train, num_replicas=1, rank=0, shuffle=True, seed=SEED)
            return DataLoader(self.train, batch_size=self.batch_size, sampler=sampler)
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test, batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.test, batch_size=self.batch_size)


class EpochRecorder(Callback):
    def __init__(self) -> None:
        self.epochs: list[dict[str, float]] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        names = ("train/loss_epoch", "val/loss", "val/accuracy")
        self.epochs.append({name: float(trainer.callback_metrics[name]) for name in names})


def run_scenarios(strategy: Any, devices: int, workdir: Path) -> dict[str, Any]:
    """Fit (with sanity check, progress bar, two ModelCheckpoints), test, predict, resume, manual optimization."""
    world = devices
    control = strategy == "auto"
    batch = GLOBAL_BATCH // world
    # The progress bar is rendered on rank 0; TensorBoard off only to keep the test quiet and fast.
    common = dict(strategy=strategy, devices=devices, accelerator="cpu", logger=False, enable_model_summary=False)
    out: dict[str, Any] = {}

    pl.seed_everything(SEED, verbose=False)
    model, recorder = Classifier(), EpochRecorder()
    best = ModelCheckpoint(dirpath=workdir / "best", monitor="val/loss", mode="min", save_top_k=1)
    every = ModelCheckpoint(dirpath=workdir / "every", every_n_epochs=1, save_top_k=-1)
    trainer = ml.Trainer(max_epochs=EPOCHS, callbacks=[recorder, best, every], num_sanity_val_steps=2, **common)
    trainer.fit(model, ClassificationData(batch, control))
    out["epochs"] = recorder.epochs
    out["sanity_batches"] = model.sanity_batches
    out["progress_bar_keys"] = sorted(trainer.progress_bar_metrics)
    out["best"] = {"path": best.best_model_path, "score": float(best.best_model_score)}
    out["weights"] = _weights(model, world)
    out["test"] = trainer.test(model, ClassificationData(batch, control), verbose=False)[0]
    out["predictions"] = torch.cat(trainer.predict(model, ClassificationData(batch, control)))

    pl.seed_everything(SEED, verbose=False)
    resumed = Classifier()
    first_epoch = sorted((workdir / "every").glob("epoch=0-*.ckpt"))[0]
    ml.Trainer(max_epochs=EPOCHS, num_sanity_val_steps=0, enable_checkpointing=False, **common).fit(
        resumed, ClassificationData(batch, control), ckpt_path=first_epoch
    )
    out["resumed_weights"] = _weights(resumed, world)

    pl.seed_everything(SEED, verbose=False)
    manual = Classifier(manual_optimization=True)
    ml.Trainer(max_epochs=EPOCHS, enable_checkpointing=False, **common).fit(manual, ClassificationData(batch, control))
    out["manual_weights"] = _weights(manual, world)
    return out


def _weights(module: torch.nn.Module, world: int) -> dict[str, torch.Tensor]:
    return full_weights(module) if world > 1 else {k: v.detach().clone() for k, v in module.state_dict().items()}
