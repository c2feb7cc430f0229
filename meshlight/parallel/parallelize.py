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
from torch.distributed.tensor.parallel import ParallelStyle

from meshlight.parallel.activation_compression import apply_activation_compression
from meshlight.parallel.adapters import as_planned, check_splittable_adapters
from meshlight.parallel.blocks import repeated_blocks
from meshlight.parallel.compile import apply_compile
from meshlight.parallel.compression import GradientCompression
from meshlight.parallel.data_parallel import apply_data_parallel, broadcast_module_states, is_data_parallel
from meshlight.parallel.dtensors import has_dtensor_parameters
from meshlight.parallel.expert import (
    apply_expert_parallel,
    check_expert_adapters,
    check_listed_experts,
    dense_experts,
    has_experts,
    is_dense_experts,
    is_stacked_experts,
    listed_experts,
    sharded_experts,
    split_dense_experts,
    split_over_tp,
    splittable_listed_experts,
    stacked_experts,
)
from meshlight.parallel.layout import ParallelLayout, axis
from meshlight.parallel.offload import apply_activation_offload
from meshlight.parallel.recompute import apply_recompute
from meshlight.parallel.router_logits import gather_router_logits, plain_language_model_loss
from meshlight.parallel.sequence_parallel import sequence_share_input
from meshlight.parallel.tensor import apply_tensor_parallel
from meshlight.parallel.tensor_plan import model_plan, validate_plan
from meshlight.parallel.tensor_plan import sequence_region as find_sequence_region
from meshlight.parallel.transforms import TensorParallelOptions, Transforms

__all__ = ["parallelize"]


def parallelize(
    module: nn.Module,
    layout: ParallelLayout,
    mesh: DeviceMesh,
    *,
    tensor_parallel: Optional[TensorParallelOptions] = None,
    plan: Optional[Mapping[str, Union[str, ParallelStyle]]] = None,
    transforms: Optional[Transforms] = None,
    ddp_kwargs: Optional[dict[str, Any]] = None,
    later_stage: bool = False,
    sequence_region: Union[str, tuple[str, str], None] = "auto",
    grad_compression: Optional[GradientCompression] = None,
) -> nn.Module:
    """Apply every transform ``layout`` asks for to ``module`` in place; ``module`` becomes the root whose
    forward runs the collectives. ``tensor_parallel`` says how tensor parallelism splits it (its ``plan`` of
    module-name patterns → roles replaces the automatic one; see :mod:`meshlight.parallel.tensor_plan`); ``plan``:
    the roles of ``module``'s modules when the caller resolved them already (a pipeline stage's part of its whole
    model's plan), used as they are.

    With pipeline parallelism ``module`` is one stage (see :mod:`meshlight.parallel.pipeline`, which splits
    the model first). A transform the model already carries — DTensor parameters from its own tensor
    parallelism, DDP or FSDP applied in ``configure_model`` — is not applied again. ``transforms``: the blocks
    recomputed in backward (:mod:`meshlight.parallel.recompute`), low-precision parameters and compute with fp32
    master weights (:mod:`meshlight.parallel.precision`), optimizer state and chosen activations in host memory
    (:mod:`meshlight.parallel.offload`), compiled blocks (:mod:`meshlight.parallel.compile`), saved activations kept
    in bf16 or fp8 (:mod:`meshlight.parallel.activation_compression`). ``later_stage``:
    ``module`` is a pipeline stage after the first, which receives the sequence parallelism's share of the sequence
    (:func:`~meshlight.parallel.sequence_parallel.sequence_share_input`). ``sequence_region``: where sequence
    parallelism holds shares of the sequence (:func:`~meshlight.parallel.tensor_plan.sequence_region`), found from
    ``module`` when ``"auto"``; a pipeline stage is given its whole model's. ``grad_compression``: how gradients
    travel in the data-parallel reductions (:mod:`meshlight.parallel.compression`).
    """
    tensor_parallel, transforms = tensor_parallel or TensorParallelOptions(), transforms or Transforms()
    moe_layers = has_experts(module)
    if layout.ep > 1 and not moe_layers and layout.pp == 1:
        raise ValueError(
            f"ep={layout.ep}, but the model has no experts to split: use meshlight.nn.MoE for the feed-forwards"
            " (GPTConfig(moe=MoEConfig(...)) for meshlight's GPT) or stacked experts as Hugging Face's MoE models"
            " have them, or ep=1"
            + (f" ({', '.join(listed)} hold experts as a list in a block whose forward meshlight does not know (it"
               " splits the lists of litgpt's LLaMAMoE): train it with ep=1, under tensor, pipeline or data"
               " parallelism)."
               if (listed := list(listed_experts(module))[:2]) else
               f" ({type(dense[0]).__name__} runs every expert on every token, as Llama 4's MoE does: no token"
               " travels to an expert, so expert parallelism has nothing to split. Train it with ep=1; tp splits each"
               " of its experts over the tensor-parallel ranks)."
               if (dense := dense_experts(module)) else ".")
        )
    if layout.tp > 1 and stacked_experts(module):
        _check_stacked_experts_under_tp(module, layout)
    check_listed_experts(module, layout)
    check_expert_adapters(module, layout)
    if is_data_parallel(module):
        return module
    # Every transform starts from the same weights on every rank (DDP would broadcast; FSDP and TP do not).
    # Shards of a model the user split in configure_model are copied only among ranks holding the same shard.
    broadcast_module_states(module, axis(mesh, "stage").get_group(), shard_group=axis(mesh, "dp").get_group())
    if layout.tp > 1 and not has_dtensor_parameters(module):
        options = tensor_parallel
        plan = plan if plan is not None else model_plan(module, options.plan)
        validate_plan(module, plan, layout.tp, layout.world_size, sequence_parallel=options.sequence_parallel)
        check_splittable_adapters(module, plan)
        # a model's own experts stay plain here where expert parallelism spreads them over the tp ranks (folded, a
        # list's too) or splits each over them
        # (by the plan's names: LoRA layers on the experts' weights stand for them, adapters_unwrapped)
        planned = {name: as_planned(m) for name, m in module.named_modules()}
        split = {name for name, m in planned.items() if is_stacked_experts(m) and split_over_tp(m, layout)
                 or is_dense_experts(m)}
        listed = tuple(f"{name}." for name in (splittable_listed_experts(module) if layout.ep > 1 else ()))
        plan = {name: role for name, role in plan.items() if name not in split and not name.startswith(listed)}
        if sequence_region == "auto":
            sequence_region = find_sequence_region(module, plan) if options.sequence_parallel else None
        apply_tensor_parallel(module, mesh["tp"], plan, sequence_parallel=options.sequence_parallel,
                              loss_parallel=options.loss_parallel, keep_gathered_inputs=options.keep_gathered_inputs,
                              sequence_region=sequence_region)
        if later_stage and options.sequence_parallel:
            sequence_share_input(module, mesh["tp"])
        if options.sequence_parallel:  # a model's own load-balancing loss sees the whole sequence's routing
            gather_router_logits(module, mesh["tp"].get_group(), replicated_loss=True)
        if options.loss_parallel:
            plain_language_model_loss(module)
        split_dense_experts(module, mesh, sequence_parallel=options.sequence_parallel)
    if moe_layers:
        apply_expert_parallel(module, mesh, layout.ep, sequence_parallel=tensor_parallel.sequence_parallel,
                              fold=layout.folded)
    # Recomputation runs inside the compiled block, where the compiler sees what it recomputes — unless the blocks
    # hold FSDP units of their own (the modules mixed precision keeps in fp32), whose hooks dynamo does not trace:
    # a break inside the recomputed region would run the whole block eagerly, so there the compiled pieces run
    # inside the recomputation instead.
    precision, compile, offload = transforms.precision, transforms.compile, transforms.offload
    ordered = [(apply_recompute, transforms.recompute), (apply_compile, compile)]
    if precision is not None and any(precision.fp32_units(block) for block in repeated_blocks(module)):
        if compile is not None and compile.arguments.get("fullgraph"):
            raise ValueError(
                "Compile(fullgraph=True) cannot compile a block whole under MixedPrecision: the modules it keeps"
                " fp32 (norms, MoE routers) are FSDP units of their own, which torch.compile does not trace. Use"
                " MixedPrecision(..., fp32_norms=False) (norms gathered in bf16 with their block) or fullgraph=False."
            )
        ordered.reverse()
    for apply, policy in ordered:
        if policy is not None:
            apply(module, policy)
    if offload is not None and offload.activations is not None:
        apply_activation_offload(module, offload.activations, offload.pin_memory)
    if transforms.activation_compression is not None:
        apply_activation_compression(module, transforms.activation_compression)
    cpu_offload = offload.fsdp if offload is not None else None
    return apply_data_parallel(module, mesh, layout.zero, ddp_kwargs=ddp_kwargs, pipelined=layout.pp > 1,
                               experts=sharded_experts(module), precision=precision, cpu_offload=cpu_offload,
                               compile_arguments=compile.arguments if compile is not None else None,
                               grad_compression=grad_compression)


def _check_stacked_experts_under_tp(module: nn.Module, layout: ParallelLayout) -> None:
    """A model's own MoE blocks (Hugging Face's stacked experts) under tensor parallelism: attention is split, the
    router kept whole (on this rank's share of the tokens under sequence parallelism), and the experts each split over
    the tp ranks (``experts="split"``, in a layout :func:`~meshlight.parallel.expert_tensor.stacked_split_placements`
    knows), or spread over them by ``ep`` folded over them (``experts="fold"``); experts in another layout are kept
    whole on every tp rank with ``ep=1``. Refused: such experts with ``ep > 1`` not folded."""
    unsplit = [name for name, m in module.named_modules() if is_stacked_experts(m) and not split_over_tp(m, layout)]
    if layout.ep > 1 and unsplit:
        raise NotImplementedError(
            f"{layout.describe()}: {unsplit[0]}'s weights are not in the layout meshlight splits over the tp ranks"
            " (experts='split': a fused gate_up_proj [experts, 2 × intermediate, hidden] and down_proj [experts,"
            " hidden, intermediate], or transposed as Llama 4's and GPT-OSS's are); fold expert parallelism over them"
            " instead: experts='fold' with ep in"
            f" {layout.folded_ep_choices()}, or ep=1 (the experts whole on every tp rank)."
        )
