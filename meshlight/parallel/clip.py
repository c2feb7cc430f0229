"""Gradient-norm clipping by the true global norm of a model split across ranks.

``torch.nn.utils.clip_grad_norm_`` is right for replicated gradients (DDP) and for DTensors that all live
on one mesh, but it fails or silently under-counts when a model mixes plain tensors with DTensors on
different meshes (FSDP-sharded dense weights next to expert-sharded weights) or is split into pipeline
stages. Here the norm is computed per group of gradients sharing a mesh and placements — DTensor
reductions count every sharded element once and replicated copies once — and stage norms are then summed
over the pipeline group, as the norms of experts that each rank of an expert-parallel group holds alone (not
DTensors over it: experts of a list) are over that group.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_", "total_grad_norm"]


def total_grad_norm(
    parameters: Iterable[Tensor],
    norm_type: float = 2.0,
    pipeline_group: Optional[dist.ProcessGroup] = None,
    expert_group: Optional[dist.ProcessGroup] = None,
    held_alone: Collection[Tensor] = (),
) -> Tensor:
    """The ``norm_type``-norm of all gradients of the whole model, identical on every rank.

    ``pipeline_group``: the ranks holding the other stages of this rank's model replica (None: not pipelined).
    ``held_alone``: parameters that this rank holds and the other ranks of ``expert_group`` do not (experts of a list
    split over ep, :func:`~meshlight.parallel.expert.listed_expert_parameters`: no DTensor over ep says so); the norm
    of those among ``parameters`` is summed over that group.
    """
    norm_type = float(norm_type)
    alone = {id(p) for p in held_alone}
    parameters = list(parameters)
    experts = [p for p in parameters if id(p) in alone]  # the same on every rank of the group: its experts alike
    total = _norm([p for p in parameters if id(p) not in alone], norm_type)
    if experts:
        summed = _summed_over(_norm(experts, norm_type), norm_type, expert_group)
        total = torch.nn.utils.get_total_norm([total, summed.to(total.device)], norm_type)
    return _summed_over(total, norm_type, pipeline_group)


def _norm(parameters: list[Tensor], norm_type: float) -> Tensor:
    """The norm of ``parameters``' gradients over every rank that holds a part of them (a DTensor's mesh); zero on
    their device where none has a gradient."""
    if not any(p.grad is not None for p in parameters):
        return torch.zeros((), device=parameters[0].device if parameters else None)
    norms = []
    for grads in _grads_by_layout(parameters):
        norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=True)
        if isinstance(norm, DTensor):
            mesh = norm.device_mesh
            if norm.to_local().device.type != mesh.device_type:  # offloaded gradients: reduce on the mesh's device
                norm = DTensor.from_local(norm.to_local().to(mesh.device_type), mesh, norm.placements, run_check=False)
            norm = norm.full_tensor()
        norms.append(norm)
    device = next((n.device for n in norms if n.device.type != "cpu"), None)
    return torch.nn.utils.get_total_norm([n.to(device) for n in norms] if device else norms, norm_type)


def _summed_over(norm: Tensor, norm_type: float, group: Optional[dist.ProcessGroup]) -> Tensor:
    """The norm of what the ranks of ``group`` hold, each ``norm`` of its own part (None: this rank's alone)."""
    if group is None or dist.get_world_size(group) == 1:
        return norm
    if norm_type == float("inf"):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    norm = norm**norm_type
    dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=group)
    return norm ** (1.0 / norm_type)


def clip_grad_norm_(
    parameters: Union[Tensor, Iterable[Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    pipeline_group: Optional[dist.ProcessGroup] = None,
    error_if_nonfinite: bool = False,
    uncounted: Collection[Tensor] = (),
    expert_group: Optional[dist.ProcessGroup] = None,
    held_alone: Collection[Tensor] = (),
) -> Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; returns the norm before clipping.
    ``uncounted``: parameters scaled but left out of the norm (a tied weight's copy that another stage counts);
    ``expert_group``, ``held_alone``: see :func:`total_grad_norm`."""
    parameters = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    left_out = {id(p) for p in uncounted}
    total = total_grad_norm([p for p in parameters if id(p) not in left_out], norm_type, pipeline_group,
                            expert_group, held_alone)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} of the gradients is non-finite ({total.item()}).")
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grads in _grads_by_layout(parameters):
        torch._foreach_mul_(grads, scale.to(grads[0].device))
    return total


def _grads_by_layout(parameters: Iterable[Tensor]) -> list[list[Tensor]]:
    """Gradients grouped so that each group is plain tensors or DTensors of one mesh and placement."""
    groups: dict[object, list[Tensor]] = defaultdict(list)
    for param in parameters:
        grad = param.grad
        if grad is not None:
            groups[(grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None].append(grad)
    return list(groups.values())
