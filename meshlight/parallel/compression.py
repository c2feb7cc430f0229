"""Gradient compression on the data-parallel reductions: gradients travel in bf16 or fp16, or as PowerSGD's
low-rank factors.

Where DDP runs (``zero=0`` without tensor or pipeline parallelism, mixed precision or offload), compression is a
DDP communication hook from :mod:`torch.distributed.algorithms.ddp_comm_hooks`: ``bf16``/``fp16`` cast each bucket
before its all-reduce and back after; ``powersgd`` all-reduces rank-``r`` factors ``P``, ``Q`` of each matrix-shaped
gradient (with error feedback: what compression lost is added to the next step's gradient) after ``start_step`` plain
all-reduces. Everywhere else data parallelism runs on FSDP2, which reduces in its mixed-precision policy's
``reduce_dtype``: ``bf16``/``fp16`` set it, and PowerSGD, a DDP hook, is refused there. FSDP2 accumulates gradients
that wait for their reduction (ZeRO-1 and DDP-on-FSDP2 accumulation, pipeline micro-batches) in that reduce dtype;
meshlight keeps them in the parameters' dtype (fp32), so only the wire is compressed
(:func:`accumulate_in_parameter_dtype`). The reductions of the data-parallel axes only are compressed: tensor,
pipeline and expert traffic is unchanged.

PowerSGD keeps state per bucket of DDP: the error and the warm-started ``Q`` factors. Buckets are rebuilt after
DDP's first step (in the order gradients become ready), so a resumed run would find its buckets numbered otherwise
than the run that saved them. :class:`PowerSGD` therefore keeps the state per parameter across bucket changes and
checkpoints (:meth:`PowerSGD.state_dict`), which makes a resume on the same layout continue bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, _should_compress, powerSGD_hook
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

__all__ = ["COMPRESSIONS", "GradientCompression", "PowerSGD", "accumulate_in_parameter_dtype", "powersgd_of"]

#: the names ``grad_compression`` takes
COMPRESSIONS = ("bf16", "fp16", "powersgd")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_ATTRIBUTE = "_meshlight_powersgd"


@dataclass(frozen=True)
class GradientCompression:
    """How gradients travel in the data-parallel reductions.

    ``kind``: ``"bf16"`` or ``"fp16"`` (half the bytes), ``"powersgd"`` (low-rank factors of ``rank``, after
    ``start_step`` optimizer steps of plain all-reduce: torch's default of 1,000 is longer than many fine-tunes; after
    10 the demo task's accuracy was 89%, 99.8% and 13% for 3 seeds, after 50 96–98% for each:
    ``python benchmarks/compression.py --sections convergence --variants powersgd --powersgd-start 10``), or
    ``"hook"``: a torch DDP communication ``hook`` with its ``state`` (DDP only; None: the data-parallel process group,
    which torch's own hooks take)."""

    kind: str
    rank: int = 4
    start_step: int = 50
    hook: Optional[Callable[..., Any]] = None
    state: Any = None

    def __post_init__(self) -> None:
        if self.kind == "hook":
            if not callable(self.hook):
                raise ValueError("GradientCompression(kind='hook') needs hook=<a torch DDP communication hook>.")
            return
        if self.kind not in COMPRESSIONS:
            raise ValueError(f"grad_compression={self.kind!r} is not known: choose one of {', '.join(COMPRESSIONS)}, "
                             "GradientCompression(kind='powersgd', rank=..., start_step=...) or a torch DDP "
                             "communication hook.")
        if self.kind == "powersgd" and (self.rank < 1 or self.start_step < 2):
            raise ValueError(f"PowerSGD rank={self.rank}, start_step={self.start_step}: the rank is at least 1 and"
                             " start_step at least 2 (DDP settles its buckets in the first step).")

    @classmethod
    def of(cls, value: Union[None, str, GradientCompression, Callable[..., Any]]) -> Optional[GradientCompression]:
        """``value`` as given to a strategy's ``grad_compression``: None, a name, an instance, or a torch DDP
        communication hook (with no state)."""
        if value is None or isinstance(value, GradientCompression):
            return value
        if isinstance(value, str):
            return cls(value.lower())
        if callable(value):
            return cls("hook", hook=value)
        raise ValueError(f"grad_compression={value!r}: give one of {', '.join(COMPRESSIONS)}, a GradientCompression"
                         " or a torch DDP communication hook.")

    @property
    def dtype(self) -> Optional[torch.dtype]:
        """The dtype gradients are reduced in (None: not a cast)."""
        return _DTYPES.get(self.kind)

    @property
    def ddp_only(self) -> bool:
        """A DDP communication hook, which FSDP2 cannot run."""
        return self.dtype is None

    def ratio(self) -> float:
        """Bytes moved over uncompressed fp32 gradients, for the planner: the cast's share, or PowerSGD's at its rank
        on square matrices of width 4096 (its factors' share, (2·4096·r)/4096²)."""
        if self.dtype is not None:
            return torch.finfo(self.dtype).bits / 32
        return 2 * self.rank / 4096 if self.kind == "powersgd" else 1.0

    def fsdp_policy(self, policy: Optional[MixedPrecisionPolicy]) -> MixedPrecisionPolicy:
        """FSDP2's mixed-precision ``policy`` (None: none) reducing in this compression's dtype. A reduce dtype
        already chosen otherwise than fp32 and this one is refused, naming both."""
        assert self.dtype is not None
        if policy is None:
            return MixedPrecisionPolicy(reduce_dtype=self.dtype)
        if policy.reduce_dtype not in (None, torch.float32, self.dtype):
            raise ValueError(f"grad_compression={self.kind!r} reduces gradients in {self.dtype} and MixedPrecision"
                             f" asks for reduce_dtype={policy.reduce_dtype}: keep one of them.")
        return dataclasses.replace(policy, reduce_dtype=self.dtype)

    def register(self, module: nn.Module, group: dist.ProcessGroup, names: dict[int, str]) -> None:
        """Register this compression as the communication hook of composable-DDP ``module`` over ``group``;
        ``names``: the parameters' names by ``data_ptr`` (PowerSGD keeps its state by them)."""
        if self.dtype is not None:
            module.register_comm_hook(group, _bf16_hook if self.kind == "bf16" else default_hooks.fp16_compress_hook)
        elif self.kind == "powersgd":
            powersgd = PowerSGD(group, self.rank, self.start_step, names)
            module.__dict__[_ATTRIBUTE] = powersgd
            module.register_comm_hook(powersgd, PowerSGD.hook)
        else:  # torch's own hooks take the process group as their state
            module.register_comm_hook(group if self.state is None else self.state, self.hook)


def accumulate_in_parameter_dtype(module: nn.Module) -> None:
    """Make the FSDP2 units in ``module`` accumulate gradients that wait for their reduction in the parameters' own
    dtype (fp32), where FSDP2 would accumulate them in its reduce dtype; the reduction still casts them to it.

    Touches FSDP2's private per-parameter objects (``FSDPParam``): no public switch exists in torch 2.13
    (``tests/parallel/test_compression.py`` checks the touch point)."""
    for unit in module.modules():
        if not isinstance(unit, FSDPModule):
            continue
        group = unit._get_fsdp_state()._fsdp_param_group
        for param in group.fsdp_params if group is not None else ():
            param.to_accumulated_grad_if_needed = functools.partial(_accumulate_in_original_dtype, param)


def _accumulate_in_original_dtype(param: Any) -> None:
    """``FSDPParam.to_accumulated_grad_if_needed`` with the parameter's dtype in place of the reduce dtype."""
    grad = param._unsharded_param.grad
    if param.reduce_dtype is None or grad is None or grad.dtype == param.orig_dtype:
        return  # autograd accumulates into the gradient, in its dtype
    param._unsharded_param.grad = None
    param.unsharded_accumulated_grad = grad.to(param.orig_dtype)


def _bf16_hook(group, bucket):  # noqa: ANN001, ANN202 - DDP checks hooks' annotations, which postponed ones fail
    """torch's ``bf16_compress_hook`` under another name: DDP refuses that name unless NCCL ≥ 2.10 runs it, though
    gloo reduces bf16 too."""
    return default_hooks.bf16_compress_hook(group, bucket)


def powersgd_of(module: nn.Module) -> Optional[PowerSGD]:
    """The PowerSGD state of the DDP module in ``module`` (None without PowerSGD)."""
    return next((m.__dict__[_ATTRIBUTE] for m in module.modules() if _ATTRIBUTE in m.__dict__), None)


class PowerSGD(PowerSGDState):
    """torch's PowerSGD state, kept per parameter where DDP's buckets change (their rebuild after the first step,
    a resume) so that the error feedback and the warm-started factors follow the parameters they belong to."""

    __slots__ = ("names", "shapes", "bucket_params", "pending", "in_order")

    def __init__(self, group: dist.ProcessGroup, rank: int, start_step: int, names: dict[int, str]) -> None:
        super().__init__(group, matrix_approximation_rank=rank, start_powerSGD_iter=start_step)
        self.names = names  # parameter name by data_ptr
        self.shapes: dict[str, torch.Size] = {}
        self.bucket_params: dict[int, tuple[str, ...]] = {}  # the parameters of each bucket the state was made for
        self.pending: dict[str, dict[str, Tensor]] = {}  # per-parameter state not in a bucket's (yet)
        # torch's hook issues the factors' all-reduces from its futures' callbacks, which gloo runs on its own
        # threads as collectives complete: with several buckets the ranks would issue them in different orders.
        # On gloo each bucket's compression therefore finishes before the next bucket's starts.
        self.in_order = dist.get_backend(group) == "gloo"

    @staticmethod
    def hook(state, bucket):  # noqa: ANN001, ANN205 - DDP checks hooks' annotations, which postponed ones fail
        """torch's PowerSGD hook, after :meth:`follow`."""
        state.follow(bucket)
        future = powerSGD_hook(state, bucket)
        if state.in_order:
            future.wait()
        return future

    def follow(self, bucket: dist.GradBucket) -> None:
        """Before ``bucket``'s compression: if its parameters are not those its state was made for, move the state
        of every bucket sharing a parameter with it to ``pending``, and assemble its own from there."""
        index = bucket.index()
        params = tuple(self.names[p.data_ptr()] for p in bucket.parameters())
        if self.bucket_params.get(index) == params:
            return
        for other, names in list(self.bucket_params.items()):
            if other == index or set(names) & set(params):
                self._dissolve(other)
        self.shapes.update(zip(params, (g.shape for g in bucket.gradients())))
        self.bucket_params[index] = params
        if params and all(name in self.pending for name in params):
            self._assemble(index, params)

    def _dissolve(self, index: int) -> None:
        """Move bucket ``index``'s state to ``pending``, per parameter."""
        names = self.bucket_params.pop(index)
        error, q = self.error_dict.pop(index, None), self.q_memory_dict.pop(index, None)
        self.p_memory_dict.pop(index, None)
        if error is None:
            return
        shapes = [self.shapes[name] for name in names]
        sizes = [shape.numel() for shape in shapes]
        if sum(sizes) != error.numel():
            raise RuntimeError(f"PowerSGD: DDP bucket {index} holds {error.numel()} gradient values, its parameters"
                               f" {sum(sizes)}; meshlight cannot follow this bucket layout.")
        for name, shape, piece in zip(names, shapes, torch.split(error, sizes)):
            self.pending.setdefault(name, {})["error"] = piece.view(shape).clone()
        if q is None:
            return
        order = _compressed_order(shapes, self)
        q_sizes = [_factor_sizes(shapes[position], self)[1] for position in order]
        for position, piece in zip(order, torch.split(q, q_sizes)):
            self.pending[names[position]]["q"] = piece.clone()

    def _assemble(self, index: int, params: Sequence[str]) -> None:
        """Bucket ``index``'s state from the pending state of its ``params``."""
        self.error_dict[index] = torch.cat([self.pending[name]["error"].reshape(-1) for name in params])
        shapes = [self.shapes[name] for name in params]
        order = _compressed_order(shapes, self)
        if order and all("q" in self.pending[params[position]] for position in order):
            self.q_memory_dict[index] = torch.cat([self.pending[params[position]]["q"] for position in order])
            p_size = sum(_factor_sizes(shapes[position], self)[0] for position in order)
            self.p_memory_dict[index] = self.error_dict[index].new_empty(p_size)
        for name in params:
            del self.pending[name]

    # ---------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The state per parameter name, the step count and the generator that draws new factors: tensors, numbers
        and strings only (``torch.load(weights_only=True)``)."""
        for index in list(self.bucket_params):
            self._dissolve(index)
        kind, keys, *rest = self.rng.get_state()
        return {"iter": self.iter, "params": {name: dict(state) for name, state in self.pending.items()},
                "rng": (kind, torch.from_numpy(keys.copy()), *rest)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iter = state["iter"]
        for memory in (self.error_dict, self.p_memory_dict, self.q_memory_dict, self.bucket_params):
            memory.clear()
        self.pending = {name: dict(pieces) for name, pieces in state["params"].items()}
        kind, keys, *rest = state["rng"]
        self.rng.set_state((kind, keys.numpy(), *rest))


def _factor_sizes(shape: torch.Size, state: PowerSGDState) -> tuple[int, int]:
    """The sizes of the ``P`` and ``Q`` factors of a gradient of ``shape`` (taken as a matrix of ``shape[0]`` rows)."""
    n = shape[0]
    m = shape.numel() // n
    rank = min(n, m, state.matrix_approximation_rank)
    return n * rank, m * rank


def _compressed_order(shapes: Sequence[torch.Size], state: PowerSGDState) -> list[int]:
    """The bucket positions of the gradients PowerSGD compresses, in the order ``powerSGD_hook`` lays out their
    factors: grouped by matrix shape, groups in order of first appearance."""
    groups: dict[tuple[int, int], list[int]] = {}
    for position, shape in enumerate(shapes):
        n, m = shape[0], shape.numel() // shape[0]
        if _should_compress(n, m, min(n, m, state.matrix_approximation_rank), state.min_compression_rate)[0]:
            groups.setdefault((n, m), []).append(position)
    return [position for positions in groups.values() for position in positions]
