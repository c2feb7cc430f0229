"""Start training from published weights: a Hugging Face ``save_pretrained`` folder (or litgpt's ``lit_model.pth``)
loaded into the model in whatever layout the strategy gave it (see :mod:`meshlight.parallel.pretrained`)."""

from __future__ import annotations

from pathlib import Path
from typing import Union

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from meshlight.parallel.pretrained import LoadReport, load_pretrained

__all__ = ["PretrainedWeights"]


class PretrainedWeights(pl.Callback):
    """Load the weights at ``path`` — a ``save_pretrained`` folder's safetensors files, or ``torch.save``'d state
    dicts (litgpt's ``lit_model.pth``, Hugging Face's older ``pytorch_model*.bin``; the file itself, or its folder;
    read as tensors only) — into the LightningModule's names under ``prefix``
    (``"model."``: its ``self.model``) once the strategy has placed and split the model, before the first step of
    ``fit`` and its sanity check (or the first batch of ``validate``, ``test``, ``predict``). Each rank reads only the
    part of each tensor it holds; a model built on the meta device in ``configure_model`` is allocated shard by shard
    and filled from the files.

    A run given a checkpoint (``fit(ckpt_path=…)``) loads that instead: the checkpoint's weights take precedence and
    the files are not read. ``strict=False`` loads the keys that match and reports the rest
    (:attr:`report`); shapes that differ are refused either way."""

    def __init__(self, path: Union[str, Path], prefix: str = "model.", strict: bool = True) -> None:
        self.path, self.prefix, self.strict = Path(path), prefix, strict
        self.report: LoadReport | None = None
        self._started = False

    # after the strategy restored a checkpoint given to the Trainer (which sets ``trainer.ckpt_path``)
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer, pl_module)

    on_train_start = on_validation_start = on_test_start = on_predict_start = on_sanity_check_start

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._started:
            return
        self._started = True
        if trainer.ckpt_path is not None:
            rank_zero_info(f"PretrainedWeights: {trainer.ckpt_path} was loaded, whose weights take precedence;"
                           f" {self.path} is not read.")
            return
        self._load(pl_module)

    def _load(self, pl_module: pl.LightningModule) -> None:
        if self.report is None:
            self.report = load_pretrained(pl_module, self.path, prefix=self.prefix, strict=self.strict)
            rank_zero_info(f"PretrainedWeights: loaded {len(self.report.loaded)} tensors from {self.path}"
                           + (f"; the files lack {len(self.report.missing)}" if self.report.missing else "")
                           + (f"; {len(self.report.unexpected)} keys unused" if self.report.unexpected else "")
                           + "".join(f"; {stored} weights cast to {held}" for stored, held in sorted(self.report.cast))
                           + ".")
