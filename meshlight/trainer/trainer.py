"""Lightning's Trainer, resolving meshlight's strategy names, logging to TensorBoard and watching MoE layers by
default."""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from meshlight.callbacks.checkpoint import DistributedCheckpoint
from meshlight.callbacks.expert_load import ExpertLoadMonitor
from meshlight.callbacks.mixed_precision import MixedPrecision
from meshlight.callbacks.offload import Offload
from meshlight.parallel.checkpoint import load_metadata, numbered_entries
from meshlight.strategies.checkpointing import ShardedCheckpointing
from meshlight.strategies.preemption import HPC_CHECKPOINT, newest_hpc_checkpoint
from meshlight.strategies.registry import resolve_strategy

__all__ = ["Trainer"]


def _runs_through_meshlight(callback: pl.Callback) -> bool:
    """Whether ``callback`` needs one of meshlight's strategies (which collect or serve it while parallelizing)."""
    if isinstance(callback, Offload):
        return callback.policy.optimizer
    return isinstance(callback, (DistributedCheckpoint, MixedPrecision))


class Trainer(pl.Trainer):
    """``lightning.Trainer`` whose ``strategy`` also accepts ``"ddp"``, ``"zero1"``, ``"zero2"``, ``"zero3"``,
    ``"fsdp"`` (= ``"zero3"``), ``"tp"``, ``"pipeline"``, ``"moe"``, ``"cp"`` and ``"3d"`` as meshlight strategies,
    or any strategy instance. ``strategy="auto"`` with a callback that runs through meshlight's strategies
    (:class:`~meshlight.callbacks.DistributedCheckpoint`, :class:`~meshlight.callbacks.MixedPrecision`,
    :class:`~meshlight.callbacks.Offload` of the optimizer) is meshlight's ``"ddp"``: on one device a mesh of one
    process, so that a run developed on one device writes the same checkpoints as the runs that scale it out.

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
        if strategy == "auto" and any(_runs_through_meshlight(c) for c in callbacks):
            strategy = "ddp"
        super().__init__(strategy=resolve_strategy(strategy), logger=logger, **kwargs)

    def fit(self, *args: Any, ckpt_path: Optional[str] = None, **kwargs: Any) -> None:
        """Lightning's ``fit``, resuming from the newest of meshlight's checkpoints, by their step:

        - ``ckpt_path="last"`` with :class:`~meshlight.callbacks.DistributedCheckpoint` callbacks: the newest
          complete checkpoint of theirs, or the ``hpc_ckpt_<n>.ckpt`` SLURM's requeue signal left in
          ``default_root_dir`` where that is newer; a fresh start when there is none.
        - No ``ckpt_path`` in a SLURM job that left an ``hpc_ckpt_*``: Lightning resumes from it; meshlight from
          the callbacks' newest where that is newer — a job requeued after a crash or a node failure, not by the
          signal, would otherwise go back to the step of the last signal.
        """
        requeued = (ckpt_path is None and SLURMEnvironment.detect()
                    and bool(numbered_entries(str(self.default_root_dir), HPC_CHECKPOINT)))
        if requeued or ckpt_path == "last" and any(isinstance(c, DistributedCheckpoint) for c in self.callbacks):
            found = self.complete_checkpoints()
            newest = found[0] if found else None
            if newest is not None:
                ckpt_path = newest[1]
                rank_zero_info(f"Resuming from {ckpt_path} (step {newest[0]}), the newest checkpoint.")
                if isinstance(self.strategy, ShardedCheckpointing):  # where it is damaged, the next newest
                    self.strategy.fallback_checkpoints = [path for _, path in found[1:]]
            elif ckpt_path == "last":
                ckpt_path = None
                rank_zero_info('ckpt_path="last": no complete checkpoint yet, starting from scratch.')
            # else a requeued job whose only hpc_ckpt_* is interrupted: Lightning picks it, and loading says so
        if isinstance(self.strategy, ShardedCheckpointing):
            self.strategy.resume_weights_only = kwargs.get("weights_only")
        super().fit(*args, ckpt_path=ckpt_path, **kwargs)

    def newest_checkpoint(self) -> Optional[tuple[int, str]]:
        """``(step, path)`` of the newest complete checkpoint of the :class:`~meshlight.callbacks.DistributedCheckpoint`
        callbacks and of the whole ``hpc_ckpt_*`` in ``default_root_dir`` (None when there is none); at equal
        steps, a callback's."""
        found = self.complete_checkpoints()
        return found[0] if found else None

    def complete_checkpoints(self) -> list[tuple[int, str]]:
        """``(step, path)`` of every complete checkpoint of the :class:`~meshlight.callbacks.DistributedCheckpoint`
        callbacks and of the newest whole ``hpc_ckpt_*`` in ``default_root_dir``, newest first (at equal steps, a
        callback's first)."""
        found = [(step, c.path_of(step)) for c in self.callbacks if isinstance(c, DistributedCheckpoint)
                 for step in c.complete_steps()]
        hpc = newest_hpc_checkpoint(str(self.default_root_dir))
        if hpc is not None:
            found.append((int(load_metadata(hpc)["global_step"]), hpc))
        return sorted(found, key=lambda step_path: -step_path[0])
