"""The input of a column-parallel group: gathered over the sequence in forward, and gathered again in backward.

Under sequence parallelism each tensor-parallel rank holds its share of the sequence between blocks; the q/k/v
(or up/gate) projections read the whole sequence, so their group's input is all-gathered first. Autograd would
keep that gathered input — the full sequence, on every rank — for the projections' weight gradients. Megatron-LM
keeps only the rank's share and all-gathers it again in backward; :func:`register_sequence_gather` does the same
with a saved-tensor hook around the group's module: a saved tensor that views the gathered input is packed as the
share, and the first projection's backward gathers it once for the whole group. It halves a block's activation
memory at tp=8 for one more all-gather per group in backward (``keep_gathered_inputs=True`` on the strategies
keeps the gathered input instead).

The hook composes with saved-tensor hooks already in force (activation checkpointing, activation offload): the
share goes through them once per group, other tensors as they would without it. It stands aside where
saved-tensor hooks are disabled or traced (``torch.compile``), and without sequence parallelism (nothing to save).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshlight.parallel.dtensors import local_tensor

__all__ = ["register_sequence_gather", "sequence_share"]


def register_sequence_gather(
    module: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool, keep_gathered: bool = False,
) -> None:
    """Make ``module``'s first input (given by position or by its name; also where it is given again, as another
    argument) one replicated DTensor over the 1-D ``mesh`` (an all-gather of the sequence under sequence
    parallelism) before its forward. It stays a DTensor, so
    the gradients of all the Linears reading it accumulate as one partial sum and are reduced once. Under sequence
    parallelism, what ``module``'s forward saves of it is kept as this rank's share and gathered again in backward,
    unless ``keep_gathered``."""
    regather = sequence_parallel and not keep_gathered
    scopes: list[Optional[_Scope]] = []  # one per call in flight, popped by the forward hook

    first = _first_parameter(module)

    def gather(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        scope = None
        by_name = not args and first in kwargs  # Hugging Face's decoder layers call attention with keywords
        value = kwargs[first] if by_name else args[0] if args else None
        if isinstance(value, Tensor):
            layout = sequence_share(value) if sequence_parallel else Replicate()
            share = value if isinstance(value, DTensor) else DTensor.from_local(value, mesh, [layout], run_check=False)
            gathered = share.redistribute(mesh, [Replicate()])
            if regather and _hooks_apply(share):
                scope = _Scope(share, gathered)
            # every argument that is this tensor (CTRL's attention takes its input three times: as q, k and v)
            args = tuple(gathered if arg is value else arg for arg in args)
            kwargs = {key: gathered if arg is value else arg for key, arg in kwargs.items()}
        if scope is not None:
            torch._C._autograd._push_saved_tensors_default_hooks(scope.pack, scope.unpack)
        scopes.append(scope)
        return args, kwargs

    def leave(mod: nn.Module, args: tuple, output: Any) -> None:
        scope = scopes.pop()
        if scope is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            scope.close()

    module.register_forward_pre_hook(gather, with_kwargs=True)
    module.register_forward_hook(leave, always_call=True)


def _first_parameter(module: nn.Module) -> Optional[str]:
    """The name of the first parameter of ``module``'s forward (what a caller may pass by keyword)."""
    parameters = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return parameters[0].name if parameters else None


def sequence_share(tensor: Tensor) -> Shard:
    """The placement of this rank's share of the sequence in ``tensor``: its second-to-last dimension —
    ``[batch, sequence, hidden]``'s sequence, or the tokens of ``[tokens, hidden]``, which an MoE block's shared
    expert reads flattened (any order of tokens suits a layer that acts on each alone, and the row-parallel
    projection after it scatters each rank's own tokens back to it)."""
    return Shard(tensor.ndim - 2)


def _hooks_apply(share: DTensor) -> bool:
    return (torch.is_grad_enabled() and share.requires_grad and tuple(share.placements) == (sequence_share(share),)
            and not torch.compiler.is_compiling()
            and torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is None)


class _Gathered:
    """One forward's gathered input in backward: rebuilt from this rank's share by the first saved tensor
    unpacked, and kept until every saved tensor viewing it has been unpacked."""

    def __init__(self, share: DTensor, outer: Optional[tuple[Callable, Callable]]) -> None:
        self.mesh, self.shape, self.stride = share.device_mesh, share.shape, share.stride()  # the whole sequence's
        with torch.no_grad():
            self.share: Any = local_tensor(share).detach()  # until the first pack: then as the outer hooks packed it
        self.outer = outer
        self.packed = self.unpacked = 0
        self.full: Optional[Tensor] = None

    def pack(self) -> None:
        if not self.packed and self.outer:  # the share goes through the outer hooks once per group
            self.share = self.outer[0](self.share)
        self.packed += 1

    def unpack(self) -> Tensor:
        if self.full is None:
            share = self.outer[1](self.share) if self.outer else self.share
            with torch.no_grad():
                sharded = DTensor.from_local(share, self.mesh, [sequence_share(share)], run_check=False,
                                             shape=self.shape, stride=self.stride)
                self.full = sharded.redistribute(self.mesh, [Replicate()]).to_local()
        full = self.full
        self.unpacked += 1
        if self.unpacked % self.packed == 0:  # the group's last reader in this backward: let it go
            self.full = None
        return full


@dataclass(frozen=True)
class _SavedView:
    gathered: _Gathered
    size: tuple
    stride: tuple
    offset: int  # elements from the start of the gathered local tensor
    spec: Optional[tuple]  # (mesh, placements, shape, stride) when autograd saved a DTensor


class _Scope:
    """Saved-tensor hooks for one forward of a column-parallel group. Autograd keeps the hooks with each tensor
    saved under them, so the scope holds no tensor of its own after :meth:`close`."""

    def __init__(self, share: DTensor, gathered: DTensor) -> None:
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        with torch.no_grad():  # only the storage is looked at: no autograd node for it
            local = local_tensor(gathered)
        self.storage, self.offset, self.dtype = local.untyped_storage().data_ptr(), local.storage_offset(), local.dtype
        self.gathered: Optional[_Gathered] = _Gathered(share, self.outer)

    def close(self) -> None:
        self.gathered = None

    def pack(self, tensor: Tensor) -> Any:
        with torch.no_grad():
            local = local_tensor(tensor)
        if (self.gathered is None or local.untyped_storage().data_ptr() != self.storage
                or local.dtype != self.dtype):
            return (None, self.outer[0](tensor) if self.outer else tensor.detach())
        self.gathered.pack()
        spec = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride()) if isinstance(
            tensor, DTensor) else None
        return (_SavedView(self.gathered, tuple(local.shape), tuple(local.stride()),
                           local.storage_offset() - self.offset, spec), None)

    def unpack(self, packed: tuple) -> Tensor:
        view, other = packed
        if view is None:
            return self.outer[1](other) if self.outer else other
        full = view.gathered.unpack()
        local = full.as_strided(view.size, view.stride, full.storage_offset() + view.offset)
        if view.spec is None:
            return local
        mesh, placements, shape, stride = view.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
