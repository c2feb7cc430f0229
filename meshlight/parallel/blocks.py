"""Where a model's repeated blocks are: the units that FSDP gathers one at a time, that pipeline stages are cut
between, and that recomputation, compilation and activation offload choose among."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshlight.parallel.dtensors import local_tensor

__all__ = ["BlockSelection", "claim_saved_tensor_hooks", "class_path", "holds_blocks", "record_in_forward",
           "repeated_blocks"]


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


def claim_saved_tensor_hooks(blocks: Sequence[nn.Module], transform: str) -> None:
    """Mark ``blocks`` as running their forward under ``transform``'s saved-tensor hooks. Only the innermost hooks
    see what a forward saves, so a block another such transform claimed is refused, naming both."""
    for block in blocks:
        owner = getattr(block, "_meshlight_saved_tensor_hooks", transform)
        if owner != transform:
            raise ValueError(f"{transform} and {owner} both chose {type(block).__name__} blocks: one set of"
                             " saved-tensor hooks applies to a block. Choose other blocks for one of them"
                             " (every_n_blocks / module_types), or drop one.")
    for block in blocks:
        block._meshlight_saved_tensor_hooks = transform


def record_in_forward(block: nn.Module, marker: str, run: Callable[..., Any]) -> None:
    """Patch ``block.forward`` (once per ``marker``) to call ``run(forward, kept, *args, **kwargs)`` when autograd
    records it — ``kept``: the storages of the block's parameters as they are now (gathered), which saved-tensor hooks
    leave alone — and the plain forward otherwise (evaluation, recomputation's first pass)."""
    if getattr(block, marker, False):
        return
    forward = block.forward

    @functools.wraps(forward)
    def patched(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        kept = {local_tensor(p).untyped_storage().data_ptr() for p in block.parameters()}
        return run(forward, kept, *args, **kwargs)

    block.forward = patched  # type: ignore[method-assign]
    setattr(block, marker, True)


def class_path(module: nn.Module) -> str:
    """``module``'s class as meshlight's tables of known model classes name it: ``package.module.Class``."""
    return f"{type(module).__module__}.{type(module).__qualname__}"
