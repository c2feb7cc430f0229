"""The one place where a model is made parallel, in a fixed order of transforms.

Order on each pipeline stage's module (DESIGN.md): pipeline split → tensor (+ sequence) parallel → expert
parallel → activation checkpointing → compile → data parallel (DDP / ZeRO). Data parallelism comes last
because FSDP must see the final parameters (DTensors from tensor parallelism, expert shards) to shard them.
Only data parallelism is implemented so far; each further transform slots in here at its place.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshlight.parallel.data_parallel import apply_data_parallel
from meshlight.parallel.layout import ParallelLayout

__all__ = ["parallelize"]


def parallelize(
    module: nn.Module,
    layout: ParallelLayout,
    mesh: DeviceMesh,
    *,
    ddp_kwargs: Optional[dict[str, Any]] = None,
) -> nn.Module:
    """Apply every transform ``layout`` asks for to ``module`` in place; ``module`` becomes the root whose
    forward runs the collectives."""
    if layout.pp > 1 or layout.tp > 1 or layout.ep > 1:
        raise NotImplementedError(
            f"{layout.describe()}: pipeline, tensor and expert parallelism are not available yet;"
            " use pp=1, tp=1 and ep=1."
        )
    return apply_data_parallel(module, mesh, layout.zero, ddp_kwargs=ddp_kwargs)
