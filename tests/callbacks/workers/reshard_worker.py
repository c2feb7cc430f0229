"""torchrun worker: 3-D training under (dp, pp, tp) = (2, 2, 2) resumes exactly after a SIGKILL and after a
SIGTERM, and its checkpoint resumes under other layouts.

    kill DIR            8 processes: train under "3d" with dropout 0.1 and asynchronous checkpoints every 5 steps
                        into DIR/killed; every rank SIGKILLs itself right after step 12
    term DIR OUT        8 processes: the same into DIR/term, but rank 5 alone sends itself SIGTERM as the batch of
                        step 7 starts; then validate, rank 5 sending itself SIGTERM as validation batch 7 (of 28)
                        starts; rank 0 writes each rank's (exception raised, global step or validation batch then)
    requeue DIR OUT     8 processes as tasks of a faked SLURM job (auto-requeue; its `scontrol` logs the call and
                        sends SIGTERM to its caller, global rank 0, as SLURM's requeue stops the job): rank 5 alone
                        sends itself SIGUSR1 as the batch of step 7 starts; default_root_dir DIR/requeue, no
                        checkpoint callback. Rank 0 writes each rank's (exception raised, global step then)
    save DIR OUT        8 processes: train 20 steps uninterrupted (synchronous checkpoints every 5 steps, all
                        kept, into DIR/full), then fit(ckpt_path="last") from DIR/term to step 20; then, as the
                        requeued SLURM job, fit without ckpt_path in DIR/requeue; then 20 steps uninterrupted with
                        dropout and fit(ckpt_path="last") from DIR/killed. Rank 0 writes the full weights at step
                        10, the uninterrupted losses (with and without dropout) and those of the steps resumed after
                        the SIGTERM, the requeue and the SIGKILL
    resume DIR OUT NAME resume DIR/full's step-10 checkpoint under NAME (ddp, zero3 or single) to step 15; rank 0
                        writes the full weights right after loading and the losses of steps 11–15

Epochs are 8 steps long (as in resume_worker), so step 10 is mid-epoch. Dropout is off — the losses of a run
resumed under another layout are compared with the 3-D run's, and every layout draws its own dropout masks — except
in the killed run and the uninterrupted one it is compared with: with every random stream in use, a resume that is
exact with dropout is exact without it (the SIGTERM and requeue resumes, dropout-free, check that too).
"""

import os
import signal
import stat
import sys
from contextlib import contextmanager
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

import meshlight as ml
from meshlight.callbacks import DistributedCheckpoint
from tests.callbacks.workers.resume_worker import GLOBAL_BATCH, KILL_AFTER, MAX_STEPS, STEPS_PER_EPOCH, Losses, model
from tests.strategies.parity import full_weights

EVERY, RESHARD_AT, RESHARD_TO, TERM_AT, TERM_RANK = 5, 10, 15, 7, 5
DROPOUT = 0.1  # of the runs killed and resumed with dropout on
STRATEGIES = {"3d": lambda: ml.Hybrid3DStrategy(dp=2, pp=2, tp=2, ep=1, zero=1), "ddp": lambda: "ddp",
              "zero3": lambda: "zero3", "single": lambda: "ddp"}


class Weights(Callback):
    """The full weights at step ``at``: right after loading a checkpoint of that step, or after training it."""

    def __init__(self, at: int) -> None:
        self.at, self.weights = at, {}

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.global_step == self.at:
            self.weights = full_weights(module)

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: object) -> None:
        if trainer.global_step == self.at:
            self.weights = full_weights(module)


class StopAfter(Callback):
    """Ends training after step ``step`` (``max_steps`` stays, and with it the learning-rate schedule)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        trainer.should_stop = trainer.should_stop or trainer.global_step >= self.step


class SignalAt(Callback):
    """Rank ``TERM_RANK`` alone sends itself ``signum`` as the batch of step ``TERM_AT`` starts (in ``validate``: as
    validation batch ``TERM_AT`` starts); ``stopped`` is the exception the run ended with and the global step (the
    validation batch) then."""

    stopped: tuple[str, int] = ("none", 0)

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signum

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        self._at(trainer, trainer.global_step + 1)

    def on_validation_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: object,
                                  batch_idx: int, *args: object) -> None:
        self.batch = batch_idx
        if not trainer.training:
            self._at(trainer, batch_idx)

    def _at(self, trainer: pl.Trainer, where: int) -> None:
        if where == TERM_AT and trainer.global_rank == TERM_RANK:
            os.kill(os.getpid(), self.signum)

    def on_exception(self, trainer: pl.Trainer, module: pl.LightningModule, exception: BaseException) -> None:
        self.stopped = (type(exception).__name__, trainer.global_step if trainer.training else self.batch)


@contextmanager
def slurm_job(directory: Path):
    """This rank as a task of a SLURM job (as srun starts it; not torchrun's), whose ``scontrol`` appends its
    arguments to ``directory/scontrol.log`` and sends SIGTERM to its caller."""
    world, rank = os.environ["WORLD_SIZE"], os.environ["RANK"]
    bin_dir = directory / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    scontrol, calls = bin_dir / "scontrol", directory / "scontrol.log"
    if rank == "0":
        scontrol.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\nkill -TERM $PPID\n')
        scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    saved = dict(os.environ)
    os.environ.update({
        "SLURM_NTASKS": world, "SLURM_NTASKS_PER_NODE": world, "SLURM_NNODES": "1", "SLURM_PROCID": rank,
        "SLURM_LOCALID": rank, "SLURM_NODEID": "0", "SLURM_NODELIST": "127.0.0.1", "SLURM_JOB_NAME": "train",
        "SLURM_JOB_ID": "4242", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    del os.environ["TORCHELASTIC_RUN_ID"]  # no longer detected as torchrun's (which Lightning would prefer)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def train(name: str, checkpoint: DistributedCheckpoint = None, *, stop_after: int = MAX_STEPS, ckpt_path: str = None,
          kill: bool = False, callbacks: tuple[Callback, ...] = (), root: Path = None,
          dropout: float = 0.0) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    world = int(os.environ["WORLD_SIZE"])
    dp = 2 if name == "3d" else world
    pl.seed_everything(0, verbose=False)
    losses, weights = Losses(kill), Weights(RESHARD_AT)
    trainer = ml.Trainer(strategy=STRATEGIES[name](), devices=world, accelerator="cpu", max_steps=MAX_STEPS,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         enable_checkpointing=checkpoint is not None, default_root_dir=root,
                         callbacks=[losses, weights, StopAfter(stop_after), *callbacks]
                         + ([checkpoint] if checkpoint else []))
    data = ml.demos.AdditionDataModule(3, batch_size=GLOBAL_BATCH // dp, train_size=GLOBAL_BATCH * STEPS_PER_EPOCH)
    trainer.fit(model(0, dropout=dropout), data, ckpt_path=ckpt_path)
    return losses.losses, weights.weights


def main(mode: str, directory: Path, out: str = "", name: str = "3d") -> None:
    if mode == "kill":
        train("3d", DistributedCheckpoint(directory / "killed", every_n_train_steps=EVERY, keep_last_k=2), kill=True,
              dropout=DROPOUT)
        return
    if mode == "term":
        term, validated = SignalAt(), SignalAt()
        try:
            train("3d", DistributedCheckpoint(directory / "term", every_n_train_steps=EVERY), callbacks=(term,))
        except SIGTERMException:
            pass
        trainer = ml.Trainer(strategy=STRATEGIES["3d"](), devices=8, accelerator="cpu", logger=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[validated])
        data = ml.demos.AdditionDataModule(3, batch_size=GLOBAL_BATCH // 2, val_size=GLOBAL_BATCH * 4 * TERM_AT)
        try:
            trainer.validate(model(0, dropout=0.0), data)
        except SIGTERMException:
            pass
        result = {"fit": [None] * dist.get_world_size(), "validate": [None] * dist.get_world_size()}
        dist.all_gather_object(result["fit"], term.stopped)
        dist.all_gather_object(result["validate"], validated.stopped)
    elif mode == "requeue":
        requeued = SignalAt(signal.SIGUSR1)
        with slurm_job(directory):
            try:
                train("3d", callbacks=(requeued,), root=directory / "requeue")
            except SIGTERMException:
                pass
        result = {"fit": [None] * dist.get_world_size()}
        dist.all_gather_object(result["fit"], requeued.stopped)
    elif mode == "save":
        losses, weights = train("3d", DistributedCheckpoint(directory / "full", every_n_train_steps=EVERY,
                                                            save_top_k=-1, async_save=False))
        after_term, _ = train("3d", DistributedCheckpoint(directory / "term", every_n_train_steps=EVERY),
                              ckpt_path="last")
        with slurm_job(directory):
            after_requeue, _ = train("3d", root=directory / "requeue")
        # with dropout: every random stream (data ranks', pipeline stages', tensor ranks' under sequence
        # parallelism) continues where the uninterrupted run had it
        dropped, _ = train("3d", dropout=DROPOUT)
        resumed_dropped, _ = train("3d", DistributedCheckpoint(directory / "killed", every_n_train_steps=EVERY,
                                                               keep_last_k=2), ckpt_path="last", dropout=DROPOUT)
        result = {"weights": weights, "losses": losses, "resumed_after_term": after_term,
                  "resumed_after_requeue": after_requeue, "dropout losses": dropped,
                  "dropout resumed": resumed_dropped}
    else:
        saved = directory / "full" / f"step={RESHARD_AT:09d}"
        losses, weights = train(name, stop_after=RESHARD_TO, ckpt_path=str(saved))
        result = {"weights": weights, "losses": losses}
    if dist.get_rank() == 0:
        torch.save(result, out)


assert KILL_AFTER > RESHARD_AT  # the killed run has committed step 10 (or at least step 5) when it dies

if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
