"""Warnings said once per job, by global rank 0: :mod:`meshlight.parallel` runs inside every rank and imports no
Lightning, whose ``rank_zero_warn`` does this for the layers above."""

from __future__ import annotations

import os
import warnings

import torch.distributed as dist

__all__ = ["global_rank", "rank_zero_warn"]

#: where launchers put a process's global rank before its process group exists (Lightning reads the same ones)
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def global_rank() -> int:
    """This process's rank in the world: the process group's once there is one, else what its launcher said (0
    when nothing did)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for name in RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def rank_zero_warn(message: str, stacklevel: int = 2) -> None:
    """``warnings.warn(message)`` on global rank 0 only; ``stacklevel`` counts from the caller, as there."""
    if global_rank() == 0:
        warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)
