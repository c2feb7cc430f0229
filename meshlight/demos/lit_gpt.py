"""LitGPT: an ordinary LightningModule around :class:`~meshlight.models.GPT` — nothing meshlight-specific.

Used by ``examples/train_gpt.py``, the tests and the benchmarks. It logs the training loss, the validation
loss and the exact-match accuracy of the scored positions (the answer of the addition task), and trains
with AdamW (or SGD / Adafactor) in two parameter groups under a warmup + cosine learning-rate schedule.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor
from torchmetrics.classification import MulticlassExactMatch

from meshlight.demos.data import IGNORE_INDEX
from meshlight.models import GPT, GPTConfig

__all__ = ["LitGPT"]

Batch = tuple[Tensor, Tensor]


class LitGPT(pl.LightningModule):
    """Next-token training of a GPT on ``(inputs, targets)`` batches.

    Args:
        config: the model; default :meth:`GPTConfig.tiny`.
        optimizer: ``"adamw"``, ``"sgd"`` (momentum 0.9) or ``"adafactor"``.
        lr, weight_decay: peak learning rate, and decay applied to matrices only (not to biases or norms).
        warmup_steps: linear warmup, then cosine decay to ``min_lr_ratio·lr`` at the last training step.
        foreach: the optimizer's multi-tensor kernels (None: torch's default — on CUDA, yes).
    """

    def __init__(
        self,
        config: Optional[GPTConfig] = None,
        *,
        optimizer: Literal["adamw", "sgd", "adafactor"] = "adamw",
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        foreach: Optional[bool] = None,
    ) -> None:
        super().__init__()
        self.config = config or GPTConfig.tiny()
        self.save_hyperparameters({
            "model": dataclasses.asdict(self.config), "optimizer": optimizer, "lr": lr,
            "weight_decay": weight_decay, "warmup_steps": warmup_steps, "min_lr_ratio": min_lr_ratio,
            "foreach": foreach,
        })
        self.model = GPT(self.config)
        self.val_accuracy = MulticlassExactMatch(num_classes=self.config.vocab_size, ignore_index=IGNORE_INDEX)
        self.test_accuracy = MulticlassExactMatch(num_classes=self.config.vocab_size, ignore_index=IGNORE_INDEX)

    def forward(self, inputs: Tensor) -> Tensor:
        return self.model(inputs)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = self.model.loss(self(inputs), targets)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_accuracy)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_accuracy)

    def predict_step(self, batch: Batch, batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(-1)

    def _evaluate(self, batch: Batch, split: str, accuracy: MulticlassExactMatch) -> None:
        inputs, targets = batch
        logits = self(inputs)
        accuracy(logits.argmax(-1), targets)
        self.log(f"{split}/loss", self.model.loss(logits, targets), prog_bar=True, sync_dist=True)
        self.log(f"{split}/answer_accuracy", accuracy, prog_bar=True)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        matrices = [p for p in self.parameters() if p.dim() >= 2]
        vectors = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": hp.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
        if hp.optimizer == "adamw":
            optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=(0.9, 0.95), foreach=hp.get("foreach"))
        elif hp.optimizer == "sgd":
            optimizer = torch.optim.SGD(groups, lr=hp.lr, momentum=0.9, foreach=hp.get("foreach"))
        elif hp.optimizer == "adafactor":
            optimizer = torch.optim.Adafactor(groups, lr=hp.lr)
        else:
            raise ValueError(f"optimizer={hp.optimizer!r}; choose 'adamw', 'sgd' or 'adafactor'.")
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        schedule = _warmup_cosine(hp.warmup_steps, total, hp.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _warmup_cosine(warmup: int, total: int, floor: float):  # noqa: ANN202 - a LambdaLR schedule
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
