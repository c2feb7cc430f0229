"""ActivationCheckpointing: recompute chosen blocks' activations in backward instead of keeping them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import nn

from meshlight.parallel.recompute import RecomputePolicy, apply_recompute
from meshlight.parallel.transforms import PolicySource
from meshlight.strategies.mesh import MeshStrategy

__all__ = ["ActivationCheckpointing"]


class ActivationCheckpointing(PolicySource, Callback):
    """Trade compute for memory: the chosen blocks keep only their inputs in forward and recompute the rest
    during backward (non-reentrant ``torch.utils.checkpoint``; dropout masks reproduce exactly).

    Args:
        every_n_blocks: recompute every N-th of the model's repeated blocks (the entries of its outermost
            ``ModuleList``): 1 = all of them (full recomputation), 2 = every second one (selective), …
        module_types: instead, recompute every module of these types (e.g. ``(MyAttention,)``).

    Under meshlight's strategies it is applied at its place in the transform order — after tensor and expert
    parallelism, before data parallelism — on every pipeline stage. Under other strategies it is applied to
    the LightningModule before training. Module and parameter names are unchanged (checkpoints load either way).
    """

    def __init__(self, every_n_blocks: int = 1, module_types: Optional[Sequence[type[nn.Module]]] = None) -> None:
        self.policy = RecomputePolicy(every_n_blocks, tuple(module_types or ()))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, MeshStrategy):  # meshlight's collect the policy while parallelizing
            apply_recompute(pl_module, self.policy)
