"""Lightning's Trainer, resolving meshlight's strategy names, logging to TensorBoard and watching MoE layers by
default."""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from meshlight.callbacks.checkpoint import DistributedCheckpoint, resolve_last
from meshlight.callbacks.expert_load import ExpertLoadMonitor
from meshlight.strategies.registry import resolve_strategy

__all__ = ["Trainer"]


class Trainer(pl.Trainer):
    """``lightning.Trainer`` whose ``strategy`` also accepts ``"ddp"``, ``"zero1"``, ``"zero2"``, ``"zero3"``,
    ``"fsdp"`` (= ``"zero3"``), ``"tp"``, ``"pipeline"``, ``"moe"`` and ``"3d"`` as meshlight strategies, or any
    strategy instance.

    ``logger=True`` (the default) logs to TensorBoard under ``default_root_dir/lightning_logs``. An
    :class:`~meshlight.callbacks.ExpertLoadMonitor` is added unless ``callbacks`` has one (it does nothing for
    models without :class:`~meshlight.nn.MoE` layers). Every other argument is Lightning's.
    """

    def __init__(
        self,
        *,
        strategy: Union[str, Strategy] = "auto",
        logger: Union[Logger, list[Logger], bool, None] = True,
        **kwargs: Any,
    ) -> None:
        if logger is True or logger is None:
            logger = TensorBoardLogger(save_dir=kwargs.get("default_root_dir") or os.getcwd())
        callbacks = kwargs.pop("callbacks", None) or []
        callbacks = [callbacks] if not isinstance(callbacks, list) else list(callbacks)
        if not any(isinstance(c, ExpertLoadMonitor) for c in callbacks):
            callbacks.append(ExpertLoadMonitor())
        kwargs["callbacks"] = callbacks
        super().__init__(strategy=resolve_strategy(strategy), logger=logger, **kwargs)

    def fit(self, *args: Any, ckpt_path: Optional[str] = None, **kwargs: Any) -> None:
        """Lightning's ``fit``; ``ckpt_path="last"`` with :class:`~meshlight.callbacks.DistributedCheckpoint`
        callbacks resumes from their newest complete checkpoint (a fresh start when there is none yet)."""
        if ckpt_path == "last" and any(isinstance(c, DistributedCheckpoint) for c in self.callbacks):
            ckpt_path = resolve_last(self)
            rank_zero_info(f"Resuming from {ckpt_path}" if ckpt_path else
                           'ckpt_path="last": no complete checkpoint yet, starting from scratch.')
        super().fit(*args, ckpt_path=ckpt_path, **kwargs)
