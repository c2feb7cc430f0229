"""Differentiable collectives over a process group, on c10d's collectives (which every backend has: gloo's functional
collectives fail on CUDA tensors).

Each is the adjoint pair Megatron names f and g: a gather along a dimension whose backward reduce-scatters, a
reduce-scatter whose backward gathers, an all-reduce in forward (identity in backward) and an all-reduce in backward
(identity in forward).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather_along", "reduce_scatter_along", "sum_in_backward", "sum_in_forward"]


def all_gather_along(tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """Every rank's ``tensor`` concatenated along ``dim`` in rank order; backward reduce-scatters the gradient."""
    return _AllGather.apply(tensor, dim, group)


def reduce_scatter_along(tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """This rank's slice along ``dim`` of the sum of every rank's ``tensor``; backward all-gathers the gradient."""
    return _ReduceScatter.apply(tensor, dim, group)


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


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather(tensor, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _scatter(tensor, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None


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
