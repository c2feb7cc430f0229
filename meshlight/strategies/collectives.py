"""The collectives and data hooks of :class:`~meshlight.strategies.MeshStrategy`: Lightning's reductions over the
data-parallel replicas (not every rank), decisions over the world, and loaders sharded by data-parallel rank that
resume mid-epoch."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from meshlight.parallel.layout import axis
from meshlight.parallel.sampling import ResumableSampler
from meshlight.strategies import lightning_internals as lightning
from meshlight.strategies.process_group import all_reduce_in_place

__all__ = ["DataParallelCollectives"]


class DataParallelCollectives(ParallelStrategy):
    """Reductions, decisions and data loading for a strategy whose ``device_mesh`` has data-parallel axes."""

    _device_mesh: Optional[DeviceMesh] = None
    device_mesh: DeviceMesh

    @property
    def is_distributed(self) -> bool:
        return True  # read by Lightning's connector: makes Lightning insert a DistributedSampler

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Data is split by data-parallel rank: all ranks of one tensor/pipeline group read the same batch.
        dp_mesh = axis(self.device_mesh, "dp")
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Union[Tensor, Any]:
        """Reduce over the data-parallel replicas by default, in place like Lightning's (see
        :func:`~meshlight.strategies.process_group.all_reduce_in_place`). This is what ``self.log(...,
        sync_dist=True)`` asks for: the ranks of one tensor/pipeline group hold one replica's values, so a
        ``reduce_fx="sum"`` over every rank would count each of them tp·pp times."""
        if group is None and self._device_mesh is not None:
            group = axis(self._device_mesh, "dp").get_group()
        return all_reduce_in_place(tensor, group, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Every rank's own decision (to stop, to save), combined over the whole world."""
        votes = all_reduce_in_place(torch.tensor(int(decision), device=self.root_device), lightning.world_group(),
                                    "sum")
        return bool(votes == self.world_size) if all else bool(votes)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Training loaders resume mid-epoch exactly: their sampler skips what the interrupted epoch consumed."""
        trainer = lightning.attached_trainer(self.lightning_module) if self.lightning_module is not None else None
        sampler = getattr(dataloader, "sampler", None)
        if (trainer is None or not trainer.training or not isinstance(dataloader, DataLoader)
                or not isinstance(sampler, DistributedSampler) or dataloader.batch_size is None):
            return dataloader
        return lightning.with_sampler(dataloader, ResumableSampler(sampler, dataloader.batch_size,
                                                                   lightning.processed_batches(trainer)))
