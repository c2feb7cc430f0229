"""Offload: optimizer state (with the fp32 parameter shards and gradients it steps) and chosen blocks'
activations to host memory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import nn

from meshlight.parallel.blocks import BlockSelection
from meshlight.parallel.offload import OffloadPolicy, apply_activation_offload
from meshlight.parallel.transforms import PolicySource
from meshlight.strategies.mesh import MeshStrategy

__all__ = ["Offload", "OffloadError"]


class OffloadError(ValueError):
    """The Offload callback cannot run with this Trainer."""


class Offload(PolicySource, Callback):
    """Free accelerator memory by keeping state in host memory.

    Args:
        optimizer: keep the optimizer state in host memory — with the fp32 parameter shards and gradient shards
            it steps, since FSDP2 runs the optimizer where its state is (its CPU offload policy). The accelerator
            then holds parameters only gathered, while their FSDP unit computes.
        activations_every_n_blocks: also move the activations that every N-th repeated block saves for backward
            to host memory (1 = every block); they come back one block ahead during backward.
        activation_module_types: instead, offload the activations of every module of these types.
        pin_memory: page-locked host buffers, for asynchronous copies (CUDA only).

    Works under every meshlight strategy; optimizer offload makes data parallelism run on FSDP2 (shard groups
    of one rank where the layout shards nothing). Activation offload also works under Lightning's strategies.
    Offloaded activations are applied after recomputation: combined, a recomputed block offloads the inputs
    it keeps.
    """

    def __init__(
        self,
        optimizer: bool = True,
        activations_every_n_blocks: Optional[int] = None,
        activation_module_types: Sequence[type[nn.Module]] = (),
        pin_memory: bool = True,
    ) -> None:
        activations = None
        if activations_every_n_blocks is not None or activation_module_types:
            activations = BlockSelection(activations_every_n_blocks or 1, tuple(activation_module_types))
        if not optimizer and activations is None:
            raise OffloadError("Offload(optimizer=False) with no activations to offload does nothing: pass "
                               "activations_every_n_blocks=1 (or activation_module_types), or drop the callback.")
        self.policy = OffloadPolicy(optimizer, activations, pin_memory)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, MeshStrategy):  # it collects the policy while parallelizing
            return
        if self.policy.optimizer:
            raise OffloadError(
                f"Offload(optimizer=True) runs under meshlight's strategies and {type(strategy).__name__} is not one:"
                " use ml.Trainer(strategy='zero3' | … | '3d'), or Offload(optimizer=False,"
                " activations_every_n_blocks=1)."
            )
        apply_activation_offload(pl_module, self.policy.activations, self.policy.pin_memory)
