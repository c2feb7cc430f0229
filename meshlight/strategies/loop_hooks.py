"""The training loop's housekeeping for :class:`~meshlight.strategies.MeshStrategy`: preemption signals acted on by
every rank at the same step (:mod:`.preemption`), and Python's garbage collection at step boundaries
(:mod:`.garbage_collection`)."""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ParallelStrategy
from typing_extensions import override

from meshlight.strategies.garbage_collection import TrainingGarbageCollection
from meshlight.strategies.preemption import AgreedSignals

__all__ = ["TrainingLoopHooks"]


class TrainingLoopHooks(ParallelStrategy):
    """SIGTERM and SLURM's requeue signal agreed on by every rank, and garbage collected every few steps."""

    _signals: Optional[AgreedSignals] = None
    _gc: TrainingGarbageCollection = TrainingGarbageCollection(None)

    def collect_garbage_every(self, steps: Optional[int]) -> None:
        """While training, a young-generation collection every ``steps`` batches instead of Python's automatic
        one (None: keep Python's)."""
        self._gc = TrainingGarbageCollection(steps)

    def stop_collecting_garbage(self) -> None:
        self._gc.stop()

    def install_signals(self, trainer: Trainer) -> None:
        self._signals = AgreedSignals.install(trainer)

    def agree_on_signals_in_evaluation(self) -> None:
        if self._signals is not None:
            self._signals.at_evaluation_step(self)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._gc.start()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._signals is not None:
            self._signals.at_train_batch_start(self)
        self._gc.at_batch()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._gc.stop()
