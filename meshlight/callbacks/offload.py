"""Offload: optimizer state (with the fp32 parameter shards and gradients it steps) and chosen blocks'
activations to host memory; the optimizer state further, to files on a local disk."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import nn

from meshlight.parallel.blocks import BlockSelection
from meshlight.parallel.nvme import check_disk
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
            then holds parameters only gathered, while their FSDP unit computes. ``"nvme"``: besides, keep the
            optimizer state in files under ``path`` (a local disk) between steps, read back chunk by chunk ahead of
            each step's use and written behind it by a background thread (:mod:`meshlight.parallel.nvme`).
        path: the folder for ``optimizer="nvme"`` (each rank writes under ``rank-<rank>``); checked before training
            for existing, writable and with room for the node's ranks' state.
        nvme_chunk_mb: the state read, stepped and written at a time with ``"nvme"`` (whole parameters: at least
            one parameter's); host memory holds three such chunks at once.
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
        optimizer: Union[bool, str] = True,
        activations_every_n_blocks: Optional[int] = None,
        activation_module_types: Sequence[type[nn.Module]] = (),
        pin_memory: bool = True,
        path: Union[str, Path, None] = None,
        nvme_chunk_mb: float = 32,
    ) -> None:
        if optimizer not in (True, False, "host", "nvme"):
            raise OffloadError(f"Offload(optimizer={optimizer!r}): give True (or 'host': host memory), 'nvme' (files"
                               " on a local disk, with path=...) or False.")
        if (optimizer == "nvme") != (path is not None):
            raise OffloadError("Offload(optimizer='nvme') needs path=<a folder on a local disk>; path applies to"
                               f" optimizer='nvme' only (got optimizer={optimizer!r}, path={path!r}).")
        nvme = Path(path) if path is not None else None
        if nvme is not None:
            check_disk(nvme, needed=0)  # missing or not writable: refused now; the room needed is checked at setup
        activations = None
        if activations_every_n_blocks is not None or activation_module_types:
            activations = BlockSelection(activations_every_n_blocks or 1, tuple(activation_module_types))
        if not optimizer and activations is None:
            raise OffloadError("Offload(optimizer=False) with no activations to offload does nothing: pass "
                               "activations_every_n_blocks=1 (or activation_module_types), or drop the callback.")
        self.policy = OffloadPolicy(bool(optimizer), activations, pin_memory, nvme, int(nvme_chunk_mb * 2**20))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, MeshStrategy):  # it collects the policy while parallelizing
            return
        if self.policy.optimizer:
            raise OffloadError(
                f"Offload(optimizer=True) runs under meshlight's strategies and {type(strategy).__name__} is not one:"
                " use ml.Trainer (on one device it runs meshlight's 'ddp', a mesh of one process) or"
                " ml.Trainer(strategy='zero3' | … | '3d'), or Offload(optimizer=False, activations_every_n_blocks=1)."
            )
        apply_activation_offload(pl_module, self.policy.activations, self.policy.pin_memory)
