"""Differentiable collectives over a process group, on c10d's collectives (which every backend has: gloo's functional
collectives fail on CUDA tensors).

Each is the adjoint pair Megatron names f and g: a gather along a dimension whose backward reduce-scatters, a
reduce-scatter whose backward gathers, an all-reduce in forward (identity in backward) and an all-reduce in backward
(identity in forward). And a pair for a module every rank computes whole: a gather whose backward takes this rank's
slice of a gradient each rank holds whole, and a slice whose backward gathers.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather_along", "gather_whole_along", "reduce_scatter_along", "slice_along", "sum_in_backward",
           "sum_in_forward"]


def all_gather_along(tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """Every rank's ``tensor`` concatenated along ``dim`` in rank order; backward reduce-scatters the gradient."""
    return _Along.apply(tensor, dim, group, _GATHER)


def gather_whole_along(tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """Every rank's ``tensor`` concatenated along ``dim`` in rank order, for a computation every rank runs whole (its
    gradient the same on each: :func:`slice_along`'s backward gathers it); backward takes this rank's slice of it."""
    return _Along.apply(tensor, dim, group, _GATHER_WHOLE)


def slice_along(tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """This rank's slice along ``dim`` of ``tensor``, which every rank holds whole; backward all-gathers the
    gradient, so that every rank's backward of ``tensor`` is the whole one."""
    return _Along.apply(tensor, dim, group, _SLICE)


def reduce_scatter_along(tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """This rank's slice along ``dim`` of the sum of every rank's ``tensor``; backward all-gathers the gradient."""
    return _Along.apply(tensor, dim, group, _REDUCE_SCATTER)


def sum_in_forward(tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The sum of every rank's ``tensor`` (partial sums made whole); the gradient passes back unchanged."""
    return _SumInForward.apply(tensor, group)


def sum_in_backward(tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``tensor`` unchanged; in backward the gradients of every rank are summed (each rank's use was partial)."""
    return _SumInBackward.apply(tensor, group)


def _gather(tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    local = tensor.movedim(dim, 0).contiguous()
    out = local.new_empty((dist.get_world_size(group) * local.shape[0], *local.shape[1:]))
    dist.all_gather_into_tensor(out, local, group=group)
    return out.movedim(0, dim)


def _scatter(tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    whole = tensor.movedim(dim, 0).contiguous()
    size = dist.get_world_size(group)
    if whole.shape[0] % size:
        raise ValueError(f"dimension {dim} of a {tuple(tensor.shape)} tensor does not split over {size} ranks")
    out = whole.new_empty((whole.shape[0] // size, *whole.shape[1:]))
    dist.reduce_scatter_tensor(out, whole, group=group)
    return out.movedim(0, dim)


def _summed(tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
    out = tensor.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _slice(tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    size = dist.get_world_size(group)
    if tensor.shape[dim] % size:
        raise ValueError(f"dimension {dim} of a {tuple(tensor.shape)} tensor does not split over {size} ranks")
    length = tensor.shape[dim] // size
    return tensor.narrow(dim, dist.get_rank(group) * length, length)


def _sliced(tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    return _slice(tensor, dim, group).clone(memory_format=torch.contiguous_format)  # (not a view of the input)


#: the collective along a dimension each function runs in forward, and the one its backward runs
_GATHER, _REDUCE_SCATTER = (_gather, _scatter), (_scatter, _gather)
_GATHER_WHOLE, _SLICE = (_gather, _slice), (_sliced, _gather)


class _Along(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, dim: int, group: dist.ProcessGroup, ops: tuple) -> Tensor:
        ctx.dim, ctx.group, ctx.backward_op = dim, group, ops[1]
        return ops[0](tensor, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        return ctx.backward_op(grad, ctx.dim, ctx.group), None, None, None


class _SumInForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
        return _summed(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _SumInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _summed(grad, ctx.group), None
