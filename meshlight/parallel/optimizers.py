"""Let any torch optimizer step parameters that are sharded DTensors (ZeRO, tensor parallel).

Elementwise optimizers (SGD, Adam, AdamW, …) already run on DTensors shard by shard. Adafactor does not:
its factored second moment averages squared gradients over rows and over columns, and one of the two
always spans the sharded dimension. torch 2.13's implementation then applies in-place ops to a partial
(not yet reduced) norm, which DTensor refuses (pytorch#109581). :func:`adapt_optimizer` makes such an
optimizer step its DTensor parameters with the same algorithm written out of place, so DTensor inserts
the one all-reduce per factored moment, and with the two norms per parameter (of the parameter and of its
update) taken for all parameters at once; plain tensors still take torch's own path.

Multi-tensor (``foreach``) and fused kernels refuse a list mixing DTensors and plain tensors ("got mixed
torch.Tensor and DTensor"). Tensor parallelism leaves norms and other small parameters plain, and where no FSDP
wraps them (dp = 1, or DDP) a parameter group holds both kinds; on CUDA torch picks ``foreach`` by default, so a
plain ``AdamW(model.parameters())`` would fail at its first step. torch's elementwise optimizers (Adam, AdamW, SGD,
…) update each parameter from its own gradient and state and its group's hyper-parameters alone, so
:func:`adapt_optimizer` has them step such a group as two — its DTensors, then its plain tensors — each with the
kernels the group asks for (or torch's default), for the update only: the groups users, LR schedulers and
checkpoints see stay as they were. Other optimizers step such groups one parameter at a time.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from meshlight.parallel.rank_zero import rank_zero_warn

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
        _adafactor_steps(*sharded_lists, d=group["d"], lr=group["lr"], beta2_decay=group["beta2_decay"],
                         weight_decay=group["weight_decay"], eps1=eps1, eps2=eps2, maximize=group["maximize"])
        return has_complex


def adapt_optimizer(optimizer: Optimizer) -> Optimizer:
    """Make ``optimizer`` (the same object: LR schedulers stay attached) able to step DTensor parameters, also
    after a checkpoint's ``load_state_dict`` restores the flags another layout saved."""
    if type(optimizer) is torch.optim.Adafactor:
        optimizer.__class__ = ShardedAdafactor
    mixed = [index for index, group in enumerate(optimizer.param_groups)
             if len({isinstance(p, DTensor) for p in group["params"]}) == 2]
    if not mixed:
        return optimizer
    if isinstance(optimizer, ELEMENTWISE):
        _step_mixed_groups_apart(optimizer)
        return optimizer
    for index in mixed:
        group = optimizer.param_groups[index]
        asked = [flag for flag in ("foreach", "fused") if group.get(flag)]
        if asked:
            rank_zero_warn(
                f"{type(optimizer).__name__} parameter group {index} mixes DTensor and plain parameters, which"
                f" {' and '.join(asked)} kernels cannot take: it steps them one at a time instead (tensor"
                " parallelism left some parameters unsharded, and no ZeRO over data-parallel ranks wraps them).",
                stacklevel=2)

    def one_at_a_time(*_: object) -> None:
        for index in mixed:
            group = optimizer.param_groups[index]
            for flag in ("foreach", "fused"):
                if flag in group:
                    group[flag] = False

    one_at_a_time()
    optimizer.register_load_state_dict_post_hook(one_at_a_time)
    return optimizer


#: torch's optimizers whose update of a parameter reads only its gradient, its state and its group's
#: hyper-parameters (Adafactor too, but :class:`ShardedAdafactor` takes its DTensors apart itself)
ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adagrad,
               torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD, torch.optim.Rprop,
               torch.optim.Adadelta)


def _step_mixed_groups_apart(optimizer: Optimizer) -> None:
    """While ``optimizer`` updates (after its closure, if any, has made the gradients: the closure still sees the
    groups as they are), each group mixing DTensors and plain tensors is two groups, one of each; afterwards the
    groups are the same objects as before. A pre-hook hands ``step`` a closure that splits them once the user's
    returns; a post-hook puts them back, and a split left by an update that raised is put back before the next
    step and before the state is read."""
    whole: list[list[dict[str, Any]]] = []

    def split() -> None:
        whole.append(optimizer.param_groups)
        optimizer.param_groups = [part for group in optimizer.param_groups for part in _apart(group)]

    def join(*_: object) -> None:
        if whole:
            optimizer.param_groups = whole.pop()

    def before_step(_: Optimizer, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        join()
        closure = kwargs.pop("closure", args[1] if len(args) > 1 else None)

        def splitting_closure() -> Any:
            loss = closure() if closure is not None else None
            split()
            return loss

        return args[:1], {**kwargs, "closure": splitting_closure}

    optimizer.register_step_pre_hook(before_step)
    optimizer.register_step_post_hook(join)
    optimizer.register_state_dict_pre_hook(join)
    optimizer.register_load_state_dict_pre_hook(join)


def _apart(group: dict[str, Any]) -> list[dict[str, Any]]:
    """``group`` itself where its parameters are all of one kind, else a copy holding its DTensors and one its plain
    tensors (the same hyper-parameters)."""
    kinds = [[p for p in group["params"] if isinstance(p, DTensor) is sharded] for sharded in (True, False)]
    if not all(kinds):
        return [group]
    return [{**group, "params": params} for params in kinds]


def _adafactor_steps(
    params: list[Tensor],
    grads: list[Tensor],
    row_vars: list[Optional[Tensor]],
    col_vars: list[Optional[Tensor]],
    variances: list[Optional[Tensor]],
    steps: list[Tensor],
    *,
    d: float,
    lr: float,
    beta2_decay: float,
    weight_decay: float,
    eps1: Optional[float],
    eps2: float,
    maximize: bool,
) -> None:
    """torch 2.13's single-tensor Adafactor update of DTensor parameters. Reductions that may be partial are never
    updated in place; the two norms each parameter's update needs (its own and its update's) are taken for all
    parameters together, one all-reduce per sharded mesh dimension (:func:`_norms`) instead of one per parameter.
    The updates wait for their norms together: one more copy of the local shards while stepping, as in torch's
    multi-tensor (``foreach``) optimizers."""
    lr = float(lr)
    updates = []
    for param, grad, row_var, col_var, variance, step, norm in zip(
        params, grads, row_vars, col_vars, variances, steps, _norms(params)
    ):
        grad = -grad if maximize else grad
        eps = torch.finfo(param.dtype).eps if eps1 is None else eps1
        step += 1
        step_float = step.item()
        one_minus_beta2 = step_float**beta2_decay
        rho = min(lr, 1 / step_float**0.5)
        alpha = max(eps2, norm / param.numel() ** 0.5) * rho
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        if grad.dim() > 1:
            assert row_var is not None and col_var is not None
            row_var.lerp_(torch.norm(grad, dim=-1, keepdim=True).square().div(grad.size(-1)), one_minus_beta2)
            col_var.lerp_(torch.norm(grad, dim=-2, keepdim=True).square().div(grad.size(-2)), one_minus_beta2)
            estimate = (row_var @ col_var).div(row_var.mean(dim=-2, keepdim=True).clamp(min=eps))
        else:
            assert variance is not None
            variance.lerp_(grad * grad, one_minus_beta2)
            estimate = variance.clone()
        updates.append((estimate.clamp(min=eps * eps).rsqrt().mul(grad), alpha))
    for param, (update, alpha), norm in zip(params, updates, _norms([update for update, _ in updates])):
        denom = max(1.0, norm / (update.numel() ** 0.5 * d))
        param.add_(update, alpha=-alpha / denom)


def _norms(tensors: list[Tensor]) -> list[float]:
    """The 2-norm of each tensor as ``tensor.norm(2).item()`` gives it, in its dtype: for DTensors sharded alike
    (same mesh, sharded mesh dimensions and dtype) from one all-reduce of their shards' sums of squares per
    sharded dimension. Partial DTensors reduce on their own."""
    norms: list[float] = [0.0] * len(tensors)
    alike: dict[tuple, list[int]] = {}
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, DTensor) or any(p.is_partial() for p in tensor.placements):
            norms[index] = _item(tensor.norm(2))
            continue
        sharded = tuple(dim for dim, p in enumerate(tensor.placements) if not p.is_replicate())  # Shard, _StridedShard
        alike.setdefault((tensor.device_mesh, sharded, tensor.dtype), []).append(index)
    for (mesh, sharded, dtype), indices in alike.items():
        squares = torch.stack([tensors[i].to_local().detach().float().square().sum() for i in indices])
        for dim in sharded:
            dist.all_reduce(squares, group=mesh.get_group(dim))
        for index, norm in zip(indices, squares.sqrt().to(dtype).tolist()):
            norms[index] = norm
    return norms


def _item(value: Tensor) -> float:
    # DTensor.item() of a not-yet-reduced norm returns this rank's partial value; reduce first.
    return (value.full_tensor() if isinstance(value, DTensor) else value).item()
