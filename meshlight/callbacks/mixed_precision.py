"""MixedPrecision: bf16 or fp16 parameters and compute, fp32 master weights and reductions, fp32 exceptions."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from meshlight.parallel.precision import DTYPES, MeshGradScaler, PrecisionPolicy
from meshlight.parallel.transforms import PolicySource
from meshlight.strategies.mesh import MeshStrategy

__all__ = ["MixedPrecision", "MixedPrecisionError"]


class MixedPrecisionError(ValueError):
    """The MixedPrecision callback cannot run with this Trainer."""


class MixedPrecision(PolicySource, Callback):
    """Train with low-precision parameters and compute while the optimizer steps fp32 master weights.

    Args:
        dtype: ``"bf16"`` or ``"fp16"`` (or the torch dtype) for parameters and compute.
        fp32_modules: module types that stay fp32, besides norms (leaves with only vector parameters, see
            ``fp32_norms``) and MoE routers, which always do. Their inputs are cast to fp32 and their outputs back.
        reduce_dtype: the dtype gradients are reduced (and kept) in.
        init_scale, growth_interval: fp16 loss scaling (ignored for bf16): the first scale and how many steps
            without overflow double it. A step whose gradients overflow on any rank is skipped on all.
        fp32_norms: norms keep fp32 weights and compute (the default). ``False`` gathers their weights in
            ``dtype`` with the rest of their block, as torchtitan and Megatron-Core do (their master weights
            stay fp32, and PyTorch's LayerNorm and RMSNorm kernels accumulate in fp32): each norm is then no FSDP
            unit of its own, which under ``torch.compile`` saves a graph break and a gather per norm. A
            1B-parameter GPT's step on an H100 took 0.211–0.212 s this way, 0.214–0.229 s with fp32 norms
            (``benchmarks/RESULTS.md``).

    Works under every meshlight strategy (ddp, zero1–3, tp, pipeline, moe, 3d), through FSDP2's mixed
    precision policy: each rank's shard stays fp32, forward and backward gather it in ``dtype``, and gradients
    are reduced in fp32. Leave ``Trainer(precision=...)`` at its default ``"32-true"``; Lightning's own
    ``"bf16-mixed"`` (autocast) and ``"16-mixed"`` flags are the alternative, and also work under meshlight.
    """

    def __init__(
        self,
        dtype: Union[str, torch.dtype] = "bf16",
        fp32_modules: Sequence[type[nn.Module]] = (),
        reduce_dtype: torch.dtype = torch.float32,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        fp32_norms: bool = True,
    ) -> None:
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise MixedPrecisionError(f"dtype={dtype!r}: choose 'bf16' or 'fp16'.")
            dtype = DTYPES[dtype]
        self.policy = PrecisionPolicy(dtype, reduce_dtype, tuple(fp32_modules), fp32_norms)
        self._scaling = {"init_scale": init_scale, "growth_interval": growth_interval}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, MeshStrategy):
            raise MixedPrecisionError(
                f"MixedPrecision runs under meshlight's strategies and {type(strategy).__name__} is not one: use"
                " ml.Trainer (on one device it runs meshlight's 'ddp', a mesh of one process) or"
                " ml.Trainer(strategy='ddp' | 'zero1' | … | '3d'), or Lightning's precision='bf16-mixed' flag."
            )
        if type(strategy.precision_plugin) is not Precision and not isinstance(
            strategy.precision_plugin, _ScaledLowPrecision
        ):
            raise MixedPrecisionError(
                f"Trainer(precision={trainer.precision!r}) and the MixedPrecision callback both set the precision:"
                " remove one (the callback needs the default precision='32-true')."
            )
        if self.policy.param_dtype == torch.float16 and stage == "fit":
            device = strategy.root_device.type
            strategy.precision_plugin = _ScaledLowPrecision(device, MeshGradScaler(device=device, **self._scaling))


class _ScaledLowPrecision(LightningMixedPrecision):
    """Lightning's fp16 plugin (loss scaling, unscaling before clipping, skipped steps) without autocast: the
    parameters are already fp16 and the fp32 exceptions are handled where the model was parallelized."""

    def __init__(self, device: str, scaler: MeshGradScaler) -> None:
        super().__init__("16-mixed", device, scaler)

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        yield
