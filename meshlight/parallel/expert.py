"""Expert parallelism: each of ``ep`` ranks holds ``num_experts / ep`` experts of every MoE layer, and tokens
travel to their experts and back by all-to-all.

Ranks are borrowed from data parallelism (the mesh axis ``ep`` is carved out of ``dp_shard``, or of
``dp_replicate`` without ZeRO): the ``ep`` ranks of a group read different data and exchange tokens. Dense
weights stay data parallel over all data ranks; expert weights — DTensors ``Shard(0)`` over ``ep`` — are
data parallel over the ``dp / ep`` ranks that hold the same experts (:func:`expert_data_mesh`).

An expert's gradient collects the tokens of ``ep`` data ranks, while data parallelism averages over only
``dp / ep`` replicas of it; :class:`~meshlight.nn.experts.GroupedExperts` scales it by ``1/ep`` so that the
result is the gradient of the mean loss over all data ranks, as for dense weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from meshlight.nn.experts import GroupedExperts
from meshlight.nn.moe import MoE
from meshlight.parallel.layout import DATA_AXES, axis, same_experts_axis

__all__ = ["AllToAllDispatcher", "apply_expert_parallel", "expert_data_mesh", "expert_layers", "sharded_experts"]


def expert_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def sharded_experts(module: nn.Module) -> list[GroupedExperts]:
    """The expert modules whose weights are split over ``ep`` (data parallelism treats them apart)."""
    return [layer.experts for layer in expert_layers(module) if isinstance(layer.experts.w1, DTensor)]


def expert_data_mesh(mesh: DeviceMesh, zero: int) -> DeviceMesh:
    """The ranks holding the same experts, as the data-parallel mesh for expert weights: ``edp_shard`` (with
    ``dp_replicate`` for hybrid sharding) under ZeRO; ``edp_replicate × dp_shard`` (shard size 1) under DDP."""
    replicate, shard = DATA_AXES
    if zero == 0:
        return mesh[same_experts_axis(replicate), shard]
    if axis(mesh, replicate).size() > 1:
        return mesh[replicate, same_experts_axis(shard)]
    return mesh[same_experts_axis(shard)]


def apply_expert_parallel(module: nn.Module, mesh: DeviceMesh, ep: int) -> None:
    """Split every MoE layer's experts over the mesh's ``ep`` axis in place (when ``ep > 1``), and tell every
    MoE layer the data-parallel group its expert loads add up over (for balancing and telemetry)."""
    layers = expert_layers(module)
    data_group = axis(mesh, "dp").get_group()
    for layer in layers:
        layer.data_parallel_group = data_group
    if ep == 1:
        return
    ep_mesh = mesh["ep"]
    for layer in layers:
        if layer.num_experts % ep:
            valid = [d for d in range(1, layer.num_experts + 1) if layer.num_experts % d == 0]
            raise ValueError(
                f"num_experts={layer.num_experts} is not divisible by ep={ep}: each rank must hold the same number"
                f" of experts. Choose ep in {valid} that also divides the data-parallel size."
            )
        experts = layer.experts
        if isinstance(experts.w1, DTensor):
            continue  # already split
        local = layer.num_experts // ep
        start = ep_mesh.get_local_rank() * local
        for name, param in list(experts.named_parameters(recurse=False)):
            shard = param.detach()[start:start + local].clone()
            sharded = DTensor.from_local(shard, ep_mesh, [Shard(0)], run_check=False)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.gradient_scale = 1.0 / ep
        layer.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), local)


class AllToAllDispatcher:
    """Sends tokens sorted by expert to the ranks holding those experts, runs the local experts on what
    arrives, and returns each result to the rank its token came from, in the order it was sent."""

    def __init__(self, group: dist.ProcessGroup, local_experts: int) -> None:
        self.group, self.local_experts = group, local_experts
        self.ranks = dist.get_world_size(group)

    def __call__(self, tokens: Tensor, counts: Tensor, experts: GroupedExperts) -> Tensor:
        # counts[r·L + e]: tokens for expert e of rank r. Exchange the counts first: the split sizes must be
        # known on the host (a device sync, as in every dropless all-to-all dispatcher).
        send = counts.view(self.ranks, self.local_experts)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)
        send_splits, receive_splits = send.sum(1).tolist(), received.sum(1).tolist()
        arrived = all_to_all_single_autograd(tokens, receive_splits, send_splits, self.group)
        # Arrived rows are grouped by source rank, then by local expert; the experts want them by expert.
        source_major = torch.repeat_interleave(
            torch.arange(received.numel(), device=tokens.device), received.flatten(), output_size=sum(receive_splits)
        )
        expert_major = (source_major % self.local_experts) * self.ranks + source_major // self.local_experts
        order = expert_major.argsort(stable=True)
        out = experts(arrived[order], received.sum(0))
        out = out[order.argsort()]
        return all_to_all_single_autograd(out, send_splits, receive_splits, self.group)
