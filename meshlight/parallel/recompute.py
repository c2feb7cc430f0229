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
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from meshlight.parallel.blocks import BlockSelection

__all__ = ["RecomputePolicy", "apply_recompute"]


@dataclass(frozen=True)
class RecomputePolicy(BlockSelection):
    """The blocks whose activations are recomputed in backward (every repeated block by default)."""


def apply_recompute(module: nn.Module, policy: BlockSelection) -> list[nn.Module]:
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
