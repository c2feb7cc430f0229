"""Mixed precision on FSDP2: low-precision parameters and compute, fp32 master weights and reductions.

FSDP2 keeps each rank's shard of every parameter in fp32 (the master weights the optimizer steps), gathers it
in ``param_dtype`` for forward and backward, and reduces gradients in ``reduce_dtype`` (fp32) into fp32
gradient shards. Modules that must stay fp32 — norms and MoE routers by default — become FSDP units of their
own whose policy gathers fp32 weights, casts their inputs to fp32 and their outputs back to ``param_dtype``,
so the layers around them see the dtype they expect. Under mixed precision every layout runs data parallelism
on FSDP2 (shard groups of one rank where nothing is sharded) since that is where the casting lives.

fp16's narrow range needs loss scaling: :class:`MeshGradScaler` is PyTorch's sharded gradient scaler whose
overflow check sees every rank's gradient shards, so all ranks — data, tensor and pipeline — skip the same steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from meshlight.nn.moe import Router

__all__ = ["DTYPES", "MeshGradScaler", "PrecisionPolicy", "is_norm"]

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
    ``fp32_module_types`` (besides norms and MoE routers, which always are) keep fp32 weights and compute."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    fp32_module_types: Sequence[type[nn.Module]] = ()

    def __post_init__(self) -> None:
        if self.param_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"param_dtype={self.param_dtype}: mixed precision takes torch.bfloat16 or torch.float16.")

    @property
    def fsdp(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)

    def fp32_units(self, module: nn.Module) -> list[tuple[nn.Module, MixedPrecisionPolicy]]:
        """The outermost submodules of ``module`` (not ``module`` itself) that keep fp32, each with its FSDP
        policy: fp32 weights and inputs, outputs cast back to ``param_dtype`` for the layers after them —
        except routers, whose fp32 scores the MoE layer casts itself where it combines."""
        types = (Router, *self.fp32_module_types)
        units: list[tuple[nn.Module, MixedPrecisionPolicy]] = []
        inside: set[int] = set()
        for sub in module.modules():
            if sub is module or id(sub) in inside:
                continue
            if isinstance(sub, types) or is_norm(sub):
                output = None if isinstance(sub, Router) else self.param_dtype
                units.append((sub, MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                                        output_dtype=output)))
                inside.update(id(m) for m in sub.modules())
        return units


class MeshGradScaler(ShardedGradScaler):
    """Loss scaling for fp16 under any layout: the overflow found in any rank's gradient shard is summed over
    ``process_group`` (default: every rank), so every rank skips the same steps and backs off the same scale.
    DTensor gradients are checked and unscaled through their local shards."""

    def _unscale_grads_(self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool = True) -> dict[torch.device, torch.Tensor]:
        local = [
            SimpleNamespace(grad=p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
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
