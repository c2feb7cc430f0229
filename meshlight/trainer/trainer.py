"""Lightning's Trainer, resolving meshlight's strategy names and logging to TensorBoard by default."""

from __future__ import annotations

import os
from typing import Any, Union

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from lightning.pytorch.strategies import Strategy

from meshlight.strategies.registry import resolve_strategy

__all__ = ["Trainer"]


class Trainer(pl.Trainer):
    """``lightning.Trainer`` whose ``strategy`` also accepts ``"ddp"``, ``"zero1"``, ``"zero2"``, ``"zero3"``,
    ``"fsdp"`` (= ``"zero3"``) and ``"tp"`` as meshlight strategies, or any strategy instance.

    ``logger=True`` (the default) logs to TensorBoard under ``default_root_dir/lightning_logs``.
    Every other argument is Lightning's.
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
        super().__init__(strategy=resolve_strategy(strategy), logger=logger, **kwargs)
