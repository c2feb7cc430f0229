"""Lightning's Trainer, resolving meshlight's strategy names, logging to TensorBoard and watching MoE layers by
default."""

from __future__ import annotations

import os
from typing import Any, Union

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from lightning.pytorch.strategies import Strategy

from meshlight.callbacks.expert_load import ExpertLoadMonitor
from meshlight.strategies.registry import resolve_strategy

__all__ = ["Trainer"]


class Trainer(pl.Trainer):
    """``lightning.Trainer`` whose ``strategy`` also accepts ``"ddp"``, ``"zero1"``, ``"zero2"``, ``"zero3"``,
    ``"fsdp"`` (= ``"zero3"``), ``"tp"``, ``"pipeline"`` and ``"moe"`` as meshlight strategies, or any strategy
    instance.

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
