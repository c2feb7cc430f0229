"""The one place where a model is made parallel, in a fixed order of transforms.

Order on each pipeline stage's module: pipeline split → tensor (+ sequence) parallel → expert
parallel → activation checkpointing → compile → activation offload → data parallel (DDP / ZeRO). Data
parallelism comes last because FSDP must see the final parameters (DTensors from tensor parallelism, expert
shards) to shard them. The pipeline split happens before (per stage, in the strategy).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Union

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from meshlight.parallel.blocks import BlockSelection, repeated_blocks
from meshlight.parallel.compile import CompilePolicy, apply_compile
from meshlight.parallel.data_parallel import apply_data_parallel, broadcast_module_states, is_data_parallel
from meshlight.parallel.expert import apply_expert_parallel, expert_layers, sharded_experts
from meshlight.parallel.layout import ParallelLayout, axis
from meshlight.parallel.offload import OffloadPolicy, apply_activation_offload
from meshlight.parallel.precision import PrecisionPolicy
from meshlight.parallel.recompute import apply_recompute
from meshlight.parallel.tensor import apply_tensor_parallel, sequence_share_input
from meshlight.parallel.tensor_plan import model_plan, validate_plan
from meshlight.parallel.tensor_plan import sequence_region as find_sequence_region

__all__ = ["parallelize"]


def parallelize(
    module: nn.Module,
    layout: ParallelLayout,
    mesh: DeviceMesh,
    *,
    ddp_kwargs: Optional[dict[str, Any]] = None,
    tp_plan: Optional[Mapping[str, Union[str, ParallelStyle]]] = None,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    keep_gathered_inputs: bool = False,
    recompute: Optional[BlockSelection] = None,
    precision: Optional[PrecisionPolicy] = None,
    offload: Optional[OffloadPolicy] = None,
    compile: Optional[CompilePolicy] = None,  # noqa: A002 - the transform's name
    later_stage: bool = False,
    sequence_region: Union[str, tuple[str, str], None] = "auto",
) -> nn.Module:
    """Apply every transform ``layout`` asks for to ``module`` in place; ``module`` becomes the root whose
    forward runs the collectives. ``tp_plan`` (module-name patterns → roles) replaces the automatic
    tensor-parallel plan; see :mod:`meshlight.parallel.tensor_plan`.

    With pipeline parallelism ``module`` is one stage (see :mod:`meshlight.parallel.pipeline`, which splits
    the model first). A transform the model already carries — DTensor parameters from its own tensor
    parallelism, DDP or FSDP applied in ``configure_model`` — is not applied again. ``recompute`` chooses the
    blocks whose activations are recomputed in backward (:mod:`meshlight.parallel.recompute`); ``precision``
    makes parameters and compute low-precision with fp32 master weights (:mod:`meshlight.parallel.precision`);
    ``offload`` moves optimizer state and chosen blocks' activations to host memory (:mod:`meshlight.parallel.offload`);
    ``compile`` compiles chosen blocks' forward (:mod:`meshlight.parallel.compile`). ``later_stage``: ``module``
    is a pipeline stage after the first, which receives the sequence parallelism's share of the sequence
    (:func:`~meshlight.parallel.tensor.sequence_share_input`). ``sequence_region``: where sequence parallelism
    holds shares of the sequence (:func:`~meshlight.parallel.tensor_plan.sequence_region`), found from ``module`` when
    ``"auto"``; a pipeline stage is given its whole model's.
    """
    moe_layers = expert_layers(module)
    if layout.ep > 1 and not moe_layers and layout.pp == 1:
        raise ValueError(
            f"ep={layout.ep}, but the model has no meshlight.nn.MoE layers to split: use"
            " meshlight.nn.MoE for the feed-forwards (GPTConfig(moe=MoEConfig(...)) for meshlight's GPT), or ep=1."
        )
    if layout.tp > 1 and moe_layers:
        raise NotImplementedError(
            f"{layout.describe()}: MoE layers under tensor parallelism are not supported yet; use tp=1 and split"
            " the experts with ep instead."
        )
    if is_data_parallel(module):
        return module
    # Every transform starts from the same weights on every rank (DDP would broadcast; FSDP and TP do not).
    # Shards of a model the user split in configure_model are copied only among ranks holding the same shard.
    broadcast_module_states(module, axis(mesh, "stage").get_group(), shard_group=axis(mesh, "dp").get_group())
    if layout.tp > 1 and not any(isinstance(p, DTensor) for p in module.parameters()):
        plan = model_plan(module, tp_plan)
        validate_plan(module, plan, layout.tp, layout.world_size, sequence_parallel=sequence_parallel)
        if sequence_region == "auto":
            sequence_region = find_sequence_region(module, plan) if sequence_parallel else None
        apply_tensor_parallel(module, mesh["tp"], plan, sequence_parallel=sequence_parallel,
                              loss_parallel=loss_parallel, keep_gathered_inputs=keep_gathered_inputs,
                              sequence_region=sequence_region)
        if later_stage and sequence_parallel:
            sequence_share_input(module, mesh["tp"])
    if moe_layers:
        apply_expert_parallel(module, mesh, layout.ep)
    # Recomputation runs inside the compiled block, where the compiler sees what it recomputes — unless the blocks
    # hold FSDP units of their own (the modules mixed precision keeps in fp32), whose hooks dynamo does not trace:
    # a break inside the recomputed region would run the whole block eagerly, so there the compiled pieces run
    # inside the recomputation instead.
    transforms = [(apply_recompute, recompute), (apply_compile, compile)]
    if precision is not None and any(precision.fp32_units(block) for block in repeated_blocks(module)):
        if compile is not None and compile.arguments.get("fullgraph"):
            raise ValueError(
                "Compile(fullgraph=True) cannot compile a block whole under MixedPrecision: the modules it keeps"
                " fp32 (norms, MoE routers) are FSDP units of their own, which torch.compile does not trace. Use"
                " MixedPrecision(..., fp32_norms=False) (norms gathered in bf16 with their block) or fullgraph=False."
            )
        transforms.reverse()
    for apply, policy in transforms:
        if policy is not None:
            apply(module, policy)
    if offload is not None and offload.activations is not None:
        apply_activation_offload(module, offload.activations, offload.pin_memory)
    cpu_offload = offload.fsdp if offload is not None else None
    return apply_data_parallel(module, mesh, layout.zero, ddp_kwargs=ddp_kwargs, pipelined=layout.pp > 1,
                               experts=sharded_experts(module), precision=precision, cpu_offload=cpu_offload,
                               compile_arguments=compile.arguments if compile is not None else None)
