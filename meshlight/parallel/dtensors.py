"""What the mechanisms ask of a tensor or module that tensor, expert or data parallelism may have split into
DTensors: this rank's part of a tensor, and whether a module is split already (in ``configure_model``, or by an
earlier transform). Imports nothing of meshlight's, so that every mechanism can use it."""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = ["DTensorSpec", "as_dtensor_like", "dtensor_spec", "has_dtensor_parameters", "local_tensor"]

#: what makes a local tensor a DTensor again: mesh, placements, global shape and stride
DTensorSpec = tuple[Any, Any, Any, tuple[int, ...]]


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor``: a DTensor's local tensor, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


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
