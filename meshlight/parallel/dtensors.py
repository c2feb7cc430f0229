"""What the mechanisms ask of a tensor or module that tensor, expert or data parallelism may have split into
DTensors: this rank's part of a tensor, and whether a module is split already (in ``configure_model``, or by an
earlier transform). Imports nothing of meshlight's, so that every mechanism can use it."""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = ["has_dtensor_parameters", "local_tensor"]


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor``: a DTensor's local tensor, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def has_dtensor_parameters(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is a DTensor: it is split already, by its own ``configure_model`` or a
    transform applied before, and is not split again."""
    return any(isinstance(p, DTensor) for p in module.parameters())
