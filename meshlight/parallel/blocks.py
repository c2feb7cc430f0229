"""Where a model's repeated blocks are: the units that FSDP gathers one at a time, that pipeline stages are cut
between, and that recomputation, compilation and activation offload choose among."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

__all__ = ["BlockSelection", "holds_blocks", "repeated_blocks"]


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The entries of the outermost containers of blocks (:func:`holds_blocks`) that hold parameters.

    These are a transformer's blocks: the units that FSDP gathers one at a time and that pipeline
    stages and activation checkpointing work on.
    """
    blocks: list[nn.Module] = []
    for child in module.children():
        if holds_blocks(child):
            entries = child.values() if isinstance(child, nn.ModuleDict) else child
            blocks.extend(entry for entry in entries if next(entry.parameters(), None) is not None)
        else:
            blocks.extend(repeated_blocks(child))
    return blocks


def holds_blocks(module: nn.Module) -> bool:
    """Whether ``module`` is a container of blocks: a non-empty ``nn.ModuleList``, or an ``nn.ModuleDict`` whose
    entries are all of one type. A ``ModuleDict`` of different pieces (nanoGPT's ``transformer`` of ``wte``,
    ``wpe``, the block list ``h`` and ``ln_f``) is a namespace: the blocks are inside it."""
    if isinstance(module, nn.ModuleList):
        return len(module) > 0
    return isinstance(module, nn.ModuleDict) and len({type(entry) for entry in module.values()}) == 1


@dataclass(frozen=True)
class BlockSelection:
    """Which blocks a transform (recomputation, activation offload) applies to: every ``every_n_blocks``-th of
    the repeated blocks (1: all of them; 2: half of them, ...), or, when ``module_types`` is given, every module
    of those types."""

    every_n_blocks: int = 1
    module_types: Sequence[type[nn.Module]] = ()

    def __post_init__(self) -> None:
        if self.every_n_blocks < 1:
            raise ValueError(f"every_n_blocks={self.every_n_blocks} must be >= 1 (1 chooses every block).")

    def select(self, module: nn.Module) -> list[nn.Module]:
        if self.module_types:
            return [m for m in module.modules() if isinstance(m, tuple(self.module_types))]
        blocks = repeated_blocks(module)
        return [block for i, block in enumerate(blocks) if i % self.every_n_blocks == self.every_n_blocks - 1]
