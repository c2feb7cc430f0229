"""Mixed precision on FSDP2: low-precision parameters and compute, fp32 master weights and reductions.

FSDP2 keeps each rank's shard of every parameter in fp32 (the master weights the optimizer steps), gathers it
in ``param_dtype`` for forward and backward, and reduces gradients in ``reduce_dtype`` (fp32) into fp32
gradient shards. Modules that must stay fp32 — norms and MoE routers by default — become FSDP units of their
own that gather fp32 weights; their forward casts their inputs to fp32 and their outputs back to
``param_dtype`` (:func:`keep_fp32`), so the layers around them see the dtype they expect. Under mixed
precision every layout runs data parallelism on FSDP2 (shard groups of one rank where nothing is sharded):
that is where the low-precision copies live.

fp16's narrow range needs loss scaling: :class:`MeshGradScaler` is PyTorch's sharded gradient scaler whose
overflow check sees every rank's gradient shards, so all ranks — data, tensor and pipeline — skip the same steps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.utils._pytree import tree_map_only

from meshlight.nn.experts import Router
from meshlight.parallel.dtensors import local_tensor

__all__ = ["DTYPES", "FP32_UNIT", "MeshGradScaler", "PrecisionPolicy", "is_norm", "keep_fp32"]

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def is_norm(module: nn.Module) -> bool:
    """A leaf with parameters that are all vectors and is not a Linear or Embedding (LayerNorm, RMSNorm,
    user-written norms)."""
    params = list(module.parameters(recurse=False))
    return (not list(module.children()) and bool(params) and not isinstance(module, (nn.Linear, nn.Embedding))
            and all(p.dim() == 1 for p in params))


@dataclass(frozen=True)
class PrecisionPolicy:
    """``param_dtype`` for parameters and compute, ``reduce_dtype`` for gradient reductions; modules of
    ``fp32_module_types``, MoE routers and (``fp32_norms``) norms keep fp32 weights and compute."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    fp32_module_types: Sequence[type[nn.Module]] = ()
    fp32_norms: bool = True

    def __post_init__(self) -> None:
        if self.param_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"param_dtype={self.param_dtype}: mixed precision takes torch.bfloat16 or torch.float16.")

    @property
    def fsdp(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)

    def fp32_units(self, module: nn.Module) -> list[tuple[nn.Module, Optional[torch.dtype]]]:
        """The outermost submodules of ``module`` (not ``module`` itself) that keep fp32, each with the dtype
        its outputs are cast back to for the layers after them: ``param_dtype`` — except routers, whose fp32
        scores the MoE layer casts itself where it combines (None)."""
        types = (Router, *self.fp32_module_types)
        units: list[tuple[nn.Module, Optional[torch.dtype]]] = []
        inside: set[int] = set()
        for sub in module.modules():
            if sub is module or id(sub) in inside:
                continue
            if isinstance(sub, types) or (self.fp32_norms and is_norm(sub)):
                units.append((sub, None if isinstance(sub, Router) else self.param_dtype))
                inside.update(id(m) for m in sub.modules())
        return units


#: The FSDP policy of an fp32 unit: fp32 weights, gathered and reduced in fp32; its forward casts (keep_fp32).
FP32_UNIT = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)


def keep_fp32(module: nn.Module, output_dtype: Optional[torch.dtype],
              compile_arguments: Optional[Mapping[str, Any]] = None) -> None:
    """Make ``module`` compute in fp32: its forward casts floating inputs to fp32 and floating outputs to
    ``output_dtype`` (None: left fp32) — what FSDP2's ``cast_forward_inputs`` and ``output_dtype`` would do, but
    inside the forward, so that with ``compile_arguments`` (``torch.compile``'s) the casts and the module compile
    together. The module is an FSDP unit of its own inside a compiled
    block, whose hooks dynamo does not trace: without this its casts and its computation would run eagerly in
    fp32 between the block's compiled pieces, and the fp32 copy of its input would be kept for backward.

    A forward set on the module itself (by recomputation or compilation chosen by module type, or by the user)
    is kept, with the casts around it, uncompiled."""
    inner = module.__dict__.get("forward")
    if inner is not None:
        module.forward = functools.partial(_cast_around, inner, output_dtype)  # type: ignore[method-assign]
        return
    run = torch.compile(_run_in_fp32, **compile_arguments) if compile_arguments is not None else _run_in_fp32
    # the module is an argument, not a closure: the modules of one type (every block's norms) share one compilation
    module.forward = functools.partial(run, module, output_dtype)  # type: ignore[method-assign]


def _run_in_fp32(module: nn.Module, output_dtype: Optional[torch.dtype], *args: Any, **kwargs: Any) -> Any:
    return _cast_around(functools.partial(type(module).forward, module), output_dtype, *args, **kwargs)


def _cast_around(forward: Callable[..., Any], output_dtype: Optional[torch.dtype], *args: Any, **kwargs: Any) -> Any:
    args, kwargs = tree_map_only(torch.Tensor, _cast(torch.float32), (args, kwargs))
    outputs = forward(*args, **kwargs)
    return outputs if output_dtype is None else tree_map_only(torch.Tensor, _cast(output_dtype), outputs)


def _cast(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda tensor: tensor.to(dtype) if tensor.is_floating_point() else tensor


class MeshGradScaler(ShardedGradScaler):
    """Loss scaling for fp16 under any layout: the overflow found in any rank's gradient shard is summed over
    ``process_group`` (default: every rank), so every rank skips the same steps and backs off the same scale.
    DTensor gradients are checked and unscaled through their local shards."""

    def _unscale_grads_(self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool = True) -> dict[torch.device, torch.Tensor]:
        local = [
            SimpleNamespace(grad=local_tensor(p.grad) if p.grad is not None else None)
            for group in optimizer.param_groups for p in group["params"]
        ]
        return super()._unscale_grads_(SimpleNamespace(param_groups=[{"params": local}]), inv_scale, found_inf,
                                       allow_fp16)

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler, device: str) -> MeshGradScaler:
        """A scaler with ``scaler``'s settings (Lightning's "16-mixed" makes a plain one)."""
        return cls(device=device, init_scale=scaler.get_scale() if scaler.is_enabled() else 2.0**16,
                   growth_factor=scaler.get_growth_factor(), backoff_factor=scaler.get_backoff_factor(),
                   growth_interval=scaler.get_growth_interval(), enabled=scaler.is_enabled())
