"""SIGTERM — a scheduler's preemption, ``scancel``, ``kill`` — stops every rank after the same step.

Lightning (2.6 here) answers SIGTERM with a broadcast from rank 0 inside the signal handler, and another at the
start of every step; a rank that received the signal raises ``SIGTERMException`` at the end of its own step. A
collective inside a signal handler runs wherever the signal lands: a rank interrupted between the sends and
receives of a pipeline schedule waits in that broadcast for a peer that waits for it (all 8 processes of
``examples/train_gpt.py``, dp=2 × pp=2 × tp=2, were still alive 60 s after SIGTERM), and a rank that raised
alone leaves the others waiting in the next step.

Under meshlight's strategies the handler only notes the signal (and, in a launching rank, passes it to the
ranks it started, as Lightning's does). The ranks agree at the start of the batch that ends an optimizer step —
one all-reduce (max) of a flag over the world, in place of Lightning's per-step broadcast — so a signal seen by
any rank stops them all: every rank finishes that step and raises ``SIGTERMException`` from the same place,
where ``DistributedCheckpoint`` saves the step (a collective write, which needs every rank there). Outside
fitting (``validate``, ``test``) they agree at every batch.

The signal waits for that point: the rest of a step or accumulation window, or, during fitting's validation,
the next training batch. A scheduler's grace period before SIGKILL (SLURM's ``KillWait``, torchrun's 30 s,
Kubernetes' ``terminationGracePeriodSeconds``) must cover it and the checkpoint's write.
"""

from __future__ import annotations

from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector, log
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message, rank_zero_info

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from meshlight.strategies.mesh import MeshStrategy

__all__ = ["AgreedSigterm"]


class AgreedSigterm(_SignalConnector):
    """Lightning's signal connector whose SIGTERM handler holds no collective; ``agree`` makes the flag common."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        self.seen = False  # this rank received SIGTERM; ``received_sigterm`` is set only once every rank agrees

    @classmethod
    def install(cls, trainer: Trainer) -> AgreedSigterm:
        """Replace the trainer's connector (before ``fit`` registers its handlers) and Lightning's per-step
        broadcast of rank 0's flag, which ``agree`` supersedes."""
        if not isinstance(trainer._signal_connector, cls):
            trainer._signal_connector = cls(trainer)
        epoch_loop = trainer.fit_loop.epoch_loop
        if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
            epoch_loop._broadcast_sigterm_tensor = lambda: None
        return trainer._signal_connector

    def register_signal_handlers(self) -> None:
        self.seen = False
        super().register_signal_handlers()

    def _sigterm_notifier_fn(self, signum: Any, _: FrameType) -> None:
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", self.trainer.local_rank))
        if not self.seen:
            launcher = self.trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # the ranks this process started (a no-op elsewhere)
        self.seen = True

    def agree(self, strategy: MeshStrategy) -> None:
        """Every rank calls this at the same point: afterwards ``received_sigterm`` is True on all of them if
        any has seen SIGTERM, and Lightning's loops raise ``SIGTERMException`` at their next check."""
        if self.received_sigterm:
            return
        seen = self.seen
        if dist.is_initialized() and self.trainer.world_size > 1:
            flag = torch.tensor([float(seen)], device=strategy.root_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            seen = bool(flag.item())
        if seen:
            self.received_sigterm = True
            rank_zero_info(f"SIGTERM: every rank stops after step {self.trainer.global_step + 1}"
                           if self.trainer.state.fn == TrainerFn.FITTING else "SIGTERM: every rank stops here")

    def at_train_batch_start(self, strategy: MeshStrategy) -> None:
        """Agree on the batch that ends an optimizer step (not within an accumulation window)."""
        if not self.trainer.fit_loop.epoch_loop._should_accumulate():
            self.agree(strategy)

    def at_evaluation_step(self, strategy: MeshStrategy) -> None:
        """Agree at every batch of ``validate`` and ``test``, whose distributed samplers give every rank as many
        batches; during fitting, wait for training. Where ranks may run different numbers of batches (``predict``'s
        samplers, ``use_distributed_sampler=False``) a collective could wait forever: each rank stops on its own,
        as under Lightning (whose prediction loop does not stop on SIGTERM)."""
        fn = self.trainer.state.fn
        if fn == TrainerFn.FITTING:
            return
        if fn == TrainerFn.PREDICTING or not self.trainer._accelerator_connector.use_distributed_sampler:
            self.received_sigterm = self.seen
        else:
            self.agree(strategy)
