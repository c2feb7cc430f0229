"""Logging inside a pipeline schedule: what a LightningModule's step logs for each microbatch is recorded instead
of forwarded, combined over the microbatches as each value's ``reduce_fx`` says (mean, sum, max, min: a sum of
sample counts is the batch's, as in one process), and replayed through the real ``self.log`` on every rank."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from torch.distributed.tensor import DTensor
from torchmetrics import Metric

__all__ = ["LogRecorder", "detached_whole", "logged_layout"]


class LogRecorder:
    """Records ``self.log``/``self.log_dict`` calls instead of forwarding them, and replays them combined over
    microbatches."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[dict[int, Any], dict[str, Any]]] = {}  # name -> ({microbatch: value}, kwargs)
        self.microbatch = 0

    def clear(self) -> None:
        self.entries = {}

    @contextmanager
    def capture(self, module: LightningModule, microbatch: int = 0) -> Iterator[None]:
        self.microbatch = microbatch
        with _logging_to(module, self.log, self.log_dict):
            yield

    @contextmanager
    def discard(self, module: LightningModule) -> Iterator[None]:
        def ignore(*args: Any, **kwargs: Any) -> None:
            return None

        with _logging_to(module, ignore, ignore):
            yield

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        values, _ = self.entries.setdefault(name, ({}, kwargs))
        values[self.microbatch] = detached_whole(value) if isinstance(value, Tensor) else value

    def log_dict(self, dictionary: Mapping[str, Any], **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self.log(name, value, **kwargs)

    def reduced(self, module: LightningModule) -> list[tuple[str, Any, dict[str, Any]]]:
        """One value per name: the microbatches' values combined by the name's ``reduce_fx`` (so that a sum of
        sample counts is the batch's, as in one process), or the path of a logged torchmetrics Metric (each rank
        replays its own instance; their states are reduced over all ranks when the metric is computed)."""
        paths = {id(m): name for name, m in module.named_modules()}
        out = []
        for name, (by_microbatch, kwargs) in self.entries.items():
            values = list(by_microbatch.values())
            if isinstance(values[-1], Metric):
                out.append((name, ("metric", paths[id(values[-1])]), kwargs))
            else:
                reduce_fx = kwargs.get("reduce_fx", "mean")  # Lightning accepts no other than these
                combine = _MICROBATCH_COMBINATIONS.get(reduce_fx.lower() if isinstance(reduce_fx, str) else reduce_fx,
                                                       torch.mean)
                # in float32, or float64 where a value is (a float64 model's losses keep their digits)
                dtype = functools.reduce(torch.promote_types, [v.dtype for v in values if isinstance(v, Tensor)
                                                               and v.is_floating_point()], torch.float32)
                stacked = torch.stack([torch.as_tensor(v, dtype=dtype).cpu() for v in values])
                out.append((name, combine(stacked), kwargs))
        return out

    @staticmethod
    def replay(module: LightningModule, logged: list[tuple[str, Any, dict[str, Any]]]) -> None:
        for name, value, kwargs in logged:
            if isinstance(value, tuple) and value[0] == "metric":
                value = module.get_submodule(value[1])
            else:
                value = value.to(module.device)
            module.log(name, value, **kwargs)


@contextmanager
def _logging_to(module: LightningModule, log: Callable[..., None], log_dict: Callable[..., None]) -> Iterator[None]:
    """``module.log``/``log_dict`` replaced on the instance, and what was there before back afterwards (recorders
    nest: context parallelism records around a pipeline's)."""
    before = {name: module.__dict__[name] for name in ("log", "log_dict") if name in module.__dict__}
    module.log, module.log_dict = log, log_dict  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict
        module.__dict__.update(before)


def logged_layout(logged: list[tuple[str, Any, dict[str, Any]]]) -> list[tuple[str, Any, dict[str, Any]]]:
    """What was logged without the values: (name, the metric reference or None for a number, options)."""
    return [(name, value if isinstance(value, tuple) else None, kwargs) for name, value, kwargs in logged]


#: how a value logged in each microbatch's step becomes the batch's, by the ``reduce_fx`` it was logged with
_MICROBATCH_COMBINATIONS: dict[Any, Callable[[Tensor], Tensor]] = {
    "mean": torch.mean, "avg": torch.mean, "sum": torch.sum, "max": torch.max, "min": torch.min,
    torch.mean: torch.mean, torch.sum: torch.sum, sum: torch.sum, torch.max: torch.max, max: torch.max,
    torch.min: torch.min, min: torch.min,
}


def detached_whole(value: Tensor) -> Tensor:
    """``value`` detached, as a plain tensor: a DTensor (a loss on vocabulary-sharded logits, under loss
    parallelism) becomes its full value. Called on every tensor-parallel rank of the last stage together."""
    value = value.detach()
    return value.full_tensor() if isinstance(value, DTensor) else value
