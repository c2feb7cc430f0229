"""Context parallelism ("cp"): every sequence split over the ranks of the mesh's cp axis (see
:mod:`meshlight.parallel.context`); :class:`~meshlight.strategies.step_engines.ContextParallelSteps` runs the steps on
those shares under any layout with ``cp > 1``."""

from __future__ import annotations

from typing import Any

from meshlight.parallel.layout import data_sizes
from meshlight.strategies.mesh import MeshStrategy

__all__ = ["ContextParallelStrategy"]


class ContextParallelStrategy(MeshStrategy):
    """Split every sequence over ``cp`` ranks (attention by K/V exchange), data parallel with ZeRO over the rest.

    Args:
        cp: context-parallel size; ``"auto"``: every process (``strategy="cp"``).
        zero: ZeRO stage over the data-parallel × cp ranks (0 = DDP).
        attention: ``"allgather"`` (K/V all-gathered over the cp ranks; any device) or ``"ring"`` (torch's ring
            attention; CUDA only).
        **kwargs: passed to :class:`MeshStrategy` (``tp=``, ``pp=``, …).

    ``ContextParallelStrategy(cp=2)`` on 4 processes is dp=2 × cp=2. Sequences must be a multiple of ``2·cp``
    tokens long.
    """

    strategy_name = "cp"

    def __init__(self, cp: Any = "auto", *, zero: int = 1, attention: str = "allgather", **kwargs: Any) -> None:
        sizes = data_sizes("auto", zero)  # by name: LightningCLI reads the keywords a subclass passes on
        super().__init__(dp_replicate=sizes["dp_replicate"], dp_shard=sizes["dp_shard"],
                         cp=1 if cp == "auto" else cp, zero=zero,
                         cp_attention=attention, **kwargs)
        self._auto_cp = cp == "auto"

    def set_world_ranks(self) -> None:
        if self._auto_cp:
            self._sizes["cp"] = self.num_nodes * self.num_processes
        super().set_world_ranks()
