"""Data parallelism over the mesh's data axes: DDP (ZeRO-0) or ZeRO stages 1–3, all on PyTorch's engines.

Stage mapping onto FSDP2 (``fully_shard``, parameters as DTensors sharded on dim 0):

====== ========================= ================================================ =========================
stage  reshard_after_forward     while accumulating gradients (no optimizer step)  bytes per step (no accum.)
====== ========================= ================================================ =========================
0      — (DDP, ``replicate``)    gradients kept locally, no all-reduce              all-reduce P
1      False                     full gradients kept locally, no reduce-scatter     gather P + reduce-scatter P
2      False                     gradients reduce-scattered every micro-batch       gather P + reduce-scatter P
3      True                      (as 2) and parameters re-gathered in backward      gather 2P − root
                                                                                    + reduce-scatter P
====== ========================= ================================================ =========================

Under ZeRO-3 the root unit (what no block holds: embedding, head, final norm) is not resharded after forward,
as FSDP2 does by default for a root (its backward follows at once), so it is gathered once per step.

Every stage shards optimizer state; the optimizer steps each rank's shard and the next forward gathers
the updated parameters, so stages 1 and 2 move exactly DDP's 2·P·(N−1)/N bytes. DDP over a model that
already has DTensor parameters (tensor parallel), or over a pipeline stage, runs as FSDP2 hybrid sharding
with shard groups of one rank — the same all-reduce — because PyTorch's composable DDP would turn those
parameters into plain tensors, and pipeline schedules defer gradient reduction only for FSDP modules.
Unlike a flat-buffer ZeRO, shards are whole rows of each tensor, so non-elementwise optimizers
(Adafactor's factored moments) stay exact. Between steps FSDP2 frees the gathered parameters in every
stage, so per-rank memory after a step is at most the classic ZeRO formula for the stage.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import chain
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate import DDP as ReplicatedModule
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.utils import _sync_params_and_buffers
from torch.nn.parallel import DistributedDataParallel

from meshlight.parallel.blocks import repeated_blocks
from meshlight.parallel.compression import GradientCompression, accumulate_in_parameter_dtype
from meshlight.parallel.dtensors import has_dtensor_parameters
from meshlight.parallel.expert import expert_data_mesh
from meshlight.parallel.layout import DATA_AXES, axis, hybrid_mesh
from meshlight.parallel.precision import FP32_UNIT, PrecisionPolicy, keep_fp32

__all__ = [
    "apply_data_parallel",
    "broadcast_module_states",
    "data_parallel_mesh",
    "ddp_engine",
    "gradient_accumulation",
    "is_data_parallel",
    "refuse_parameters_without_gradients",
]

_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


def data_parallel_mesh(mesh: DeviceMesh, zero: int) -> DeviceMesh:
    """The mesh data parallelism runs on: flattened ``dp`` for DDP; ``dp_shard`` (or the 2-D hybrid
    ``dp_replicate × dp_shard`` when replicating too) for ZeRO. Under context parallelism the cp ranks of a replica
    hold the same weights and join in: ``dp_cp`` and ``dp_shard_cp`` instead."""
    context = mesh["cp"].size() > 1
    if zero == 0:
        return axis(mesh, "dp_cp" if context else "dp")
    shard = "dp_shard_cp" if context else "dp_shard"
    if axis(mesh, "dp_replicate").size() > 1:
        return hybrid_mesh(mesh, shard)
    return axis(mesh, shard)



def apply_data_parallel(
    module: nn.Module,
    mesh: DeviceMesh,
    zero: int,
    *,
    blocks: Optional[Sequence[nn.Module]] = None,
    ddp_kwargs: Optional[dict[str, Any]] = None,
    pipelined: bool = False,
    experts: Sequence[nn.Module] = (),
    precision: Optional[PrecisionPolicy] = None,
    cpu_offload: Optional[CPUOffloadPolicy] = None,
    compile_arguments: Optional[Mapping[str, Any]] = None,
    grad_compression: Optional[GradientCompression] = None,
) -> nn.Module:
    """Make ``module`` data parallel in place over ``mesh``'s data axes with ZeRO stage ``zero``.

    ``module`` becomes the root whose forward triggers the collectives. ``blocks`` (default:
    :func:`repeated_blocks`) are sharded as separate FSDP units so only one is gathered at a time. The module
    must hold the same weights on every rank (:func:`broadcast_module_states`; ``parallelize`` does it).
    ``pipelined``: ``module`` is a pipeline stage, whose schedule runs several backwards per step and defers
    gradient reduction to the last only for FSDP modules, so DDP runs on FSDP2 there too.
    ``experts``: modules whose weights are split over the mesh's ``ep`` axis; they are data parallel over
    the ranks holding the same experts only (:func:`~meshlight.parallel.expert.expert_data_mesh`).
    ``precision`` (mixed precision, :mod:`meshlight.parallel.precision`) and ``cpu_offload`` (parameter shards,
    gradients and optimizer state in host memory, :mod:`meshlight.parallel.offload`) are FSDP2 policies: with
    either, data parallelism always runs on FSDP2 — over shard groups of one rank where the layout shards nothing.
    ``compile_arguments``: ``torch.compile``'s, where blocks are compiled; the modules mixed precision keeps in
    fp32 (:func:`~meshlight.parallel.precision.keep_fp32`) are compiled with them too.
    ``grad_compression``: how gradients travel in the reductions (:mod:`meshlight.parallel.compression`).
    """
    policies: dict[str, Any] = {"offload_policy": cpu_offload} if cpu_offload is not None else {}
    on_fsdp = precision is not None or cpu_offload is not None
    if data_parallel_mesh(mesh, zero).size() == 1 and not on_fsdp:
        return module  # nothing to replicate or shard over; FSDP on one rank would only add copies
    # (experts split over ep are data parallel over fewer ranks: FSDP2 units of their own, which DDP cannot leave out)
    on_ddp = zero == 0 and not has_dtensor_parameters(module) and not pipelined and not on_fsdp and not experts
    if grad_compression is not None and grad_compression.ddp_only and not on_ddp:
        raise ValueError(
            f"grad_compression={grad_compression.kind!r} is a DDP communication hook, and this layout reduces"
            f" gradients with FSDP2 ({_why_fsdp(zero, pipelined, precision, cpu_offload, experts)}): use"
            " grad_compression='bf16' (or 'fp16') here, or strategy='ddp' alone for PowerSGD."
        )
    mp_policy = precision.fsdp if precision is not None else None
    unit_policy = FP32_UNIT
    if grad_compression is not None and not on_ddp:
        mp_policy, unit_policy = grad_compression.fsdp_policy(mp_policy), grad_compression.fsdp_policy(FP32_UNIT)
    ignored = _expert_data_parallel(experts, mesh, zero, on_fsdp,
                                    {**policies, **({"mp_policy": mp_policy} if mp_policy else {})})
    if on_ddp:
        # Composable DDP: the real DDP reducer (bucketed all-reduce overlapped with backward) installed as
        # hooks on `module`, which keeps its class and parameter names.
        group = data_parallel_mesh(mesh, zero).get_group()
        replicated = replicate(module, process_group=group, **(ddp_kwargs or {}))
        if grad_compression is not None:
            names = {p.data_ptr(): name for name, p in module.named_parameters()}
            grad_compression.register(replicated, group, names)
        return replicated
    # DDP on FSDP2: hybrid sharding over shard groups of one rank (DDP's all-reduce); under context parallelism the
    # cp ranks shard instead (the same bytes: reduce-scatter and all-gather), since no 2-D mesh can replicate over
    # the data axes and cp together.
    dp_mesh = data_parallel_mesh(mesh, zero) if zero else (
        hybrid_mesh(mesh, "dp_shard_cp") if mesh["cp"].size() > 1 else mesh[DATA_AXES])
    shard = functools.partial(fully_shard, mesh=dp_mesh, reshard_after_forward=zero == 3, ignored_params=ignored,
                              **policies)
    if precision is not None:  # fp32 units first: FSDP units nest bottom-up
        for fp32_module, output_dtype in precision.fp32_units(module):
            keep_fp32(fp32_module, output_dtype, compile_arguments)
            shard(fp32_module, mp_policy=unit_policy)
    if mp_policy is not None:
        shard = functools.partial(shard, mp_policy=mp_policy)
    for block in repeated_blocks(module) if blocks is None else blocks:
        shard(block)
    # ZeRO-3's root (embedding, head, final norm) stays gathered from forward to the backward that follows at once,
    # as FSDP2 keeps a root by default (torch < 2.8 always did; since, an explicit True reshards it too, which
    # would gather it a second time every step). A pipeline stage's root is resharded like its blocks: the
    # schedule runs several forwards before their backwards.
    shard(module, reshard_after_forward=zero == 3 and pipelined)
    if grad_compression is not None:
        accumulate_in_parameter_dtype(module)
    return module


def _why_fsdp(zero: int, pipelined: bool, precision: Optional[PrecisionPolicy],
              cpu_offload: Optional[CPUOffloadPolicy], experts: Sequence[nn.Module]) -> str:
    if zero:
        return f"ZeRO-{zero}"
    reasons = [what for what, present in (("pipeline parallelism", pipelined), ("MixedPrecision", precision),
                                          ("Offload", cpu_offload), ("expert parallelism", experts)) if present]
    return ", ".join(reasons) or "tensor parallelism"


def _expert_data_parallel(
    experts: Sequence[nn.Module], mesh: DeviceMesh, zero: int, on_fsdp: bool, policies: dict[str, Any]
) -> Optional[set[nn.Parameter]]:
    """Make expert-parallel modules data parallel over the ranks that hold the same experts, as FSDP units of
    their own (with FSDP ``policies``); where no other rank holds them (ep = dp), return their parameters for
    FSDP to leave alone — unless a policy must apply to them (``on_fsdp``)."""
    if not experts:
        return None
    edp_mesh = expert_data_mesh(mesh, zero)
    if edp_mesh.size() == 1 and not on_fsdp:
        return {p for module in experts for p in module.parameters()}
    for module in experts:
        fully_shard(module, mesh=edp_mesh, reshard_after_forward=zero == 3, **policies)
    return None


def is_data_parallel(module: nn.Module) -> bool:
    """Whether DDP or FSDP was already applied to ``module`` or inside it (e.g. in ``configure_model``)."""
    return any(isinstance(m, (FSDPModule, ReplicatedModule)) for m in module.modules())


def refuse_parameters_without_gradients(module: nn.Module, named: nn.Module) -> bool:
    """After a backward through ``module`` replicated by DDP (ZeRO-0) that looks for no unused parameters: refuse
    trainable parameters that got no gradient, naming them as in ``named`` (the user's module inside). DDP's reducer
    all-reduces a bucket once every parameter in it has its gradient, so their buckets would stay unreduced — the
    step's gradients partly unsynchronized — and DDP would fail at the next forward without naming them.
    ``find_unused_parameters`` and ``static_graph`` (a fixed set of unused parameters) handle them. Whether it
    looked: not after an accumulating micro-batch's backward (a later one of the window may use a parameter, an
    expert given tokens only there), which DDP does not synchronize."""
    state = replicate.state(module)
    ddp = getattr(state, "_ddp", None) if state is not None else None
    if ddp is None or ddp.find_unused_parameters or ddp.static_graph:
        return True
    if not ddp.require_backward_grad_sync:
        return False
    unused = [name for name, param in named.named_parameters() if param.requires_grad and param.grad is None]
    if unused:
        shown = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
        raise RuntimeError(
            f"{len(unused)} trainable parameter(s) got no gradient in the first step ({shown}), and DDP (zero=0)"
            " reduces each bucket of gradients only once every parameter in it has one. Let DDP look for them in every"
            " backward — DDPStrategy(find_unused_parameters=True), or ddp_kwargs={'find_unused_parameters': True} to"
            " MeshStrategy or Hybrid3DStrategy —, train with zero=1 or more (FSDP2 reduces the gradients there are),"
            " or freeze the ones no loss trains (requires_grad_(False); a sparse attention's key selector, as"
            " DeepSeek-V3.2's, learns from a loss of its own)."
        )
    return True


@contextmanager
def gradient_accumulation(module: nn.Module, zero: int) -> Iterator[None]:
    """Within this context, backward passes accumulate gradients without the optimizer step's traffic.

    DDP and ZeRO-1 skip gradient reduction entirely until the last micro-batch; ZeRO-2 still
    reduce-scatters each micro-batch (its gradients are sharded) but, like ZeRO-1, keeps the gathered
    parameters instead of re-gathering them for every micro-batch. So does DDP where it runs on FSDP2 (under
    mixed precision, offload, tensor parallelism): its "gather" is the cast to the compute dtype, or the copy in
    from host memory. Neither raises the peak: these stages hold every gathered parameter at the end of forward
    anyway. ZeRO-3 changes nothing.
    """
    fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
    ddp_modules = [m for m in module.modules() if isinstance(m, ReplicatedModule)]
    keep_gradients_local = zero in (0, 1)
    keep_parameters = zero in (0, 1, 2)
    try:
        for m in ddp_modules:
            m.set_requires_gradient_sync(not keep_gradients_local)
        for m in fsdp_modules:
            m.set_requires_gradient_sync(not keep_gradients_local, recurse=False)
            m.set_reshard_after_backward(not keep_parameters, recurse=False)
        yield
    finally:
        for m in ddp_modules:
            m.set_requires_gradient_sync(True)
        for m in fsdp_modules:
            m.set_requires_gradient_sync(True, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)


def ddp_engine(module: nn.Module) -> Optional[DistributedDataParallel]:
    """The ``DistributedDataParallel`` object behind a module made data parallel with ``zero=0`` (None before
    its first forward, or if ``module`` is not DDP)."""
    if not isinstance(module, ReplicatedModule):
        return None
    return getattr(replicate.state(module), "_ddp", None)


def broadcast_module_states(
    module: nn.Module,
    group: Optional[dist.ProcessGroup] = None,
    *,
    shard_group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Copy the first rank's parameters and buffers to every rank, so that a model initialized from an
    unseeded RNG starts identical everywhere: plain tensors over ``group`` (default: the world), local
    shards of DTensors over ``shard_group`` — the ranks holding the same shard — or not at all if None."""
    group = group or dist.group.WORLD
    plain, shards = [], []
    for tensor in chain(module.parameters(), module.buffers()):
        if not tensor.is_meta:
            (shards if isinstance(tensor, DTensor) else plain).append(tensor)
    with torch.no_grad():
        if dist.get_world_size(group) > 1 and plain:
            _sync_params_and_buffers(group, [t.detach() for t in plain], _BROADCAST_BUCKET_BYTES, src=0)
        if shard_group is not None and dist.get_world_size(shard_group) > 1 and shards:
            local = [t.to_local().detach() for t in shards]
            _sync_params_and_buffers(shard_group, local, _BROADCAST_BUCKET_BYTES, src=0)
