"""Optimizer state on a local disk (ZeRO-Infinity's NVMe offload): between steps each rank's optimizer moments
live in files, and the step brings them through host memory a chunk at a time.

:class:`OptimizerStateOnDisk` attaches to a torch optimizer. Its parameters are cut, in order, into chunks of
about ``chunk_bytes`` of state; each chunk's state tensors are one file. The optimizer's ``step`` then runs chunk
by chunk (its parameter groups narrowed to the chunk's parameters), with one background thread reading the next
chunk while the current one steps and writing each stepped chunk behind: host memory holds at most three chunks'
state instead of all of it. A chunk holds whole parameters, so a parameter whose state exceeds ``chunk_bytes`` is a
chunk of its own. The first two chunks are read as soon as ``step`` is called, while Lightning's closure
runs forward and backward. Step hooks (and an LR scheduler's step count) see one step.

What is kept in files: the state tensors of a parameter's own size (Adam's two moments, SGD's momentum); scalars
such as Adam's step count stay in memory. ``state_dict`` reads everything back for the checkpoint (so a save holds
the whole state in host memory while it runs) and ``load_state_dict`` writes the loaded state to the files, so
checkpoints are those of the optimizer without offload: exact resume and resharding work as always.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import shutil
import types
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from meshlight.parallel.dtensors import DTensorSpec, as_dtensor_like, dtensor_spec, local_tensor

__all__ = ["OptimizerStateOnDisk", "check_disk", "put_on_disk", "return_large_blocks", "state_bytes_estimate"]

_ALIGNMENT = 64  # bytes: every state tensor starts aligned in its chunk's buffer
_ON_DISK = torch.empty(0)  # what the optimizer's state holds for a tensor in a file


def state_bytes_estimate(optimizer: Optimizer) -> int:
    """The bytes an Adam-like optimizer keeps per rank for ``optimizer``'s parameters: two moments per value."""
    return sum(2 * local_tensor(p).numel() * local_tensor(p).element_size()
               for group in optimizer.param_groups for p in group["params"] if p.requires_grad)


def check_disk(path: Path, needed: int, *, usage: Optional[Callable[[str], Any]] = None) -> None:
    """Refuse, before training, a ``path`` that is missing, not a writable folder, or has less than ``needed`` bytes
    free; each in one sentence with the fix."""
    if not path.exists():
        raise ValueError(f"Offload(optimizer='nvme', path={str(path)!r}): the folder does not exist; create it on a"
                         " local disk (NVMe) or pass another path.")
    probe = path / f".meshlight-write-test-{os.getpid()}"  # ranks sharing the folder check at once
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise ValueError(f"Offload(optimizer='nvme', path={str(path)!r}): cannot write there ({error.strerror});"
                         " pass a folder this process may write to.") from None
    free = (usage or shutil.disk_usage)(str(path)).free
    if free < needed:
        raise ValueError(f"Offload(optimizer='nvme', path={str(path)!r}): {free / 2**30:.2f} GiB free, and the"
                         f" optimizer state needs {needed / 2**30:.2f} GiB on this disk; free space there or pass a"
                         " path on a larger disk.")


def put_on_disk(optimizers: Sequence[Optimizer], path: Path, rank: int, ranks_on_disk: int,
                chunk_bytes: int = 32 * 2**20) -> list[OptimizerStateOnDisk]:
    """Keep ``optimizers``' state in files under ``path/rank-<rank>``, after checking that ``path`` can hold the
    state of the ``ranks_on_disk`` ranks that share it (this node's); and have glibc's malloc give large freed
    blocks back to the system (:func:`return_large_blocks`)."""
    check_disk(path, ranks_on_disk * sum(state_bytes_estimate(optimizer) for optimizer in optimizers))
    return_large_blocks()
    return [OptimizerStateOnDisk(optimizer, path / f"rank-{rank}" / f"optimizer-{index}", chunk_bytes)
            for index, optimizer in enumerate(optimizers)]


def _host_buffer(nbytes: int) -> Tensor:
    """``nbytes`` of anonymous memory mapped for this buffer alone, given back to the system as soon as the tensor is
    freed: malloc keeps freed blocks of a chunk's size in its heap, where they would stay resident."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)


#: glibc's mallopt parameter for the size from which allocations are memory-mapped (and unmapped when freed)
_M_MMAP_THRESHOLD = -3


def return_large_blocks(threshold: int = 2**20) -> bool:
    """Make glibc's malloc map blocks of ``threshold`` bytes and more on their own, so that freeing one gives it back to
    the system; returns whether it did. By default glibc raises that threshold to the size of large blocks freed (up
    to 32 MB) and keeps later ones in its heap, where the optimizer's transient per-chunk memory — its first step's
    state, its updates' temporaries — stays resident, and the state on disk would free much less host memory than
    its size (in trials here, about half). Process-wide, as the ``MALLOC_MMAP_THRESHOLD_`` variable is; left alone
    where that variable is set or the C library is not glibc."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


@dataclass
class _Slot:
    """Where one state tensor lives in its chunk's buffer (contiguous)."""

    param: Tensor
    key: str
    offset: int
    dtype: torch.dtype
    shape: torch.Size
    spec: Optional[DTensorSpec]

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def view(self, buffer: Tensor) -> Tensor:
        """This state tensor, as a view into its chunk's ``buffer``."""
        local = buffer[self.offset:self.offset + self.nbytes].view(self.dtype).view(self.shape)
        return as_dtensor_like(local, self.spec)


@dataclass
class _Chunk:
    """A run of parameters whose state is one file; ``attached``: the state tensors last put back from a buffer
    (the step updates them in place, so that buffer is what is written back), with that ``buffer``."""

    params: list[Tensor]
    file: Path
    slots: list[_Slot] = field(default_factory=list)
    nbytes: int = 0
    buffer: Optional[Tensor] = None
    attached: list[Tensor] = field(default_factory=list)

    @property
    def on_disk(self) -> bool:
        return bool(self.slots)


class OptimizerStateOnDisk:
    """Keep ``optimizer``'s state in files under ``directory`` between steps (see the module docstring).

    ``read_bytes`` and ``written_bytes`` count the traffic; ``close`` waits for the writes and removes the files."""

    def __init__(self, optimizer: Optimizer, directory: Path, chunk_bytes: int = 32 * 2**20) -> None:
        raw = getattr(type(optimizer).step, "__wrapped__", None)
        if raw is None:
            raise TypeError(f"Offload(optimizer='nvme') steps {type(optimizer).__name__} chunk by chunk through its"
                            " undecorated step, which it lacks: use a torch.optim optimizer.")
        self.optimizer, self.directory, self.chunk_bytes = optimizer, directory, chunk_bytes
        directory.mkdir(parents=True, exist_ok=True)
        self._raw_step = raw
        self._io = ThreadPoolExecutor(1, thread_name_prefix="meshlight-nvme")
        self._writes: deque[Future[None]] = deque()
        self.chunks = self._cut()
        self.read_bytes = self.written_bytes = 0
        previous = optimizer.step
        hooked = Optimizer.profile_hook_step(self._step)  # pre/post step hooks once per step

        @functools.wraps(previous)
        def step(self: Optimizer, closure: Optional[Callable[[], Any]] = None) -> Any:
            self._opt_called = True  # what an LR scheduler's step wrapper records (torch checks it)
            return hooked(self, closure)

        if hasattr(previous, "_wrapped_by_lr_sched"):
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
        optimizer.register_state_dict_pre_hook(lambda _: self.bring_back())
        optimizer.register_state_dict_post_hook(self._after_state_dict)
        optimizer.register_load_state_dict_post_hook(lambda _: self.put_away())

    def _cut(self) -> list[_Chunk]:
        chunks: list[_Chunk] = []
        size = self.chunk_bytes
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                state = 2 * local_tensor(param).numel() * local_tensor(param).element_size()
                if not chunks or size + state > self.chunk_bytes and chunks[-1].params:
                    chunks.append(_Chunk([], self.directory / f"chunk-{len(chunks)}.bin"))
                    size = 0
                chunks[-1].params.append(param)
                size += state
        return chunks

    # ---------------------------------------------------------------- the step

    def _step(self, optimizer: Optimizer, closure: Optional[Callable[[], Any]] = None) -> Any:
        reads = {i: self._read(i) for i in range(min(2, len(self.chunks)))}
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, chunk in enumerate(self.chunks):
            if index + 1 < len(self.chunks) and index + 1 not in reads:
                reads[index + 1] = self._read(index + 1)
            self._attach(chunk, reads.pop(index).result())
            with self._narrowed_to(chunk):
                self._raw_step(optimizer)
            self.wait()  # one chunk written behind at a time: with the one read ahead, three chunks in memory at most
            self._writes.append(self._io.submit(self._write, chunk, self._detach(chunk)))
        return loss

    @contextmanager
    def _narrowed_to(self, chunk: _Chunk) -> Iterator[None]:
        """The optimizer's parameter groups holding only ``chunk``'s parameters (groups left empty are left out)."""
        groups = self.optimizer.param_groups
        members = {id(p) for p in chunk.params}
        kept = [(group, group["params"]) for group in groups]
        try:
            for group in groups:
                group["params"] = [p for p in group["params"] if id(p) in members]
            self.optimizer.param_groups = [group for group in groups if group["params"]]
            yield
        finally:
            for group, params in kept:
                group["params"] = params
            self.optimizer.param_groups = groups

    def _read(self, index: int) -> Future[Optional[Tensor]]:
        return self._io.submit(self._read_now, self.chunks[index])

    def _read_now(self, chunk: _Chunk) -> Optional[Tensor]:
        if not chunk.on_disk:
            return None
        buffer = _host_buffer(chunk.nbytes)
        with open(chunk.file, "rb", buffering=0) as f:
            f.readinto(memoryview(buffer.numpy()))
        self.read_bytes += chunk.nbytes
        return buffer

    def _attach(self, chunk: _Chunk, buffer: Optional[Tensor]) -> None:
        """Put ``chunk``'s state, read into ``buffer``, back into the optimizer's state."""
        if buffer is None:
            return
        chunk.buffer, chunk.attached = buffer, [slot.view(buffer) for slot in chunk.slots]
        for slot, value in zip(chunk.slots, chunk.attached):
            self.optimizer.state[slot.param][slot.key] = value

    def _detach(self, chunk: _Chunk) -> Tensor:
        """``chunk``'s state in one buffer — the one it was attached from, where the step updated it in place, else
        a copy in a layout made anew — with placeholders left in the optimizer's state."""
        entries = [(param, key, value) for param in chunk.params
                   for key, value in self.optimizer.state.get(param, {}).items()
                   if isinstance(value, Tensor) and value is not _ON_DISK and local_tensor(value).numel() > 1]
        buffer, chunk.buffer = chunk.buffer, None
        unchanged = len(entries) == len(chunk.attached) and all(
            value is attached for (*_, value), attached in zip(entries, chunk.attached))
        if buffer is None or not unchanged:
            slots, offset = [], 0
            for param, key, value in entries:
                local = local_tensor(value)
                slots.append(_Slot(param, key, offset, local.dtype, local.shape, dtensor_spec(value)))
                offset += -(-local.numel() * local.element_size() // _ALIGNMENT) * _ALIGNMENT
            chunk.slots, chunk.nbytes = slots, offset
            buffer = _host_buffer(offset)
            for slot, (*_, value) in zip(slots, entries):
                local_tensor(slot.view(buffer)).copy_(local_tensor(value))
        chunk.attached = []
        for slot in chunk.slots:
            self.optimizer.state[slot.param][slot.key] = _ON_DISK
        return buffer

    def _write(self, chunk: _Chunk, buffer: Tensor) -> None:
        with open(chunk.file, "wb", buffering=0) as f:
            f.write(memoryview(buffer.numpy()))
        self.written_bytes += buffer.numel()

    # ---------------------------------------------------------------- checkpoints and the end

    def bring_back(self) -> None:
        """Read every chunk's state back into the optimizer's state (for ``state_dict``)."""
        self.wait()
        for chunk in self.chunks:
            if chunk.on_disk and self._placeholders(chunk):
                self._attach(chunk, self._read_now(chunk))

    def _after_state_dict(self, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        # the state dict holds the optimizer's own per-parameter dicts: its own copies keep the values
        state["state"] = {index: dict(entry) for index, entry in state["state"].items()}
        for chunk in self.chunks:  # the files still hold these values: let go of the memory
            chunk.buffer, chunk.attached = None, []
            for slot in chunk.slots:
                optimizer.state[slot.param][slot.key] = _ON_DISK
        return state

    def put_away(self) -> None:
        """Write the optimizer's state (just loaded) to the files and let go of it in memory."""
        self.wait()
        for chunk in self.chunks:
            if not self._placeholders(chunk):
                self._write(chunk, self._detach(chunk))

    def _placeholders(self, chunk: _Chunk) -> bool:
        return any(self.optimizer.state.get(slot.param, {}).get(slot.key) is _ON_DISK for slot in chunk.slots)

    def wait(self) -> None:
        """Block until the state written behind the last step is in its files."""
        while self._writes:
            self._writes.popleft().result()

    def close(self) -> None:
        """Finish the writes, stop the thread and remove the files."""
        self.wait()
        self._io.shutdown()
        shutil.rmtree(self.directory, ignore_errors=True)
