"""torchmetrics under a mesh: each sample counted once, and no warning where a stage holds no metric values."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torchmetrics import Metric

from meshlight.strategies.pipeline_steps import PipelineSteps

__all__ = ["count_metric_samples_once"]


def count_metric_samples_once(module: nn.Module, mesh: DeviceMesh, pipeline: Optional[PipelineSteps]) -> None:
    """torchmetrics reduce their states over every rank by default; the tensor-parallel ranks of a replica update
    theirs with the same batch, so counts (``SumMetric``, ``CatMetric``, …) would come out tp times too large.
    Metrics without their own ``process_group`` reduce over the ranks with this rank's tensor-parallel index
    instead: each sample once. Under pipelining only the last stage updates metrics (the other stages' empty states
    add nothing), so on the other stages torchmetrics' warning that ``compute`` ran before ``update`` is expected,
    and silenced around each metric's ``compute``."""
    metrics = [m for m in module.modules() if isinstance(m, Metric) and m.process_group is None]
    if pipeline is not None and not pipeline.has_last:
        for metric in metrics:
            if not getattr(metric.compute, "_meshlight_quiet", False):
                metric.compute = _without_compute_before_update_warning(metric.compute)
    if mesh["tp"].size() == 1 or not metrics:
        return
    names = tuple(name for name in mesh.mesh_dim_names if name != "tp")
    group = mesh[names]._flatten("metrics").get_group()
    for metric in metrics:
        metric.process_group = group


def _without_compute_before_update_warning(compute: Callable[[], Any]) -> Callable[[], Any]:
    @functools.wraps(compute)
    def quiet() -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"The ``compute`` method of metric", category=UserWarning)
            return compute()

    quiet._meshlight_quiet = True  # type: ignore[attr-defined]
    return quiet
