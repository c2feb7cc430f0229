"""Stacked experts read from files that hold each expert apart.

Hugging Face's MoE models hold their experts stacked (``experts.gate_up_proj`` ``[E, 2·I, H]``,
``experts.down_proj`` ``[E, H, I]``), but their files — the Hub's, and what ``save_pretrained`` writes — keep the
older layout, one weight per expert and projection: Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2.weight``,
Qwen-MoE's ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``; transformers stacks them as it loads. Here each rank
reads, of each per-expert tensor, only the rows and columns its block of the stacked weight covers (safetensors
slices), so a model split over ep and tp reads its experts' parts and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
from torch import Tensor

from meshlight.parallel.dtensors import block_to_fill, from_blocks

__all__ = ["Sources", "file_names", "per_expert_sources", "read_per_expert"]

#: stacked weight → the per-expert weights it stacks, in the order the stacked rows hold them (one tuple per naming)
_PARTS = {"gate_up_proj": (("w1", "w3"), ("gate_proj", "up_proj")), "down_proj": (("w2",), ("down_proj",))}
#: (the model's, the files') names of a MoE block where its files keep an older one (Mixtral's)
_RENAMED = ((".mlp.", ".block_sparse_moe."),)
#: the files' keys a stacked expert weight stacks: ``sources[expert][part]``
Sources = list[list[str]]


def file_names(key: str) -> list[str]:
    """The names weight ``key`` may have in Hugging Face files: its own, then the older ones of its MoE block."""
    return [key, *(key.replace(new, old) for new, old in _RENAMED if new in key)]


def per_expert_sources(key: str, shape: tuple[int, ...], stored: Mapping[str, tuple[Any, ...]]) -> Optional[Sources]:
    """The files' keys that stacked expert weight ``key`` (``[E, rows, columns]``) stacks — each part ``[rows / parts,
    columns]`` — or ``None`` where the files do not hold them so (``stored``: key → (shape, …))."""
    parent, _, name = key.rpartition(".")
    if len(shape) != 3 or not parent.endswith(".experts"):
        return None
    for holder in file_names(parent + "."):
        holder = holder.removesuffix(".")
        for parts in _PARTS.get(name, ()):
            sources = [[f"{holder}.{e}.{part}.weight" for part in parts] for e in range(shape[0])]
            part_shape = (shape[1] // len(parts), shape[2])
            if all(tuple(stored.get(k, ((),))[0]) == part_shape for row in sources for k in row):
                return sources
    return None


def read_per_expert(slice_of: Callable[[str], Any], targets: Mapping[str, tuple[Tensor, Sources]]) -> None:
    """Fill each target (a stacked expert weight, plain or a DTensor: this rank's block of it) from the per-expert
    tensors ``sources[e][part]`` that :func:`per_expert_sources` found, each key's sliceable view from ``slice_of``
    (safetensors' ``get_slice``, or a memory-mapped tensor)."""
    for tensor, sources in targets.values():
        block, local, offset = block_to_fill(tensor)  # a fused weight split part by part: read as its plain blocks
        rows = block.shape[1] // len(sources[0])  # of each part
        first, top, left = offset
        for e in range(first, first + local.shape[0]):
            for index, key in enumerate(sources[e]):
                start, stop = max(top, index * rows), min(top + local.shape[1], (index + 1) * rows)
                if start >= stop:
                    continue
                part = slice_of(key)[start - index * rows:stop - index * rows, left:left + local.shape[2]]
                with torch.no_grad():
                    local[e - first, start - top:stop - top].copy_(part)
        from_blocks(tensor, block)
