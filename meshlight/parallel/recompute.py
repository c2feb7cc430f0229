"""Activation checkpointing (recomputation) of chosen transformer blocks, keeping every parameter's name.

A chosen block's ``forward`` runs under non-reentrant ``torch.utils.checkpoint``: its forward keeps only the
block's inputs, and the backward recomputes the rest (with the same random state, so dropout masks match).
Patching ``forward`` instead of wrapping the module (``checkpoint_wrapper``) leaves module and parameter names
as they were, so checkpoints, optimizer states and tensor-parallel plans see the same model. In the transform
order it comes after tensor and expert parallelism and before data parallelism (FSDP gathers a block's
parameters again before its recomputation, as for its backward).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from meshlight.parallel.data_parallel import repeated_blocks

__all__ = ["RecomputePolicy", "apply_recompute"]


@dataclass(frozen=True)
class RecomputePolicy:
    """Which blocks to recompute: every ``every_n_blocks``-th of the repeated blocks (1: all — full
    recomputation; 2: half of them, ...), or, when ``module_types`` is given, every module of those types."""

    every_n_blocks: int = 1
    module_types: Sequence[type[nn.Module]] = ()

    def __post_init__(self) -> None:
        if self.every_n_blocks < 1:
            raise ValueError(f"every_n_blocks={self.every_n_blocks} must be >= 1 (1 recomputes every block).")

    def select(self, module: nn.Module) -> list[nn.Module]:
        if self.module_types:
            return [m for m in module.modules() if isinstance(m, tuple(self.module_types))]
        blocks = repeated_blocks(module)
        return [block for i, block in enumerate(blocks) if i % self.every_n_blocks == self.every_n_blocks - 1]


def apply_recompute(module: nn.Module, policy: RecomputePolicy) -> list[nn.Module]:
    """Make the blocks ``policy`` selects in ``module`` recompute their activations in backward; returns them.
    Applying it twice to a block is a no-op."""
    chosen = policy.select(module)
    for block in chosen:
        if not getattr(block, "_meshlight_recompute", False):
            block.forward = _recomputed(block.forward)  # type: ignore[method-assign]
            block._meshlight_recompute = True
    return chosen


def _recomputed(forward: Any) -> Any:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
