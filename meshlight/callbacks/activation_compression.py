"""ActivationCompression: keep what chosen blocks save for backward in bf16 or fp8 instead of fp32."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import nn

from meshlight.parallel.activation_compression import ActivationCompressionPolicy, apply_activation_compression
from meshlight.parallel.blocks import BlockSelection
from meshlight.parallel.transforms import PolicySource
from meshlight.strategies.mesh import MeshStrategy

__all__ = ["ActivationCompression"]


class ActivationCompression(PolicySource, Callback):
    """Trade precision for memory: the activations the chosen blocks save for backward are stored in ``dtype``
    (``"bf16"``: half of fp32's bytes; ``"fp8_e4m3"``: a quarter, scaled per tensor) and restored for backward.

    Args:
        dtype: ``"bf16"`` or ``"fp8_e4m3"``.
        every_n_blocks: compress every N-th of the model's repeated blocks (1 = all of them).
        module_types: instead, compress inside every module of these types.

    Lossy: gradients see the activations rounded to the compressed dtype (see
    :mod:`meshlight.parallel.activation_compression`). Under meshlight's strategies it is applied at its place in
    the transform order on every pipeline stage; under other strategies, to the LightningModule before training.
    Module and parameter names are unchanged.
    """

    def __init__(self, dtype: str = "bf16", every_n_blocks: int = 1,
                 module_types: Optional[Sequence[type[nn.Module]]] = None) -> None:
        self.policy = ActivationCompressionPolicy(dtype, BlockSelection(every_n_blocks, tuple(module_types or ())))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, MeshStrategy):  # meshlight's collect the policy while parallelizing
            apply_activation_compression(pl_module, self.policy)
