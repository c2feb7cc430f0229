"""Bytes each rank sends in collectives, counted from the collectives actually issued.

:class:`CollectiveTraffic` is a ``TorchDispatchMode``: every ``c10d`` and functional collective dispatched
while it is active is recorded with its tensor sizes and group size — DDP's C++ bucket all-reduce,
FSDP2's all-gathers and reduce-scatters, DTensor's redistributions (including those inside DTensor ops,
such as loss parallelism's reductions), pipeline sends. Bytes sent per rank
use each collective's standard bandwidth-optimal cost (the convention of nccl-tests' bus bandwidth):

============== ======================== =============================================
collective     size ``S`` taken from    bytes sent per rank
============== ======================== =============================================
all-reduce     the tensor               ``2·S·(N−1)/N``
all-gather     the gathered output      ``S·(N−1)/N``
reduce-scatter the input                ``S·(N−1)/N``
broadcast      the tensor               ``S·(N−1)/N`` (ring, averaged over ranks)
all-to-all     the input                bytes of the input not addressed to this rank
send           the tensor               ``S``
============== ======================== =============================================

A dispatch mode sees the thread it was entered on. Collectives that DDP communication hooks issue from their
futures' callbacks (PowerSGD's factors), on the backend's threads, are recorded from ``torch.distributed``'s own
functions instead, for as long as the context is active.

This is what the program asks the network to move; a backend may implement a collective less
efficiently (gloo on CPU runs reduce-scatter as an all-reduce), which this deliberately does not count.
"""

from __future__ import annotations

import functools
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveTraffic", "TrafficRecord", "bytes_sent_per_rank"]

# op name (without overload) -> (kind, index of the tensor(s) whose size S is, index of the group argument)
_C10D_OPS: dict[str, tuple[str, int, int]] = {
    "allreduce_": ("all_reduce", 0, 1),
    "allreduce_coalesced_": ("all_reduce", 0, 1),
    "_allgather_base_": ("all_gather", 0, 2),
    "allgather_": ("all_gather", 0, 2),
    "allgather_coalesced_": ("all_gather", 0, 2),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, 2),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 2),
    "reduce_scatter_": ("reduce_scatter", 1, 2),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 2),
    "broadcast_": ("broadcast", 0, 1),
    "alltoall_base_": ("all_to_all", 1, 2),
    "alltoall_": ("all_to_all", 1, 2),
    "send": ("send", 0, 1),
}
# functional collectives: (kind, index of the tensor(s), index of the group name)
_FUNCTIONAL_OPS: dict[str, tuple[str, int, int]] = {
    "all_reduce": ("all_reduce", 0, 2),
    "all_reduce_coalesced": ("all_reduce", 0, 2),
    "all_gather_into_tensor": ("all_gather", 0, 2),
    "all_gather_into_tensor_coalesced": ("all_gather", 0, 2),
    "reduce_scatter_tensor": ("reduce_scatter", 0, 3),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, 3),
    "all_to_all_single": ("all_to_all", 0, 3),
    "broadcast": ("broadcast", 0, 2),
}


def bytes_sent_per_rank(kind: str, nbytes: int, group_size: int) -> float:
    """Bandwidth-optimal bytes one rank sends for a collective over ``nbytes`` (see the module table).

    For ``all_gather`` ``nbytes`` is the gathered output; for ``all_to_all`` pass the bytes leaving the rank.
    """
    if group_size <= 1:
        return 0.0
    share = (group_size - 1) / group_size
    if kind == "all_reduce":
        return 2 * nbytes * share
    if kind in ("all_gather", "reduce_scatter", "broadcast"):
        return nbytes * share
    if kind in ("all_to_all", "send"):
        return float(nbytes)
    raise ValueError(f"Unknown collective kind {kind!r}.")


@dataclass(frozen=True)
class TrafficRecord:
    kind: str
    group_size: int
    nbytes: int
    bytes_sent: float


# torch.distributed functions a communication hook's callbacks call from other threads -> (kind, tensor argument)
_THREADED_CALLS = {"all_reduce": ("all_reduce", 0), "all_gather_into_tensor": ("all_gather", 0),
                   "reduce_scatter_tensor": ("reduce_scatter", 1)}


class CollectiveTraffic(TorchDispatchMode):
    """Use as a context manager around the code to measure; then read :attr:`bytes_sent` or :meth:`summary`."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[TrafficRecord] = []
        self._thread: Optional[int] = None
        self._originals: dict[str, Any] = {}

    def __enter__(self) -> CollectiveTraffic:
        self._thread = threading.get_ident()
        for name, (kind, index) in _THREADED_CALLS.items():
            self._originals[name] = original = getattr(dist, name)
            setattr(dist, name, self._recording_elsewhere(original, kind, index))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()
        return super().__exit__(*exc)

    def _recording_elsewhere(self, original: Any, kind: str, index: int) -> Any:
        """``original`` (a ``torch.distributed`` function) recording its collective when called on another thread
        than the one the mode sees."""

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self._thread:
                group = kwargs.get("group") or dist.group.WORLD
                nbytes, size = _nbytes(args[index] if len(args) > index else kwargs["tensor"]), group.size()
                if kind == "all_gather":
                    nbytes *= size
                self.records.append(TrafficRecord(kind, size, nbytes, bytes_sent_per_rank(kind, nbytes, size)))
            return original(*args, **kwargs)

        return call

    @property
    def bytes_sent(self) -> float:
        return sum(r.bytes_sent for r in self.records)

    def summary(self) -> dict[str, dict[str, float]]:
        """``{kind: {"calls": n, "bytes_sent": b}}`` over the records so far."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "bytes_sent": 0.0})
        for r in self.records:
            out[r.kind]["calls"] += 1
            out[r.kind]["bytes_sent"] += r.bytes_sent
        return dict(out)

    def reset(self) -> None:
        self.records.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            # Modes run before tensor subclasses: step aside so DTensor desugars the op into local ops and
            # collectives, which then come back here (a mode's own calls would bypass it).
            return NotImplemented
        record = _record(func, args)
        if record is not None:
            self.records.append(record)
        return func(*args, **(kwargs or {}))


def _record(func: Any, args: tuple) -> Optional[TrafficRecord]:
    namespace, name = func.namespace, func._schema.name.split("::")[-1]
    if namespace == "c10d" and name in _C10D_OPS:
        kind, tensor_index, group_index = _C10D_OPS[name]
        group = dist.ProcessGroup.unbox(args[group_index])
        size = group.size()
    elif namespace == "_c10d_functional" and name in _FUNCTIONAL_OPS:
        kind, tensor_index, group_index = _FUNCTIONAL_OPS[name]
        group = dist.distributed_c10d._resolve_process_group(args[group_index])
        size = group.size()
    else:
        return None
    nbytes = _nbytes(args[tensor_index])
    if kind == "all_gather" and namespace == "_c10d_functional":
        nbytes *= size  # the functional op receives the local input; S is the gathered output
    if kind == "all_to_all":
        nbytes -= _bytes_to_self(args, tensor_index, namespace, group, size)
    return TrafficRecord(kind, size, nbytes, bytes_sent_per_rank(kind, nbytes, size))


def _nbytes(value: Any) -> int:
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _bytes_to_self(args: tuple, tensor_index: int, namespace: str, group: dist.ProcessGroup, size: int) -> int:
    """The part of an all-to-all input that stays on this rank."""
    inputs = args[tensor_index]
    rank = group.rank()
    if isinstance(inputs, (list, tuple)):
        return _nbytes(inputs[rank])
    splits = args[2] if namespace == "_c10d_functional" else args[4]
    rows = inputs.shape[0] if inputs.dim() else 1
    row_bytes = _nbytes(inputs) // max(rows, 1)
    own_rows = splits[rank] if splits else rows // size
    return own_rows * row_bytes
