"""What a mesh strategy changes in Lightning's precision plugin: fp16 loss scaling that agrees over every rank, and
clipping by the norm of the whole sharded model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Union

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import Optimizer

from meshlight.parallel.precision import MeshGradScaler

__all__ = ["adapt_precision_plugin"]


def adapt_precision_plugin(plugin: Precision, device_type: str,
                           clip_grad_by_norm: Callable[[Optimizer, Union[int, float]], Tensor]) -> None:
    """Make ``plugin``'s fp16 grad scaler (``"16-mixed"``) skip a step on every rank when any rank's gradient shard
    overflows, and route Lightning's clipping by norm (which goes through the plugin) to ``clip_grad_by_norm``."""
    scaler = getattr(plugin, "scaler", None)
    if isinstance(scaler, torch.amp.GradScaler) and not isinstance(scaler, MeshGradScaler):
        plugin.scaler = MeshGradScaler.like(scaler, device_type)
    plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]
