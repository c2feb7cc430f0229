"""Python's garbage collection while training: automatic collections off, a young-generation collection every few
batches instead, as torchtitan does. Automatic collections, triggered by the many small objects of DTensor
dispatch and Lightning's loop, cost several percent of a step (``benchmarks/overhead.py``)."""

from __future__ import annotations

import gc
from typing import Optional

__all__ = ["TrainingGarbageCollection"]


class TrainingGarbageCollection:
    """Collect every ``every_n_steps`` batches while training (None: leave Python's automatic GC as it is)."""

    def __init__(self, every_n_steps: Optional[int]) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"gc_every_n_steps={every_n_steps} must be >= 1, or None for Python's automatic GC.")
        self.every_n_steps = every_n_steps
        self._was_enabled: Optional[bool] = None
        self._batches = 0

    def start(self) -> None:
        """At the start of training: automatic collections off, after one young-generation collection."""
        if self.every_n_steps is not None:
            self._was_enabled, self._batches = gc.isenabled(), 0
            gc.disable()
            gc.collect(1)

    def at_batch(self) -> None:
        if self.every_n_steps is not None:
            self._batches += 1
            if self._batches % self.every_n_steps == 0:
                gc.collect(1)

    def stop(self) -> None:
        """Python's automatic GC as it was before training (also after a failed fit)."""
        if self._was_enabled is not None:
            # The young generations hold what training left; a full collection would traverse every object of
            # torch, Lightning and Dynamo (~0.2-0.45 s per rank and fit here) and find little more.
            gc.collect(1)
            if self._was_enabled:
                gc.enable()
            self._was_enabled = None
