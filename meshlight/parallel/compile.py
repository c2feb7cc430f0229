"""``torch.compile`` of chosen transformer blocks, one block at a time, keeping every parameter's name.

Each chosen block's ``forward`` is replaced by its compiled version (``torch.compile`` of the bound method), as
torchtitan compiles per block: the blocks of a transformer share their code, so one compilation serves them
all, and compiling is fast. Patching ``forward`` rather than wrapping the module (``torch.compile(module)``
returns an ``OptimizedModule`` whose parameters are renamed ``_orig_mod.…``) leaves module and parameter names
as they were, so checkpoints, optimizer states and tensor-parallel plans see the same model, with or without
compilation.

In the transform order it comes after tensor and expert parallelism and recomputation, and before activation
offload and data parallelism: the compiled code sees the block's DTensor parameters and its recomputation
(``torch.utils.checkpoint`` inside a compiled region is traced as one operator, as torchtitan relies on);
activation offload's saved-tensor hooks, which cannot be traced, run around the compiled ``forward`` and see the
tensors the compiled graph saves; DDP's and FSDP2's hooks, registered on the module afterwards, run around it
too (FSDP2 gathers the parameters before it and frees them after it). Where the blocks hold FSDP units of their
own (the modules mixed precision keeps fp32), whose hooks dynamo does not trace, compilation comes before
recomputation instead: the block compiles in pieces around those units, and a recomputed region with such a
break inside would run the whole block eagerly (``meshlight.parallel.parallelize``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from meshlight.parallel.blocks import BlockSelection

__all__ = ["CompilePolicy", "apply_compile"]


@dataclass(frozen=True)
class CompilePolicy:
    """Which blocks to compile (``blocks``: default every repeated block) and ``torch.compile``'s keyword
    arguments (``backend``, ``mode``, ``fullgraph``, ``dynamic``, ``options``)."""

    blocks: BlockSelection = field(default_factory=BlockSelection)
    arguments: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.arguments) - {"backend", "mode", "fullgraph", "dynamic", "options", "disable"}
        if unknown:
            raise ValueError(f"Unknown torch.compile arguments {sorted(unknown)}; choose among backend, mode,"
                             " fullgraph, dynamic, options and disable.")


def apply_compile(module: nn.Module, policy: CompilePolicy) -> list[nn.Module]:
    """Compile the ``forward`` of the blocks ``policy`` selects in ``module``; returns them. Applying it twice
    to a block is a no-op."""
    chosen = policy.blocks.select(module)
    for block in chosen:
        if not getattr(block, "_meshlight_compiled", False):
            compiled = torch.compile(block.forward, **policy.arguments)
            block.forward = _unaliased_inputs(compiled)  # type: ignore[method-assign]
            block._meshlight_compiled = True
    return chosen


def _unaliased_inputs(forward: Any) -> Any:
    """Hand a compiled forward a copy of each input that ``DTensor.to_local()`` made: a view, needing gradients, of
    a tensor that needs none (the DTensor's local tensor). Tensor parallelism hands the first block one (the token
    embedding's output, a stage's or the region's share of the sequence). PyTorch 2.13's compiled backward sent its
    gradient past ``to_local``'s backward, as a plain tensor into the DTensor redistribution before it ("'Tensor'
    object has no attribute '_local_tensor'"). The copy is one activation per such input."""

    def unaliased(value: Any) -> Any:
        if (isinstance(value, torch.Tensor) and value.requires_grad and value._is_view()
                and not value._base.requires_grad):
            return value.clone()
        return value

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return forward(*map(unaliased, args), **{name: unaliased(value) for name, value in kwargs.items()})

    return run
