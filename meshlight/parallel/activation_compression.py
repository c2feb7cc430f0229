"""Compressed saved activations: what autograd keeps for backward inside chosen blocks is stored in bf16 or fp8 and
restored to its own dtype when backward reads it.

A chosen block's forward runs under saved-tensor hooks (as Gist encodes activations between their forward and
backward use). Each floating-point tensor wider than the target dtype is cast down on the way in: to bf16 directly,
or to fp8 (e4m3) scaled by its largest magnitude, so that it uses fp8's range (a tensor holding an infinity, which
e4m3 cannot, stays as it is; finding out costs fp8 one synchronization per saved tensor). A tensor saved by several
operations (a block's input, read by its query, key and value projections) is compressed once. The block's own
parameters are not copied: they are kept anyway. Gradients then see the activations with bf16's 8 (fp8's 4)
significant bits: lossy, like Gist's encodings; training follows the uncompressed run closely
(``benchmarks/RESULTS.md``).

In the transform order it comes after recomputation: a recomputed block keeps only its inputs, and those are what is
compressed. Offloading the same blocks' activations as well is refused: only the innermost saved-tensor hooks see
what a forward saves."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks

from meshlight.parallel.blocks import BlockSelection, claim_saved_tensor_hooks, record_in_forward
from meshlight.parallel.dtensors import DTensorSpec, as_dtensor_like, dtensor_spec, local_tensor

__all__ = ["COMPRESSED_DTYPES", "ActivationCompressionPolicy", "ActivationCompressor", "apply_activation_compression"]

#: the dtypes saved activations can be kept in, by name
COMPRESSED_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class ActivationCompressionPolicy:
    """Keep the activations the ``blocks`` save for backward in ``dtype`` (a name of :data:`COMPRESSED_DTYPES`)."""

    dtype: str = "bf16"
    blocks: BlockSelection = field(default_factory=BlockSelection)

    def __post_init__(self) -> None:
        if self.dtype not in COMPRESSED_DTYPES:
            raise ValueError(f"ActivationCompression(dtype={self.dtype!r}): choose one of"
                             f" {', '.join(map(repr, COMPRESSED_DTYPES))}.")

    @property
    def torch_dtype(self) -> torch.dtype:
        return COMPRESSED_DTYPES[self.dtype]

    @property
    def kept_share(self) -> float:
        """Bytes kept per byte of an fp32 activation (for the planner)."""
        return torch.finfo(self.torch_dtype).bits / 32


@dataclass(eq=False)
class _Compressed:
    """One saved activation, compressed: ``values`` in the compressed dtype, times ``scale`` (fp8), restored to
    ``dtype`` and made the DTensor ``spec`` again."""

    values: Tensor
    scale: Optional[Tensor]
    dtype: torch.dtype
    spec: Optional[DTensorSpec]


@dataclass(eq=False)
class ActivationCompressor:
    """The hooks that compress chosen blocks' saved activations. ``original_bytes`` and ``compressed_bytes`` count
    what they compressed (each tensor once), for tests and benchmarks."""

    dtype: torch.dtype
    original_bytes: int = 0
    compressed_bytes: int = 0

    def wrap(self, block: nn.Module) -> None:
        """Patch ``block.forward`` to compress what its forward saves for backward (once per block)."""
        record_in_forward(block, "_meshlight_compress", self._run)

    def _run(self, forward: Any, kept: set[int], *args: Any, **kwargs: Any) -> Any:
        # saved tensors compressed so far, by where they are, each with the tensor itself: while it is held here its
        # memory cannot be reused by another tensor that would then look the same (until the block returns)
        seen: dict[tuple[Any, ...], tuple[Tensor, _Compressed]] = {}
        with saved_tensors_hooks(functools.partial(self._pack, kept, seen), _unpack):
            return forward(*args, **kwargs)

    def _pack(self, kept: set[int], seen: dict[tuple[Any, ...], tuple[Tensor, _Compressed]], tensor: Tensor) -> Any:
        local = local_tensor(tensor)
        if (not local.is_floating_point() or local.element_size() <= self.dtype.itemsize or local.numel() == 0
                or local.untyped_storage().data_ptr() in kept):
            return tensor
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), local.shape, local.stride(),
               local._version, tensor.requires_grad)
        if key in seen:
            return seen[key][1]
        scale = None
        if self.dtype.itemsize == 1:  # fp8: scaled into its range by the largest magnitude
            largest = local.detach().abs().amax().float()
            if not bool(torch.isfinite(largest)):  # e4m3 has no infinity: a tensor holding one (a mask) stays
                return tensor
            scale = (largest / torch.finfo(self.dtype).max).clamp_min(1e-12)
            values = (local.detach() / scale).to(self.dtype)
        else:
            values = local.detach().to(self.dtype)
        compressed = _Compressed(values, scale, local.dtype, dtensor_spec(tensor))
        seen[key] = (local, compressed)
        self.original_bytes += local.numel() * local.element_size()
        self.compressed_bytes += values.numel() * values.element_size()
        return compressed


def _unpack(saved: Any) -> Tensor:
    if not isinstance(saved, _Compressed):
        return saved
    local = saved.values.to(saved.dtype)
    if saved.scale is not None:
        local = local * saved.scale.to(saved.dtype)
    return as_dtensor_like(local, saved.spec)


def apply_activation_compression(module: nn.Module, policy: ActivationCompressionPolicy) -> list[nn.Module]:
    """Compress the saved activations of the blocks ``policy`` selects in ``module``; returns them. The hooks'
    :class:`ActivationCompressor` is ``module._meshlight_compressor``."""
    compressor = getattr(module, "_meshlight_compressor", None) or ActivationCompressor(policy.torch_dtype)
    module._meshlight_compressor = compressor
    chosen = policy.blocks.select(module)
    claim_saved_tensor_hooks(chosen, "ActivationCompression")
    for block in chosen:
        compressor.wrap(block)
    return chosen
