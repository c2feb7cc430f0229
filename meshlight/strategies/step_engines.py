"""How a step runs, chosen once at setup: every rank runs the user's step (SPMD: data, ZeRO, tensor and expert
parallelism), or a pipeline schedule runs it over microbatches. :class:`~meshlight.strategies.MeshStrategy`'s
Lightning hooks each delegate to one of these engines, so no hook asks which kind of layout runs."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor, nn
from torch.optim import Optimizer

from meshlight.parallel.data_parallel import gradient_accumulation
from meshlight.parallel.tensor import reduce_partial_gradients
from meshlight.strategies.pipeline_steps import PipelineSteps

__all__ = ["PipelineEngine", "SpmdEngine", "StepEngine"]


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

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return ParallelStrategy.training_step(self.strategy, *args, **kwargs)

    def backward(self, loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        return ParallelStrategy.backward(self.strategy, loss, optimizer, *args, **kwargs)

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
