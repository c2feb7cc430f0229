"""Pipeline parallelism inside Lightning's stock loop ("pipeline"), data parallel over the rest."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from meshlight.parallel.layout import data_sizes
from meshlight.parallel.pipeline import SplitSpec, default_virtual_stages
from meshlight.strategies.mesh import MeshStrategy

__all__ = ["PipelineStrategy"]


class PipelineStrategy(MeshStrategy):
    """Split the model's blocks into ``pp × virtual_stages`` stages run by a ``torch.distributed.pipelining``
    schedule; the LightningModule's ``training_step``, ``self.log`` and callbacks work as without pipelining.

    Args:
        pp: pipeline stages (ranks); ``"auto"``: every process. ``PipelineStrategy(pp=2)`` on 4 processes is
            pp=2 × dp=2.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved1f1b"``, ``"loopedbfs"``, ``"interleavedzerobubble"``,
            ``"zbvzerobubble"`` or ``"dualpipev"``.
        microbatches: slices of each batch in flight; default one per stage. More shrinks the bubble.
        virtual_stages: stages per rank (loop placement; the V schedules put 2 per rank). Default: 1 for
            gpipe and 1f1b, 2 otherwise.
        split: ``"parameters"`` (default: balance parameter counts), ``"layers"`` (balance block counts), or
            the names of the blocks where stages 2, 3, … begin, e.g. ``["model.blocks.4"]``.
        zero: ZeRO stage over the data-parallel ranks (0 = DDP). The schedule reduces gradients once per
            step, after the last microbatch.
        **kwargs: passed to :class:`MeshStrategy`.
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        pp: Union[int, Literal["auto"]] = "auto",
        *,
        schedule: str = "1f1b",
        microbatches: Optional[int] = None,
        virtual_stages: Optional[int] = None,
        split: SplitSpec = None,
        zero: int = 1,
        **kwargs: Any,
    ) -> None:
        sizes = data_sizes("auto", zero)  # by name: LightningCLI reads the keywords a subclass passes on
        virtual_stages = virtual_stages or default_virtual_stages(schedule)
        super().__init__(dp_replicate=sizes["dp_replicate"], dp_shard=sizes["dp_shard"],
                         pp=1 if pp == "auto" else pp, zero=zero, schedule=schedule,
                         microbatches=microbatches, virtual_stages=virtual_stages, split=split, **kwargs)
        self._auto_pp = pp == "auto"

    def set_world_ranks(self) -> None:
        if self._auto_pp:
            self._sizes["pp"] = self.num_nodes * self.num_processes
        super().set_world_ranks()
