"""PEFT's LoRA on a module's parameters (``ParamWrapper``: ``target_parameters``), which PEFT adds to the parameter in
place, and the form of it that follows a model's stacked experts split over ranks (:class:`ExpertAdapters`). Kept
apart from :mod:`meshlight.parallel.adapters` (LoRA on Linears, as tensor-parallel plans see it), which reads model
shapes that read the experts."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshlight.parallel.collectives import sum_in_backward
from meshlight.parallel.expert_tensor import local_slice

__all__ = ["ExpertAdapters", "adapters_of", "adapts_parameter", "parameter_adapters"]


def adapts_parameter(module: nn.Module) -> bool:
    """Whether ``module`` is PEFT's LoRA on a module's parameter (``ParamWrapper``: :func:`parameter_adapters`)."""
    return isinstance(getattr(module, "parameter_name", None), str) and isinstance(
        getattr(module, "lora_A", None), nn.ModuleDict)


def parameter_adapters(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """PEFT's LoRA layers on a module's parameters (``ParamWrapper``: ``target_parameters``, which PEFT also sets for
    an MoE model's stacked experts where ``target_modules`` names ``gate_proj``, ``up_proj`` or ``down_proj``), by
    name, outermost first (PEFT nests one per parameter)."""
    return [(name, module) for name, module in model.named_modules() if adapts_parameter(module)]


def adapters_of(model: nn.Module, module: nn.Module) -> dict[str, nn.Module]:
    """PEFT's LoRA layers in ``model`` on ``module``'s parameters (:func:`parameter_adapters`), by parameter name."""
    return {wrapper.parameter_name: wrapper for _, wrapper in parameter_adapters(model)
            if wrapper.get_base_layer() is module}


class ExpertAdapters:
    """PEFT's LoRA on a stacked-experts module's weights (``wrappers``: parameter name → ``ParamWrapper``) whose
    weights are split over ranks: this rank, at mesh ``coordinates`` (``(rank, size)`` per mesh dim), holds the block
    ``placements(name)`` gives of each — its experts (``Shard(0)`` over ep) and, each expert split over tp, its rows or
    columns of them. PEFT's wrapper would add each active adapter's update to the whole stack; here each wrapper's
    forward passes straight to its base layer, and the module's split forward adds to this rank's block the same block
    of the update (:meth:`adapted`): PEFT's own factors (``get_delta_factors``: ``lhs`` [experts, rows, r] times
    ``rhs`` [experts, r, columns], ``lora_B`` holding the experts innermost), ``lhs`` cut by the weight's experts and
    rows, ``rhs`` by its experts and columns. The factors stay whole on every rank (rank-r per expert: small), dense
    weights like the others: each rank's gradient holds its block's part, and summed over ``group`` (the tp ranks,
    which hold other experts or other slices of them) and averaged over the data ranks as any dense weight's, it is
    one process's — every token's contribution counted once, by the rank its expert ran on."""

    def __init__(self, wrappers: Mapping[str, nn.Module], coordinates: list[tuple[int, int]],
                 placements: Callable[[str], list[Placement]],
                 group: Optional[torch.distributed.ProcessGroup] = None) -> None:
        self.wrappers, self.coordinates, self.placements, self.group = dict(wrappers), coordinates, placements, group
        for wrapper in self.wrappers.values():
            wrapper.forward = functools.partial(_to_base_layer, wrapper)

    def adapted(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """This rank's block ``weight`` of parameter ``name`` plus each active adapter's update of it, in ``weight``'s
        dtype as PEFT folds it (``baddbmm``, autocast off)."""
        wrapper = self.wrappers.get(name)
        if wrapper is None or wrapper.disable_adapters or wrapper.merged:
            return weight
        placements = self.placements(name)
        for adapter in wrapper.active_adapters:
            if adapter not in wrapper.lora_A:
                continue
            lhs, rhs, scaling = wrapper.get_delta_factors(adapter)
            if self.group is not None:
                lhs, rhs = sum_in_backward(lhs, self.group), sum_in_backward(rhs, self.group)
            lhs = local_slice(lhs, self.coordinates, [_on_dims(p, (0, 1)) for p in placements])
            rhs = local_slice(rhs, self.coordinates, [_on_dims(p, (0, 2)) for p in placements])
            with torch.autocast(device_type=weight.device.type, enabled=False):
                weight = torch.baddbmm(weight, lhs, rhs, alpha=scaling)
        return weight


def _on_dims(placement: Placement, dims: tuple[int, ...]) -> Placement:
    """``placement`` where it cuts one of ``dims`` (by blocks, or part by part); else ``Replicate()`` (a factor's rank
    dim is never cut)."""
    return placement if isinstance(placement, (Shard, _StridedShard)) and placement.dim in dims else Replicate()


def _to_base_layer(wrapper: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A ``ParamWrapper``'s forward under :class:`ExpertAdapters`: its base layer's, which adds the updates."""
    wrapper._check_forward_args(x, *args, **kwargs)
    return wrapper.base_layer(x, *args, **kwargs)
