"""Low-rank adapters (PEFT's LoRA) on a model's Linears, as tensor parallelism sees them.

A LoRA layer holds the Linear it adapts (``base_layer``) beside ``lora_A`` and ``lora_B``, one Linear each per
adapter, and computes ``base(x) + B(A(dropout(x))) · scaling``. Tensor-parallel plans read a model's structure — its
Linears, their widths, who owns them — and an adapter's own Linears would read as a projection group of their own.
So plans are made on the model as it would be without its adapters (:func:`adapters_unwrapped`: each base Linear
where its adapter layer stands, under the same name), and the adapter layer takes the role its Linear got, split by
:class:`~meshlight.parallel.tensor_styles.LowRankColwise` or
:class:`~meshlight.parallel.tensor_styles.LowRankRowwise`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Optional, TypeVar

from torch import nn

from meshlight.parallel.model_shape import linear_widths

__all__ = ["adapted_linear", "adapters_unwrapped", "check_splittable_adapter", "check_splittable_adapters",
           "read_without_adapters"]

F = TypeVar("F", bound=Callable[..., Any])


def adapted_linear(module: nn.Module) -> Optional[nn.Module]:
    """The Linear (``nn.Linear`` or Hugging Face's ``Conv1D``) that ``module`` adapts, where ``module`` is a LoRA
    layer holding one (PEFT's: ``base_layer`` beside the ``lora_A`` and ``lora_B`` of its adapters); else None."""
    base, down, up = (getattr(module, name, None) for name in ("base_layer", "lora_A", "lora_B"))
    if isinstance(down, nn.ModuleDict) and isinstance(up, nn.ModuleDict) and len(down) and linear_widths(base):
        return base
    return None


@contextmanager
def adapters_unwrapped(model: nn.Module) -> Iterator[None]:
    """Within it, each LoRA layer of ``model`` is replaced by the Linear it adapts, under the layer's name (and put
    back on leaving, whatever happened): the structure the tensor-parallel plan and the planner read. Nested use is
    a no-op inside."""
    swapped = []
    for name, module in list(model.named_modules()):
        if name and (base := adapted_linear(module)) is not None:
            parent_name, _, attribute = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            parent._modules[attribute] = base  # (not setattr: its order among the parent's children is kept)
            swapped.append((parent, attribute, module))
    try:
        yield
    finally:
        for parent, attribute, module in reversed(swapped):
            parent._modules[attribute] = module


def read_without_adapters(function: F) -> F:
    """``function(model, …)`` reading ``model`` as :func:`adapters_unwrapped` shows it."""

    @functools.wraps(function)
    def read(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with adapters_unwrapped(model):
            return function(model, *args, **kwargs)

    return read  # type: ignore[return-value]


def check_splittable_adapters(model: nn.Module, plan: Mapping[str, Any]) -> None:
    """Refuse, before anything is split, each LoRA layer of ``model`` that tensor parallelism's ``plan`` (name → role
    or style) cannot split (:func:`check_splittable_adapter`)."""
    for name, module in model.named_modules():
        if name in plan and adapted_linear(module) is not None:
            role = plan[name]
            check_splittable_adapter(name, module, role if isinstance(role, str) else type(role).__name__)


def check_splittable_adapter(name: str, module: nn.Module, role: str) -> None:
    """Refuse, naming the way out, a LoRA layer tensor parallelism cannot split: one on a Linear whose role is not
    ``colwise`` or ``rowwise`` (a fused q|k|v, the LM head, a replicated gate …), or holding weights beside its
    Linear's and its adapters' ``lora_A`` and ``lora_B`` (DoRA's magnitude vector), or an adapter variant PEFT runs
    otherwise (``lora_variant``)."""
    extra = sorted({n.split(".")[0] for n, _ in module.named_parameters()} - {"base_layer", "lora_A", "lora_B"})
    variants = sorted(getattr(module, "lora_variant", None) or ())
    if role in ("colwise", "rowwise") and not (extra or variants):
        return
    why = (f"it holds {', '.join(extra)} beside its adapters' lora_A and lora_B (DoRA's magnitude vector), which"
           " tensor parallelism does not split" if extra else
           f"its adapter {variants[0]!r} is a LoRA variant ({type(module.lora_variant[variants[0]]).__name__}), which"
           " tensor parallelism does not split" if variants else
           f"tensor parallelism gives its Linear the role {role!r}, and splits the adapters of 'colwise' and"
           " 'rowwise' Linears only")
    raise NotImplementedError(
        f"{name} is a LoRA layer ({type(module).__name__}), but {why}. Leave that module out of the adapter's"
        " target_modules (the attention's and MLP's separate projections split), use plain LoRA, or train it"
        " with tp=1 (data, ZeRO or pipeline parallelism)."
    )
