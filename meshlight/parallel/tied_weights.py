"""One weight held by two pipeline stages: a token embedding on the first stage tied to the LM head on the last.

Each of the two ranks holds a copy (its stage's module), as Megatron-LM does with its embedding group: the first
stage's copy is broadcast to the last at setup, and after each step's backward the two copies' gradients are summed
between them, so both take the same optimizer step and stay one weight (a frozen one takes none). The last stage's
copy is left out of the gradient norm, which counts every weight once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from meshlight.parallel.pipeline import PipelineError, rank_holding
from meshlight.parallel.pipeline_stages import TiedParameter

__all__ = ["TiedWeights"]


class TiedWeights:
    """The tied parameters of ``root`` (:func:`~meshlight.parallel.pipeline.tied_parameters`) on this rank, which
    holds ``stages`` of ``num_stages`` over the mesh's ``pp`` axis with ``schedule``'s placement. Built on every
    rank at once (it creates the process groups of the pairs when the pipeline has more than two ranks)."""

    def __init__(self, root: nn.Module, tied: Sequence[TiedParameter], mesh: DeviceMesh, stages: Sequence[int],
                 num_stages: int, schedule: str) -> None:
        self.root = root
        pp = mesh["pp"].size()
        first, last = rank_holding(0, pp, schedule), rank_holding(num_stages - 1, pp, schedule)
        if tied and first == last:
            raise PipelineError(
                f"Schedule {schedule!r} places the first and the last stage on one rank, which cannot hold a tied"
                " embedding and head in two stages: untie them, or use a loop schedule (1f1b, interleaved1f1b).")
        self.names = ([t.first for t in tied] if 0 in stages else
                      [t.last for t in tied] if num_stages - 1 in stages else [])
        self.is_last_copy = num_stages - 1 in stages
        self.group: Optional[dist.ProcessGroup] = None
        self.source = 0
        if tied:
            self.group = _pair_group(mesh, first, last)
            self.source = dist.get_global_rank(mesh["pp"].get_group(), first)

    def broadcast(self) -> None:
        """Give the last stage the first stage's values (a model initialized differently on each rank)."""
        with torch.no_grad():
            for param in self._parameters():
                dist.broadcast(_local(param), src=self.source, group=self.group)

    def reduce_gradients(self) -> None:
        """Sum the two copies' gradients (each the whole gradient of its stage's use, already reduced over data
        parallelism); a copy that got none counts as zero. The stages may split their copies differently (tensor
        parallelism shards a token embedding and an LM head each its own way), so whole gradients are summed. A
        frozen weight (a LoRA fine-tune's) is left without one: a zero gradient would have AdamW decay it."""
        with torch.no_grad():
            for param in self._parameters():
                if not param.requires_grad:
                    continue
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grad = param.grad
                whole = grad.full_tensor() if isinstance(grad, DTensor) else grad
                dist.all_reduce(whole, group=self.group)
                if isinstance(grad, DTensor):
                    grad.to_local().copy_(distribute_tensor(whole, grad.device_mesh, grad.placements).to_local())

    def last_stage_copies(self) -> list[Tensor]:
        """The copies that the first stage's copy already counts (in a gradient norm)."""
        return list(self._parameters()) if self.is_last_copy else []

    def _parameters(self) -> list[nn.Parameter]:
        return [self.root.get_parameter(name) for name in self.names] if self.group is not None else []


def _pair_group(mesh: DeviceMesh, first: int, last: int) -> Optional[dist.ProcessGroup]:
    """The group of this rank's pipeline-group ranks ``first`` and ``last`` (None if it is neither): the pipeline
    group itself when it has two ranks, else one new group per pipeline group, created on every rank."""
    pp_group = mesh["pp"].get_group()
    if mesh["pp"].size() == 2:
        return pp_group
    names = mesh.mesh_dim_names or ()
    lines = mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, mesh["pp"].size())
    pairs = [[int(line[first]), int(line[last])] for line in lines]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
