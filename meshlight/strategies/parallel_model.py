"""The parallelized model of a LightningModule: the root module that carries the parallel hooks, and what it
was built for. It is kept on the LightningModule itself, so that ``fit`` then ``test`` (or a second Trainer with the
same layout) reuses it, and a Trainer with another layout parallelizes the module anew where nothing of the old
layout is left inside it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from meshlight.parallel.compression import GradientCompression
from meshlight.parallel.data_parallel import ddp_engine, is_data_parallel
from meshlight.parallel.dtensors import has_dtensor_parameters
from meshlight.parallel.expert import expert_layers, listed_experts_split, splittable_listed_experts
from meshlight.parallel.layout import ParallelLayout
from meshlight.parallel.parallelize import parallelize
from meshlight.parallel.pipeline import model_root
from meshlight.parallel.tensor_plan import model_plan, sequence_region, stage_plan
from meshlight.parallel.transforms import TensorParallelOptions, Transforms
from meshlight.strategies.lightning_internals import ForwardRedirection
from meshlight.strategies.pipeline_steps import PipelineOptions, PipelineSteps, setup_pipeline

__all__ = ["MeshForwardRedirection", "ParallelModel", "StepRunner", "parallel_model"]

_ATTRIBUTE = "_meshlight_parallel_model"


class MeshForwardRedirection(ForwardRedirection):
    """Under manual optimization the step has already run backward when the root's forward returns, so DDP
    must not prepare its reducer for another backward (mirrors Lightning's DDPStrategy)."""

    @override
    def on_after_inner_forward(self, wrapper_module: nn.Module, original_module: LightningModule) -> None:
        ddp = ddp_engine(wrapper_module)
        if ddp is not None and not original_module.automatic_optimization:
            ddp.require_backward_grad_sync = False

    @override
    def on_after_outer_forward(self, wrapper_module: nn.Module, original_module: LightningModule) -> None:
        ddp = ddp_engine(wrapper_module)
        if ddp is not None and not original_module.automatic_optimization:
            ddp.require_backward_grad_sync = True


class StepRunner(nn.Module):
    """The root module that carries the parallel hooks around a LightningModule (or, under pipelining, this rank's
    stages).

    Lightning runs ``training_step`` (and the other steps) through the strategy's model's forward, so the hooks
    fire once per step; a ``self(x)`` call inside the step reaches the LightningModule directly and does not
    re-enter them. Its parameters are the LightningModule's, under the ``module.`` prefix.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


@dataclass
class ParallelModel:
    """``root``: the strategy's model; ``pipeline``: the steps on this rank's stages (None without pipelining);
    ``sequence_region``: where sequence parallelism over the blocks only holds shares of the sequence;
    ``state_names``: the whole model's state names where this rank holds some of them (a pipeline stage; experts held
    as a list, split over ep); ``untouched``: the
    LightningModule's own modules and parameters are as they were (only ``root`` carries the parallelism);
    ``context``: the model's context-parallel hooks."""

    root: StepRunner
    layout: ParallelLayout
    pipeline_options: Optional[PipelineOptions] = None
    pipeline: Optional[PipelineSteps] = None
    sequence_region: Optional[tuple[str, str]] = None
    state_names: Optional[set[str]] = None
    untouched: bool = False
    context: Optional[Any] = None  # the ContextParallel hooks, under context parallelism (made by the strategy)


def parallel_model(
    module: LightningModule,
    layout: ParallelLayout,
    mesh: DeviceMesh,
    device: torch.device,
    tensor_parallel: TensorParallelOptions,
    transforms: Transforms,
    pipeline_options: PipelineOptions,
    ddp_kwargs: Optional[dict[str, Any]] = None,
    grad_compression: Optional[GradientCompression] = None,
) -> ParallelModel:
    """``module``'s parallelized model for ``layout``: the one built before when it is for the same layout (and
    pipeline options), else a new one. A module that an earlier layout changed inside (sharded parameters, split
    stages, recomputed blocks, …) cannot be parallelized for another: that is refused, naming the way out."""
    built: Optional[ParallelModel] = module.__dict__.get(_ATTRIBUTE)
    pipelined = layout.pp > 1
    if built is not None and built.layout == layout and built.pipeline_options == (
            pipeline_options if pipelined else None):
        return built
    if built is not None and not built.untouched:
        what = built.layout.describe() + (f" with {built.pipeline_options}" if built.pipeline_options else "")
        raise RuntimeError(
            f"This {type(module).__name__} is already parallelized as {what}; it cannot also run as"
            f" {layout.describe()}{f' with {pipeline_options}' if pipelined else ''}. Create a new instance for this"
            " Trainer (to continue from its weights, save a checkpoint and pass it as `ckpt_path`)."
        )
    if pipelined:
        built = _pipelined(module, layout, mesh, device, tensor_parallel, transforms, pipeline_options,
                           grad_compression)
    else:
        root = StepRunner(module)
        plan, region = _tensor_plan(root, layout, tensor_parallel)
        # experts held as a list, split over ep, are held by one rank each: the whole model's names, as a stage's
        state_names = set(module.state_dict()) if layout.ep > 1 and splittable_listed_experts(module) else None
        parallelize(root, layout, mesh, tensor_parallel=tensor_parallel, plan=plan, transforms=transforms,
                    ddp_kwargs=ddp_kwargs, sequence_region=region, grad_compression=grad_compression)
        untouched = not (is_data_parallel(module) or has_dtensor_parameters(module) or expert_layers(module)
                         or listed_experts_split(module) or transforms != Transforms())
        built = ParallelModel(root, layout, sequence_region=region, state_names=state_names, untouched=untouched)
    module.__dict__[_ATTRIBUTE] = built  # a plain attribute: neither a submodule nor in the state dict
    return built


def _pipelined(module: LightningModule, layout: ParallelLayout, mesh: DeviceMesh, device: torch.device,
               tensor_parallel: TensorParallelOptions, transforms: Transforms,
               options: PipelineOptions, grad_compression: Optional[GradientCompression]) -> ParallelModel:
    state_names = set(module.state_dict())  # before the split: the whole model's names
    # Tensor-parallel roles are planned on the whole model, before the split frees other stages' pieces; a stage
    # holds the model root as its `root`.
    plan, region = _tensor_plan(module.get_submodule(model_root(module).name), layout, tensor_parallel)
    plan = {f"root.{name}": role for name, role in plan.items()} if plan is not None else None
    region = (f"root.{region[0]}", f"root.{region[1]}") if region is not None else None

    def parallelize_stage(stage: nn.Module, index: int) -> nn.Module:
        return parallelize(stage, layout, mesh, tensor_parallel=tensor_parallel,
                           plan=stage_plan(plan, stage) if plan is not None else None, transforms=transforms,
                           later_stage=index > 0, sequence_region=region, grad_compression=grad_compression)

    steps, stages = setup_pipeline(module, layout, mesh, options, device, parallelize_stage)
    return ParallelModel(StepRunner(stages), layout, options, steps, region, state_names)


def _tensor_plan(model: nn.Module, layout: ParallelLayout,
                 options: TensorParallelOptions) -> tuple[Optional[dict[str, Any]], Optional[tuple[str, str]]]:
    """The tensor-parallel plan of the whole ``model`` and, with sequence parallelism, where the sequence is held in
    shares (:func:`~meshlight.parallel.tensor_plan.sequence_region`); ``(None, None)`` without tensor parallelism or
    when ``configure_model`` applied it."""
    if layout.tp == 1 or has_dtensor_parameters(model):
        return None, None
    plan = model_plan(model, options.plan)
    return plan, sequence_region(model, plan) if options.sequence_parallel else None
