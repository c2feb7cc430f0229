"""The root module around a LightningModule that carries the parallel hooks, built once per LightningModule so that
``fit`` then ``test`` (or a second Trainer) reuses it."""

from __future__ import annotations

import weakref
from typing import Any, Optional

from lightning.pytorch import LightningModule
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from torch import nn
from typing_extensions import override

from meshlight.parallel.data_parallel import ddp_engine
from meshlight.parallel.layout import ParallelLayout
from meshlight.strategies.pipeline_steps import PipelineOptions, PipelineSteps

__all__ = ["RUNNERS", "MeshForwardRedirection", "StepRunner"]


class MeshForwardRedirection(_ForwardRedirection):
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
    """The root module that carries the parallel hooks around a LightningModule.

    Lightning runs ``training_step`` (and the other steps) through the strategy's model's forward, so the
    hooks fire once per step; a ``self(x)`` call inside the step reaches the LightningModule directly and
    does not re-enter them. Its parameters are the LightningModule's, under the ``module.`` prefix.
    """

    def __init__(self, module: nn.Module, layout: ParallelLayout, pipeline: Optional[PipelineSteps] = None,
                 pipeline_options: Optional[PipelineOptions] = None,
                 sequence_region: Optional[tuple[str, str]] = None) -> None:
        super().__init__()
        self.module = module
        self.layout = layout
        self.pipeline, self.pipeline_options = pipeline, pipeline_options  # under pipelining: module = the stages
        self.sequence_region = sequence_region  # with sequence parallelism over the blocks only: (first, last)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


# One parallelized root per LightningModule, so `fit` then `test` (or a second Trainer) reuses it.
RUNNERS: weakref.WeakKeyDictionary[LightningModule, StepRunner] = weakref.WeakKeyDictionary()
