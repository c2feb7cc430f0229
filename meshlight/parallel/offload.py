"""Offload to host memory: the optimizer's state (with the fp32 shards and gradients it steps) and the saved
activations of chosen blocks.

*Optimizer state* goes through FSDP2's CPU offload policy: each rank's fp32 parameter shards, their gradient
shards and the optimizer state live in host memory, and the optimizer steps there — FSDP2 runs the step where
the state is. The accelerator holds parameters only gathered, for the units computing (none between steps).
:func:`~meshlight.parallel.data_parallel.apply_data_parallel` applies it to every FSDP unit (under offload every
layout runs on FSDP2, as under mixed precision). For host tensors torch's optimizers default to their
per-parameter loop; :func:`fuse_host_steps` gives the groups left to that default torch's fused host kernel
(the same update, to rounding; Adam and AdamW step about 4× faster: ``benchmarks/RESULTS.md``).

*Activations*: a chosen block's forward runs under saved-tensor hooks that copy each tensor autograd keeps for
backward to (pinned) host memory on a side stream, so the accelerator's copy is freed once forward is done with
it. In backward, when the gradient reaches a chosen block's output, the previous chosen block's activations
start their way back on the side stream: they are there, or nearly, when its backward needs them. The block's
own parameters, already kept, are not copied. Module and parameter names are unchanged.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.optim import Optimizer
from torch.utils._pytree import tree_leaves

from meshlight.parallel.blocks import BlockSelection, claim_saved_tensor_hooks, record_in_forward
from meshlight.parallel.dtensors import DTensorSpec, as_dtensor_like, dtensor_spec, local_tensor

__all__ = ["FUSED_ON_HOST", "ActivationOffloader", "OffloadPolicy", "apart_from_host", "apply_activation_offload",
           "fuse_host_steps", "prepare_host_steps"]

#: torch optimizers with a fused kernel for host (CPU) tensors
FUSED_ON_HOST = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


@dataclass(frozen=True)
class OffloadPolicy:
    """``optimizer``: optimizer state, fp32 parameter shards and gradients in host memory; ``activations``: the
    blocks whose saved activations go to host memory (None: none); ``pin_memory``: page-locked host buffers
    (faster, asynchronous copies; only with CUDA); ``nvme``: a folder on a local disk where the optimizer state
    waits between steps instead of host memory (:mod:`meshlight.parallel.nvme`), in files of ``nvme_chunk_bytes``."""

    optimizer: bool = True
    activations: Optional[BlockSelection] = None
    pin_memory: bool = True
    nvme: Optional[Path] = None
    nvme_chunk_bytes: int = 32 * 2**20

    @property
    def fsdp(self) -> Optional[CPUOffloadPolicy]:
        """FSDP2's policy for the optimizer-state offload (None without it)."""
        return CPUOffloadPolicy(pin_memory=self.pin_memory and torch.cuda.is_available()) if self.optimizer else None


def fuse_host_steps(optimizer: Optimizer) -> list[int]:
    """Make ``optimizer``'s parameter groups held in host memory step with torch's fused host kernel; returns the
    groups' indices.

    Under optimizer offload the host steps the optimizer, and for host tensors torch picks its per-parameter loop
    unless told otherwise (its multi-tensor kernels are for accelerators). Only groups that left both ``foreach``
    and ``fused`` unset, and ask for nothing the fused kernel lacks (``differentiable``, ``capturable``), change:
    ``fused=False`` keeps the loop. The choice belongs to this run, not to its checkpoints: ``state_dict`` saves
    the flags as they were given, and after ``load_state_dict`` (which restores saved flags) the same groups are
    fused again."""
    if not isinstance(optimizer, FUSED_ON_HOST):
        return []
    chosen = [index for index, group in enumerate(optimizer.param_groups)
              if group.get("fused") is None and group.get("foreach") is None
              and not group.get("differentiable") and not group.get("capturable")
              and group["params"] and all(p.device.type == "cpu" and p.is_floating_point() for p in group["params"])]
    if not chosen:
        return []

    def fuse(*_: object) -> None:
        for index in chosen:
            optimizer.param_groups[index]["fused"] = True

    def as_given(_: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        for index in chosen:
            state["param_groups"][index]["fused"] = None
        return state

    fuse()
    optimizer.register_state_dict_post_hook(as_given)
    optimizer.register_load_state_dict_post_hook(fuse)
    return chosen


def prepare_host_steps(optimizers: Sequence[Optimizer], processes_per_node: int,
                       cores: Optional[int] = None) -> list[str]:
    """Ready ``optimizers`` to step on the host (optimizer offload from an accelerator) and say what was done: the
    groups given torch's fused host kernel (:func:`fuse_host_steps`), and the thread count to set when every rank
    steps on one thread (``OMP_NUM_THREADS=1``, torchrun's default) though the node's ``cores`` (default: those
    this process may run on) would give each of its ``processes_per_node`` ranks more."""
    notes = []
    for optimizer in optimizers:
        fused = fuse_host_steps(optimizer)
        if fused:
            groups = "its parameters" if len(optimizer.param_groups) == 1 else f"parameter groups {fused}"
            notes.append(f"Optimizer offload: {type(optimizer).__name__} steps {groups} on the host with torch's fused"
                         " kernel (pass fused=False to keep its per-parameter loop).")
    cores = cores or _usable_cores()
    share = cores // max(processes_per_node, 1)
    if torch.get_num_threads() == 1 and share > 1:
        notes.append(f"Optimizer offload: each rank steps its optimizer on one host thread (OMP_NUM_THREADS="
                     f"{os.environ.get('OMP_NUM_THREADS', '1')}); this node's {cores} cores for"
                     f" {processes_per_node} rank(s) allow {share} per rank: set OMP_NUM_THREADS={share}.")
    return notes


def _usable_cores() -> int:
    """The cores this process may run on (all of the machine's where the platform cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def apart_from_host(device: torch.device) -> bool:
    """Whether ``device``'s memory is apart from host memory, so that offload frees some of it: a CUDA device's
    is; a CPU's is the host's."""
    return device.type == "cuda"


def _offloadable(tensor: Tensor) -> bool:
    """Whether a saved tensor lives in accelerator memory (host tensors stay where they are)."""
    return apart_from_host(tensor.device)


@dataclass(eq=False)
class _Saved:
    """One saved activation in host memory; ``back``: its accelerator copy, once brought back ahead of time."""

    host: Tensor
    device: torch.device
    dtensor: Optional[DTensorSpec]
    written: Optional[torch.cuda.Event]
    back: Optional[Tensor] = None
    back_ready: Optional[torch.cuda.Event] = None
    used: bool = False


@dataclass(eq=False)
class ActivationOffloader:
    """The hooks that move chosen blocks' saved activations to host memory and bring them back one block ahead.

    ``offloaded_bytes`` and ``prefetches`` count what it did (for tests and benchmarks)."""

    pin_memory: bool = True
    offloaded_bytes: int = 0
    prefetches: int = 0
    _stream: Optional[torch.cuda.Stream] = field(default=None, repr=False)
    _last: Optional[list[_Saved]] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if torch.cuda.is_available():
            self._stream = torch.cuda.Stream()
        self.pin_memory = self.pin_memory and torch.cuda.is_available()

    def wrap(self, block: nn.Module) -> None:
        """Patch ``block.forward`` to offload what its forward saves for backward (once per block)."""
        record_in_forward(block, "_meshlight_offload", self._run)

    def _run(self, forward: Any, kept: set[int], *args: Any, **kwargs: Any) -> Any:
        stash: list[_Saved] = []
        previous, self._last = self._last, stash
        with saved_tensors_hooks(functools.partial(self._pack, stash, kept), self._unpack):
            output = forward(*args, **kwargs)
        grad_output = next((t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad), None)
        if previous is not None and grad_output is not None:
            # The gradient reaching this block's output starts the previous block's activations back.
            grad_output.register_hook(lambda grad: self._prefetch(previous))
        return output

    def _pack(self, stash: list[_Saved], kept: set[int], tensor: Tensor) -> Any:
        local = local_tensor(tensor)
        if not _offloadable(local) or local.untyped_storage().data_ptr() in kept:
            return tensor
        host = torch.empty_like(local, device="cpu", pin_memory=self.pin_memory)
        written = None
        if self._stream is not None and local.is_cuda:
            self._stream.wait_stream(torch.cuda.current_stream(local.device))
            with torch.cuda.stream(self._stream):
                host.copy_(local, non_blocking=self.pin_memory)
                written = self._stream.record_event()
            local.record_stream(self._stream)  # its memory is not reused before the copy has read it
        else:
            host.copy_(local)
        saved = _Saved(host, local.device, dtensor_spec(tensor), written)
        stash.append(saved)
        self.offloaded_bytes += host.numel() * host.element_size()
        return saved

    def _unpack(self, saved: Any) -> Tensor:
        if not isinstance(saved, _Saved):
            return saved
        saved.used = True
        if saved.back is not None:
            local, saved.back = saved.back, None
            if saved.back_ready is not None:
                torch.cuda.current_stream(local.device).wait_event(saved.back_ready)
                local.record_stream(torch.cuda.current_stream(local.device))
        else:
            if saved.written is not None:
                torch.cuda.current_stream(saved.device).wait_event(saved.written)
            local = saved.host.to(saved.device, non_blocking=self.pin_memory)
        return as_dtensor_like(local, saved.dtensor)

    def _prefetch(self, stash: list[_Saved]) -> None:
        for saved in stash:
            if saved.used or saved.back is not None:  # already consumed (an earlier step's) or on its way
                continue
            if self._stream is None or saved.device.type != "cuda":
                saved.back = saved.host.to(saved.device)
            else:
                if saved.written is not None:
                    self._stream.wait_event(saved.written)
                with torch.cuda.stream(self._stream):
                    saved.back = saved.host.to(saved.device, non_blocking=self.pin_memory)
                    saved.back_ready = self._stream.record_event()
            self.prefetches += 1




def apply_activation_offload(module: nn.Module, selection: BlockSelection, pin_memory: bool = True) -> list[nn.Module]:
    """Offload the saved activations of the blocks ``selection`` picks in ``module``; returns them. The hooks'
    :class:`ActivationOffloader` is ``module._meshlight_offloader``."""
    offloader = getattr(module, "_meshlight_offloader", None) or ActivationOffloader(pin_memory)
    module._meshlight_offloader = offloader
    chosen = selection.select(module)
    claim_saved_tensor_hooks(chosen, "Offload")
    for block in chosen:
        offloader.wrap(block)
    return chosen
