"""How a step runs, chosen once at setup: every rank runs the user's step (SPMD: data, ZeRO, tensor and expert
parallelism), or a pipeline schedule runs it over microbatches; under context parallelism either runs on this rank's
share of each sequence. :class:`~meshlight.strategies.MeshStrategy`'s Lightning hooks each delegate to one of these
engines, so no hook asks which kind of layout runs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor, nn
from torch.optim import Optimizer

from meshlight.parallel.context import ContextParallel, LocalBatch
from meshlight.parallel.data_parallel import gradient_accumulation, refuse_parameters_without_gradients
from meshlight.parallel.tensor import reduce_partial_gradients
from meshlight.strategies.pipeline_logging import LogRecorder
from meshlight.strategies.pipeline_steps import PipelineSteps

__all__ = ["ContextParallelSteps", "PipelineEngine", "SpmdEngine", "StepEngine"]


class StepEngine:
    """The steps of one parallelized model. ``partial_gradients``: tensor parallelism leaves partial-sum gradients
    (replicated parameters used on sequence shares) that must be summed before the optimizer steps."""

    def __init__(self, strategy: ParallelStrategy, partial_gradients: bool) -> None:
        self.strategy = strategy
        self._partial_gradients = partial_gradients

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def backward(self, loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        raise NotImplementedError

    def evaluation_step(self, kind: str, *args: Any, **kwargs: Any) -> Any:
        """``kind``: ``"validation"``, ``"test"`` or ``"predict"``."""
        raise NotImplementedError

    def accumulating(self) -> AbstractContextManager[None]:
        """Entered for micro-batches that only accumulate gradients (no optimizer step follows)."""
        return nullcontext()

    def optimizer_closure(self, closure: Callable[[], Any], optimizer: Optimizer) -> Callable[[], Any]:
        """``closure`` (forward and backward), then what the gradients need before clipping and the step; inside
        it, so Lightning's clipping and ``on_before_optimizer_step`` see them whole (under manual optimization what
        the user does before ``opt.step()`` still sees partial sums: correct, slower)."""
        if not self._partial_gradients:
            return closure

        def closure_then_reduce() -> Any:
            result = closure()
            reduce_partial_gradients(p for group in optimizer.param_groups for p in group["params"])
            return result

        return closure_then_reduce


class SpmdEngine(StepEngine):
    """Every rank runs the user's steps through Lightning's own strategy hooks; ``zero`` decides how
    accumulating micro-batches hold their gradients."""

    def __init__(self, strategy: ParallelStrategy, partial_gradients: bool, model: nn.Module, zero: int) -> None:
        super().__init__(strategy, partial_gradients)
        self._model, self._zero = model, zero
        self._checked = False  # (for parameters DDP would leave unreduced: after the first synchronizing backward)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return ParallelStrategy.training_step(self.strategy, *args, **kwargs)

    def backward(self, loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        result = ParallelStrategy.backward(self.strategy, loss, optimizer, *args, **kwargs)
        if not self._checked:
            self._checked = refuse_parameters_without_gradients(self._model, self.strategy.lightning_module)
        return result

    def evaluation_step(self, kind: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(ParallelStrategy, f"{kind}_step")(self.strategy, *args, **kwargs)

    def accumulating(self) -> AbstractContextManager[None]:
        return gradient_accumulation(self._model, self._zero)


class PipelineEngine(StepEngine):
    """The schedule runs forward and backward inside ``training_step`` (:class:`PipelineSteps`); ``backward`` hands
    its gradients back after Lightning's ``zero_grad``. It manages its stages' gradient reduction itself."""

    def __init__(self, strategy: ParallelStrategy, partial_gradients: bool, steps: PipelineSteps) -> None:
        super().__init__(strategy, partial_gradients)
        self.steps = steps

    @property
    def _precision(self) -> Precision:
        return self.strategy.precision_plugin

    def training_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        accumulate = self.strategy.lightning_module.trainer.accumulate_grad_batches
        with self._precision.train_step_context():
            return self.steps.training_step(batch, batch_idx, clear_gradients=batch_idx % accumulate == 0,
                                            accumulate=accumulate, scaler=getattr(self._precision, "scaler", None))

    def backward(self, loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        module = self.strategy.lightning_module
        loss = self._precision.pre_backward(loss, module)
        self.steps.restore_gradients()
        return self._precision.post_backward(loss, module)

    def evaluation_step(self, kind: str, *args: Any, **kwargs: Any) -> Any:
        with getattr(self._precision, f"{_PRECISION_CONTEXT.get(kind, kind)}_step_context")():
            return self.steps.evaluation_step(getattr(self.strategy.lightning_module, f"{kind}_step"), *args)


_PRECISION_CONTEXT = {"validation": "val"}  # the precision plugin names it `val_step_context`


class ContextParallelSteps(StepEngine):
    """The steps of ``inner`` (SPMD or pipeline) on this rank's share of each sequence.

    It cuts the batch to this rank's share before the user's step runs, keeps the model's attention and positions
    global while forward and backward run, weighs the loss by each rank's tokens (the step's loss is the whole
    sequence's, on every rank), and logs what the step logs as the whole sequence's value (token-weighted over the
    cp ranks), so that ``self.log`` and the progress bar read as in one process. Predictions run on whole sequences.
    """

    def __init__(self, inner: StepEngine, context: ContextParallel, module: LightningModule) -> None:
        super().__init__(inner.strategy, partial_gradients=False)
        self.inner, self.context, self.module = inner, context, module
        self._recorder = LogRecorder()
        self._local: Optional[LocalBatch] = None  # the last training batch's share, for its backward
        if isinstance(inner, PipelineEngine):  # the schedule's loss function weighs each microbatch's loss
            inner.steps.weigh_loss = self._weigh_microbatch

    def training_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        self._local = local = self.context.split(batch)
        return self._logged_over_ranks(local, lambda: self.inner.training_step(local.batch, batch_idx, *args, **kwargs),
                                       weigh=True)

    def backward(self, loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        with self.context.active(self._local) if self._local is not None else nullcontext():
            return self.inner.backward(loss, optimizer, *args, **kwargs)

    def evaluation_step(self, kind: str, *args: Any, **kwargs: Any) -> Any:
        if kind == "predict":  # whole sequences on every rank: a prediction is per token
            return self.inner.evaluation_step(kind, *args, **kwargs)
        batch, rest = args[0], args[1:]
        local = self.context.split(batch)
        return self._logged_over_ranks(local, lambda: self.inner.evaluation_step(kind, local.batch, *rest, **kwargs),
                                       weigh=False)

    def accumulating(self) -> AbstractContextManager[None]:
        return self.inner.accumulating()

    def optimizer_closure(self, closure: Callable[[], Any], optimizer: Optimizer) -> Callable[[], Any]:
        return self.inner.optimizer_closure(closure, optimizer)

    # ------------------------------------------------------------------------------------------ machinery

    def _logged_over_ranks(self, local: LocalBatch, step: Callable[[], Any], *, weigh: bool) -> Any:
        """Run ``step`` on ``local`` with what it logs recorded, then log each value as the whole sequence's."""
        self._recorder.clear()
        with self.context.active(local), self._recorder.capture(self.module):
            result = step()
        if weigh and not isinstance(self.inner, PipelineEngine):  # (the schedule weighed its microbatches' losses)
            result = self._weighed(result, local.tokens)
        self._recorder.replay(self.module, self._over_ranks(self._recorder.reduced(self.module), local.tokens))
        return result

    def _weighed(self, result: Any, tokens: Optional[Tensor]) -> Any:
        if isinstance(result, Tensor):
            return self.context.weighted_loss(result, tokens)
        if isinstance(result, Mapping) and isinstance(result.get("loss"), Tensor):
            return {**result, "loss": self.context.weighted_loss(result["loss"], tokens)}
        return result  # manual optimization: the user's own backward ran in the step

    def _weigh_microbatch(self, loss: Tensor, microbatch: Any) -> Tensor:
        return self.context.weighted_loss(loss, self.context.tokens_of(microbatch))

    def _over_ranks(self, logged: list[tuple[str, Any, dict[str, Any]]],
                    tokens: Optional[Tensor]) -> list[tuple[str, Any, dict[str, Any]]]:
        """Logged numbers averaged over the cp ranks, each weighted by its tokens (one all-reduce)."""
        numbers = [i for i, (_, value, _) in enumerate(logged) if not isinstance(value, tuple)]
        if not numbers:
            return logged
        # (the recorder's values are on the host; the tokens were counted where the batch is)
        weight = (tokens if tokens is not None else torch.ones(())).to("cpu", torch.float64)
        device = self.strategy.root_device
        # (a rank whose share holds no label logs a NaN loss, 0/0: it adds nothing)
        flat = torch.stack([weight] + [torch.where(weight > 0, logged[i][1].to(torch.float64).reshape(()) * weight, 0.0)
                                       for i in numbers])
        flat = flat.to(device)
        dist.all_reduce(flat, group=self.context.group)
        flat = flat.cpu()
        total = flat[0].clamp_min(1e-30)
        out = list(logged)
        for position, i in enumerate(numbers, start=1):
            name, value, options = logged[i]
            out[i] = (name, (flat[position] / total).to(value.dtype), options)
        return out
