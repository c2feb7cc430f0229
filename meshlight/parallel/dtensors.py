"""What the mechanisms ask of a tensor or module that tensor, expert or data parallelism may have split into
DTensors: this rank's part of a tensor, and whether a module is split already (in ``configure_model``, or by an
earlier transform). Imports nothing of meshlight's, so that every mechanism can use it."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = [
    "DTensorSpec", "as_dtensor_like", "dtensor_spec", "from_blocks", "has_dtensor_parameters", "in_blocks",
    "local_tensor", "modifiable_local", "shallow_copy",
]

#: what makes a local tensor a DTensor again: mesh, placements, global shape and stride
DTensorSpec = tuple[Any, Any, Any, tuple[int, ...]]


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor``: a DTensor's local tensor, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def modifiable_local(tensor: DTensor) -> Tensor:
    """This rank's part of ``tensor`` as a tensor of its own, where ``to_local`` returns a view that autograd
    forbids modifying in place: for a module's output the model may modify as it may a plain ``nn.Linear``'s (Llama
    4 adds its routed experts' output into its shared expert's with ``add_``). ``tensor`` must be a temporary no
    one else reads (a collective's result), as its local tensor is shared; the gradient goes back in its
    placements."""
    return _ModifiableLocal.apply(tensor)


class _ModifiableLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: DTensor) -> Tensor:
        ctx.spec = tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride()
        return tensor._local_tensor.detach()  # a tensor object of its own (not a view), on the same storage

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> DTensor:
        mesh, placements, shape, stride = ctx.spec
        return DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape, stride=stride)


def shallow_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing its attributes, for a forward to run on with other (this rank's plain) tensors set
    on it. Not ``copy.copy``: a module ``fully_shard`` or ``replicate`` wrapped rebuilds itself through ``__init__``
    there."""
    copied = object.__new__(type(module))
    copied.__dict__.update(module.__dict__)
    return copied


def has_dtensor_parameters(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is a DTensor: it is split already, by its own ``configure_model`` or a
    transform applied before, and is not split again."""
    return any(isinstance(p, DTensor) for p in module.parameters())


def dtensor_spec(tensor: Tensor) -> Optional[DTensorSpec]:
    """What :func:`as_dtensor_like` needs to make ``tensor``'s local part (possibly transformed: moved, cast) the
    same DTensor again; None for a plain tensor."""
    if not isinstance(tensor, DTensor):
        return None
    return tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride()


def as_dtensor_like(local: Tensor, spec: Optional[DTensorSpec]) -> Tensor:
    """``local`` as the DTensor ``spec`` describes (``local`` itself when None), without communication."""
    if spec is None:
        return local
    mesh, placements, shape, stride = spec
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def in_blocks(value: Any) -> Any:
    """``value`` as distributed checkpointing can record it: a DTensor split part by part over a mesh dimension
    (``_StridedShard``: a fused weight whose parts are each split, as the gate and up projections of stacked experts
    under tensor parallelism) redistributed to the plain ``Shard`` of that dimension — DCP describes each rank's part
    as one block of the whole tensor, which a strided part is not; anything else as it is (FSDP2's ``_StridedShard``
    under a tensor-parallel ``Shard`` of the same dimension leaves each rank one block)."""
    if not isinstance(value, DTensor):
        return value
    placements, sizes = value.placements, value.device_mesh.shape
    parted = [i for i, p in enumerate(placements) if isinstance(p, _StridedShard) and p.split_factor != math.prod(
        sizes[j] for j in range(i + 1, len(placements))
        if isinstance(placements[j], Shard) and not isinstance(placements[j], _StridedShard)
        and placements[j].dim == p.dim)]
    if not parted:
        return value
    return value.redistribute(placements=[Shard(p.dim) if i in parted else p for i, p in enumerate(placements)])


def block_to_fill(target: Tensor) -> tuple[Tensor, Tensor, tuple[int, ...]]:
    """What a reader fills of ``target`` (plain, or this rank's part of a DTensor): its :func:`in_blocks` form, that
    form's local tensor, and where the local tensor starts in the whole one; :func:`from_blocks` puts it back."""
    block = in_blocks(target)
    if not isinstance(block, DTensor):
        return block, block, (0,) * block.dim()
    offset = compute_local_shape_and_global_offset(block.shape, block.device_mesh, block.placements)[1]
    return block, block.to_local(), tuple(offset)


def from_blocks(target: Any, read: Any) -> Any:
    """``target`` with what was read into :func:`in_blocks`' form of it, ``read``; where that is ``target`` itself,
    or not a DTensor (a value distributed checkpointing replaced), ``read``."""
    if not isinstance(target, DTensor) or read is target:
        return read
    target.to_local().copy_(read.redistribute(placements=target.placements).to_local())
    return target
