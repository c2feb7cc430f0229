"""Exact mid-epoch resume with plain ``DataLoader``s: the sampler skips the indices an interrupted epoch had
already consumed — indices only, no sample is loaded — so the resumed run sees exactly the batches the
uninterrupted one would have."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from torch.utils.data import Sampler

__all__ = ["ResumableSampler"]


class ResumableSampler(Sampler[int]):
    """``sampler``'s indices for this epoch, after the first ``consumed_batches() × batch_size`` of them.

    ``consumed_batches`` is asked when iteration starts: the trainer's count of batches already processed in
    the current epoch — 0 at a normal epoch start, the restored count right after resuming mid-epoch.
    ``set_epoch`` is forwarded, so a ``DistributedSampler`` shuffles exactly as it did before the interruption.
    """

    def __init__(self, sampler: Sampler, batch_size: int, consumed_batches: Callable[[], int]) -> None:
        self.sampler, self.batch_size, self.consumed_batches = sampler, batch_size, consumed_batches

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.consumed_batches() * self.batch_size, None)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
