"""Signals from a scheduler — SIGTERM (preemption, ``scancel``, ``kill``) and SLURM's requeue signal — act on
every rank after the same step.

Lightning (2.6 here) answers SIGTERM with a broadcast from rank 0 inside the signal handler, and another at the
start of every step; a rank that received the signal raises ``SIGTERMException`` at the end of its own step. On
SLURM with auto-requeue (``#SBATCH --signal=USR1@90``) its SIGUSR1 handler writes a checkpoint — under meshlight
a collective — from inside the handler too. A collective inside a signal handler runs wherever the signal lands:
a rank interrupted between the sends and receives of a pipeline schedule waits there for a peer that waits for
it (all 8 processes of ``examples/train_gpt.py``, dp=2 × pp=2 × tp=2, were still alive 60 s after SIGTERM), and
a rank that raised alone leaves the others waiting in the next step.

Under meshlight's strategies the handlers only note the signal (SIGTERM's, in a launching rank, also passes it
to the ranks it started, as Lightning's does). The ranks agree at the start of the batch that ends an optimizer
step — one all-reduce (max) of both flags over the world, in place of Lightning's per-step broadcast — so a
signal seen by any rank acts on them all:

- SIGTERM: every rank finishes that step and raises ``SIGTERMException`` from the same place, where
  ``DistributedCheckpoint`` saves the step (a collective write, which needs every rank there). Outside fitting
  (``validate``, ``test``) they agree at every batch.
- The requeue signal, while fitting: at the end of that step (where Lightning's checkpoint callbacks save, so
  the resumed run continues exactly) every rank writes ``hpc_ckpt_<n>.ckpt`` in the trainer's
  ``default_root_dir`` — what the requeued job's ``fit`` without ``ckpt_path`` resumes from (``meshlight.Trainer``:
  unless ``DistributedCheckpoint`` holds a newer step) — then global rank 0 runs ``scontrol requeue`` (tried
  again on a failure or a hang), and training goes on until the scheduler stops it. Older ``hpc_ckpt_*`` in
  that folder are removed once the new one is committed (give each job, or array task, its own); a resume
  that finds the newest one interrupted (the job was killed while writing it) takes the newest whole one, with
  a warning. The signal acts once per ``fit``. If that step is training's last, nothing is written or
  requeued. Outside fitting there is nothing to save: rank 0 requeues at once.

The signal waits for that point: the rest of a step or accumulation window, or, during fitting's validation,
the next training batch. A scheduler's grace period before SIGKILL (SLURM's ``KillWait``, torchrun's 30 s,
Kubernetes' ``terminationGracePeriodSeconds``) must cover it and the write; ``--signal``'s lead time before the
time limit must cover it, the write and ``scontrol``, which runs only once the checkpoint is committed.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from typing import TYPE_CHECKING, Any, Optional

import fsspec
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message, rank_zero_info, rank_zero_warn

from meshlight.parallel.checkpoint import is_complete, is_interrupted, numbered_entries
from meshlight.strategies.lightning_internals import (
    SignalConnector,
    accumulating,
    epoch_ends_with_this_batch,
    hpc_checkpoint_path,
    install_signal_connector,
    signal_connector,
    signal_log,
    skip_sigterm_broadcast,
    uses_distributed_sampler,
)

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from meshlight.strategies.mesh import MeshStrategy

__all__ = ["AgreedSignals", "newest_hpc_checkpoint", "newest_whole_hpc_checkpoint", "requeue_slurm_job"]

#: the checkpoints Lightning writes on SLURM's requeue signal and resumes from (``hpc_checkpoint_path``)
HPC_CHECKPOINT = re.compile(r"^hpc_ckpt_(\d+)\.ckpt$")
#: seconds one ``scontrol requeue`` may take, and the wait before the n-th retry is n times this
SCONTROL_TIMEOUT, RETRY_WAIT = 20.0, 2.0


class AgreedSignals(SignalConnector):
    """Lightning's signal connector whose handlers hold no collective; ``agree`` makes the flags common."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        self._reset()

    def _reset(self) -> None:
        self.seen = False  # this rank received SIGTERM; ``received_sigterm`` is set only once every rank agrees
        self.requeue_seen = False  # this rank received the requeue signal while fitting
        #: None, then "agreed" (every rank saves and requeues at the next step boundary), then "done": the
        #: signal acts once per fit, however many ranks see it and whenever
        self.requeue: Optional[str] = None

    @classmethod
    def install(cls, trainer: Trainer) -> AgreedSignals:
        """Replace the trainer's connector (before ``fit`` registers its handlers) and Lightning's per-step
        broadcast of rank 0's flag, which ``agree`` supersedes."""
        connector = install_signal_connector(trainer, cls)
        skip_sigterm_broadcast(trainer)
        if not any(isinstance(callback, _AtStepEnd) for callback in trainer.callbacks):
            trainer.callbacks.append(_AtStepEnd())  # strategies have no hook there; last, after the user's
        return connector

    def register_signal_handlers(self) -> None:
        self._reset()
        super().register_signal_handlers()

    def on_sigterm(self, signum: Any) -> None:
        signal_log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", self.trainer.local_rank))
        if not self.seen:
            launcher = self.trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # the ranks this process started (a no-op elsewhere)
        self.seen = True

    def on_requeue_signal(self, signum: Any) -> None:
        signal_log.info(rank_prefixed_message(f"Received SLURM's requeue signal: {signum}", self.trainer.local_rank))
        if self.trainer.state.fn == TrainerFn.FITTING:
            self.requeue_seen = True
        elif self.requeue is None:
            self.requeue = "done"
            if self.trainer.is_global_zero:
                requeue_slurm_job()  # nothing to save, no collective: requeue now

    def agree(self, strategy: MeshStrategy) -> None:
        """Every rank calls this at the same point: afterwards ``received_sigterm`` is True (``requeue`` is
        "agreed") on all of them if any has seen SIGTERM (the requeue signal); Lightning's loops raise
        ``SIGTERMException`` at their next check."""
        if self.received_sigterm:
            return
        seen = [self.seen, self.requeue_seen and self.requeue is None]
        if dist.is_initialized() and self.trainer.world_size > 1:
            flags = torch.tensor(seen, dtype=torch.float32, device=strategy.root_device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            seen = [bool(flag) for flag in flags.tolist()]
        fitting = self.trainer.state.fn == TrainerFn.FITTING
        if seen[1]:
            self.requeue = "agreed"
            rank_zero_info(f"SLURM's requeue signal: every rank saves after step {self.trainer.global_step + 1}")
        if seen[0]:
            self.received_sigterm = True
            rank_zero_info(f"SIGTERM: every rank stops after step {self.trainer.global_step + 1}" if fitting
                           else "SIGTERM: every rank stops here")

    def at_train_batch_start(self, strategy: MeshStrategy) -> None:
        """Agree on the batch that ends an optimizer step (not within an accumulation window)."""
        if not accumulating(self.trainer):
            self.agree(strategy)

    def at_train_batch_end(self) -> None:
        """After the step at which the ranks agreed to requeue — where Lightning's own checkpoint callbacks save,
        so that resuming continues exactly — write the checkpoint, unless training ends with this step."""
        if self.requeue != "agreed":
            return
        self.requeue = "done"
        if _finishes_training(self.trainer):
            rank_zero_info("SLURM's requeue signal: training ends with this step, the job is not requeued")
        else:
            self._save_and_requeue()

    def at_evaluation_step(self, strategy: MeshStrategy) -> None:
        """Agree at every batch of ``validate`` and ``test``, whose distributed samplers give every rank as many
        batches; during fitting, wait for training. Where ranks may run different numbers of batches (``predict``'s
        samplers, ``use_distributed_sampler=False``) a collective could wait forever: each rank stops on its own,
        as under Lightning (whose prediction loop does not stop on SIGTERM)."""
        fn = self.trainer.state.fn
        if fn == TrainerFn.FITTING:
            return
        if fn == TrainerFn.PREDICTING or not uses_distributed_sampler(self.trainer):
            self.received_sigterm = self.seen
        else:
            self.agree(strategy)

    def _save_and_requeue(self) -> None:
        """On every rank at the same step boundary: write the checkpoint Lightning resumes a requeued job from,
        remove the older ones (global rank 0) and requeue the job (global rank 0)."""
        trainer = self.trainer
        trainer.strategy.wait_for_checkpoint()  # a background write in flight finishes before another starts
        for logger in trainer.loggers:
            logger.save()
        path = hpc_checkpoint_path(trainer)
        trainer.save_checkpoint(path)  # every rank writes its shards of global rank 0's path
        if trainer.is_global_zero:
            rank_zero_info(f"SLURM's requeue signal: saved {path}")
            _remove_other_hpc_checkpoints(path)
            requeue_slurm_job()


class _AtStepEnd(Callback):
    """Calls the strategy's signal connector at the end of every training batch."""

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        connector = signal_connector(trainer)
        if isinstance(connector, AgreedSignals):
            connector.at_train_batch_end()


def _finishes_training(trainer: Trainer) -> bool:
    """Whether the step just taken is the run's last: ``max_steps`` reached, or the last batch of the last epoch."""
    if trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps:
        return True
    last_epoch = trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs
    return last_epoch and epoch_ends_with_this_batch(trainer)


def requeue_slurm_job(attempts: int = 3) -> bool:
    """``scontrol requeue`` this job (an array job's task); whether ``scontrol`` accepted it. A failure or a
    hang (a busy ``slurmctld`` times out) is tried again, up to ``attempts`` times, waiting longer each time."""
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array_job}_{array_task}" if array_job and array_task else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        rank_zero_warn(f"SLURM's requeue signal: no job to requeue (SLURM_JOB_ID={job!r}).")
        return False
    timed_out = False
    for attempt in range(1, attempts + 1):
        try:
            result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                                    timeout=SCONTROL_TIMEOUT)
        except FileNotFoundError:
            rank_zero_warn(f"SLURM's requeue signal: `scontrol` is not on PATH; job {job} was not requeued.")
            return False
        except subprocess.TimeoutExpired:
            problem, timed_out = f"no answer in {SCONTROL_TIMEOUT:g} s", True
        else:
            if result.returncode == 0:
                rank_zero_info(f"SLURM's requeue signal: requeued job {job}")
                return True
            problem = f"{result.returncode}: {result.stderr.strip()}"
        # an unanswered request may still have been carried out: then the retries fail, the job being pending
        last = (f"; job {job} may not be requeued: see `scontrol show job {job}`" if timed_out
                else "; job not requeued")
        again = f"; trying again in {RETRY_WAIT * attempt:g} s" if attempt < attempts else last
        rank_zero_warn(f"`scontrol requeue {job}` failed ({problem}), attempt {attempt} of {attempts}{again}.")
        if attempt < attempts:
            time.sleep(RETRY_WAIT * attempt)
    return False


def newest_whole_hpc_checkpoint(path: str) -> str:
    """``path``, or — when it is an ``hpc_ckpt_<n>.ckpt`` whose save was interrupted (the job was killed while
    writing it) — the newest whole one beside it. Lightning picks the highest ``n`` to resume a requeued job
    from, whole or not."""
    name = os.path.basename(str(path).rstrip("/"))
    if not HPC_CHECKPOINT.match(name) or not is_interrupted(path):
        return path
    whole = newest_hpc_checkpoint(os.path.dirname(str(path).rstrip("/")))
    if whole is None:
        return path  # loading it raises CheckpointError, which says what happened
    rank_zero_info(f"Resuming from {whole}, the newest whole one.")
    return whole


def newest_hpc_checkpoint(folder: str) -> Optional[str]:
    """The highest-numbered whole ``hpc_ckpt_<n>.ckpt`` in ``folder``, or None; warns of those above it that the
    job was killed while writing."""
    found = numbered_entries(folder, HPC_CHECKPOINT)
    for number in sorted(found, reverse=True):
        if is_complete(found[number]):
            return found[number]
        if is_interrupted(found[number]):
            rank_zero_warn(f"{found[number]} was interrupted while being written: skipped.")
    return None


def _remove_other_hpc_checkpoints(path: str) -> None:
    """Keep ``path``, just committed: remove the older ``hpc_ckpt_*`` folders beside it, whole or interrupted."""
    folder = os.path.dirname(str(path).rstrip("/"))
    fs, _ = fsspec.core.url_to_fs(folder)
    for other in numbered_entries(folder, HPC_CHECKPOINT).values():
        if os.path.basename(other) != os.path.basename(path):
            fs.rm(fsspec.core.url_to_fs(other)[1], recursive=True)
