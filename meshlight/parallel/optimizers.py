"""Let any torch optimizer step parameters that are sharded DTensors (ZeRO, tensor parallel).

Elementwise optimizers (SGD, Adam, AdamW, …) already run on DTensors shard by shard. Adafactor does not:
its factored second moment averages squared gradients over rows and over columns, and one of the two
always spans the sharded dimension. torch 2.13's implementation then applies in-place ops to a partial
(not yet reduced) norm, which DTensor refuses (pytorch#109581). :func:`adapt_optimizer` makes such an
optimizer step its DTensor parameters with the same algorithm written out of place, so DTensor inserts
the one all-reduce per factored moment; plain tensors still take torch's own path.

Multi-tensor (``foreach``) and fused kernels refuse a list mixing DTensors and plain tensors ("got mixed
torch.Tensor and DTensor"). Tensor parallelism without sequence parallelism (or a user plan) leaves norms and
other small parameters plain, and where no FSDP wraps them (dp = 1, or DDP) a parameter group holds both kinds;
on CUDA torch picks ``foreach`` by default, so a plain ``AdamW(model.parameters())`` would fail at its first step.
:func:`adapt_optimizer` runs such groups with the per-parameter implementation instead.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

__all__ = ["ShardedAdafactor", "adapt_optimizer"]


class ShardedAdafactor(torch.optim.Adafactor):
    """``torch.optim.Adafactor`` that is exact on sharded DTensor parameters (same state, same math).

    DTensor parameters are updated while ``step`` gathers its parameters (``_init_group``, after the closure
    has produced gradients) and are not handed on; plain parameters continue down torch's own path. Every
    way of calling ``step`` passes through ``_init_group``, including the wrapper an LR scheduler installs.
    """

    def _init_group(self, group: dict[str, Any], *lists: list) -> bool:
        sharded = [p for p in group["params"] if isinstance(p, DTensor)]
        plain = [p for p in group["params"] if not isinstance(p, DTensor)]
        has_complex = super()._init_group({**group, "params": plain}, *lists)
        sharded_lists: tuple[list, ...] = tuple([] for _ in lists)
        super()._init_group({**group, "params": sharded}, *sharded_lists)
        eps1, eps2 = group["eps"]
        for values in zip(*sharded_lists):
            _adafactor_step(*values, d=group["d"], lr=group["lr"], beta2_decay=group["beta2_decay"],
                            weight_decay=group["weight_decay"], eps1=eps1, eps2=eps2, maximize=group["maximize"])
        return has_complex


def adapt_optimizer(optimizer: Optimizer) -> Optimizer:
    """Make ``optimizer`` (the same object: LR schedulers stay attached) able to step DTensor parameters."""
    if type(optimizer) is torch.optim.Adafactor:
        optimizer.__class__ = ShardedAdafactor
    for index, group in enumerate(optimizer.param_groups):
        if len({isinstance(p, DTensor) for p in group["params"]}) < 2:
            continue
        asked = [flag for flag in ("foreach", "fused") if group.get(flag)]
        if asked and (not dist.is_initialized() or dist.get_rank() == 0):
            warnings.warn(
                f"{type(optimizer).__name__} parameter group {index} mixes DTensor and plain parameters, which"
                f" {' and '.join(asked)} kernels cannot take: it steps them one at a time instead (tensor"
                " parallelism left some parameters unsharded, and no ZeRO over data-parallel ranks wraps them).",
                stacklevel=2)
        for flag in ("foreach", "fused"):
            if flag in group:
                group[flag] = False
    return optimizer


def _adafactor_step(
    param: Tensor,
    grad: Tensor,
    row_var: Optional[Tensor],
    col_var: Optional[Tensor],
    variance: Optional[Tensor],
    step: Tensor,
    *,
    d: float,
    lr: float,
    beta2_decay: float,
    weight_decay: float,
    eps1: Optional[float],
    eps2: float,
    maximize: bool,
) -> None:
    """torch 2.13's single-tensor Adafactor update; reductions that may be partial are never updated in place."""
    lr = float(lr)
    grad = -grad if maximize else grad
    eps1 = torch.finfo(param.dtype).eps if eps1 is None else eps1
    step += 1
    step_float = step.item()
    one_minus_beta2 = step_float**beta2_decay
    rho = min(lr, 1 / step_float**0.5)
    alpha = max(eps2, _item(param.norm(2)) / param.numel() ** 0.5) * rho
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    if grad.dim() > 1:
        assert row_var is not None and col_var is not None
        row_var.lerp_(torch.norm(grad, dim=-1, keepdim=True).square().div(grad.size(-1)), one_minus_beta2)
        col_var.lerp_(torch.norm(grad, dim=-2, keepdim=True).square().div(grad.size(-2)), one_minus_beta2)
        estimate = (row_var @ col_var).div(row_var.mean(dim=-2, keepdim=True).clamp(min=eps1))
    else:
        assert variance is not None
        variance.lerp_(grad * grad, one_minus_beta2)
        estimate = variance.clone()
    update = estimate.clamp(min=eps1 * eps1).rsqrt().mul(grad)
    denom = max(1.0, _item(update.norm(2)) / (update.numel() ** 0.5 * d))
    param.add_(update, alpha=-alpha / denom)


def _item(value: Tensor) -> float:
    # DTensor.item() of a not-yet-reduced norm returns this rank's partial value; reduce first.
    return (value.full_tensor() if isinstance(value, DTensor) else value).item()
