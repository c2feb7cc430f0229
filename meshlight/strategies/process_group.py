"""The process group outside the mesh: starting it (also after a ``torchrun`` restart), Lightning's reductions
over it, and a clean exit while gloo's threads finish."""

from __future__ import annotations

import atexit
import functools
import os
import time
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor
from torch.distributed.tensor import DTensor

from meshlight.strategies.lightning_internals import distributed_is_initialized, init_process_group, world_group

__all__ = ["all_reduce_in_place", "connect", "let_collective_threads_finish"]


def connect(environment: ClusterEnvironment, backend: str, timeout: Optional[timedelta], device_id: Any) -> None:
    """Lightning's process-group initialization, except after a ``torchrun --max-restarts`` restart: there
    torch 2.13 lets gloo read the killed attempt's peer addresses from the agent's store (every rank fails with
    "connectFullMesh … Connection refused"), so the restarted ranks rendezvous under a prefix of their own."""
    _finish_collectives_at_exit()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restart == "0" or dist.is_initialized():
        init_process_group(environment, backend, timeout, device_id)
        return
    timeout = timeout or default_pg_timeout
    store = dist.TCPStore(environment.main_address, environment.main_port, environment.world_size(),
                          is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"meshlight/attempt_{restart}", store),
                            rank=environment.global_rank(), world_size=environment.world_size(), timeout=timeout,
                            device_id=device_id)


@functools.cache
def _finish_collectives_at_exit() -> None:
    """Register :func:`let_collective_threads_finish` to run at exit, once per process."""
    atexit.register(let_collective_threads_finish)


def let_collective_threads_finish() -> None:
    """Release the GIL briefly before the interpreter finalizes.

    gloo's worker threads drop the tensors of the last collective right after it completes, and dropping a
    tensor that Python created takes the GIL. A thread that takes the GIL while Python finalizes is forced
    to exit inside a ``noexcept`` frame: ``terminate called without an active exception`` and SIGABRT, an
    intermittent non-zero exit code after a successful run (seen in ~20% of 4-process runs). Destroying the
    process group here instead could deadlock: its destructor joins threads that are waiting for the GIL.
    """
    if torch.distributed.is_initialized():
        time.sleep(0.05)


def all_reduce_in_place(tensor: Union[Tensor, Any], group: Optional[Any] = None,
                        reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Union[Tensor, Any]:
    """Lightning's ``Strategy.reduce``: ``tensor`` all-reduced over ``group`` (the world by default) in place, a
    DTensor made whole first, anything else returned as it is. Without the barrier Lightning puts before each
    reduction: an all-reduce synchronizes by itself, and on NCCL the barrier also blocks the host on the device
    every logged step."""
    if isinstance(tensor, DTensor):  # e.g. a loss computed on vocabulary-sharded logits
        tensor = tensor.full_tensor()
    if not isinstance(tensor, Tensor) or not distributed_is_initialized():
        return tensor
    group = world_group() if group is None else group
    reduce_op = "avg" if reduce_op == "mean" else reduce_op
    average = isinstance(reduce_op, str) and reduce_op.lower() == "avg"
    if average or reduce_op is None:  # an average as a sum, then a division: gloo has no AVG
        op = ReduceOp.SUM
    else:
        op = getattr(ReduceOp, reduce_op.upper()) if isinstance(reduce_op, str) else reduce_op
    dist.all_reduce(tensor, op=op, group=group)
    if not average:
        return tensor
    size = dist.get_world_size(group)
    if torch.is_floating_point(tensor):
        return tensor.div_(size)
    return tensor.div_(size, rounding_mode="trunc")  # exact for integers (no float round trip)
