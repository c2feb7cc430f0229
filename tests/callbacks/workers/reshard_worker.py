"""torchrun worker: 3-D training under (dp, pp, tp) = (2, 2, 2) resumes exactly after a SIGKILL and after a
SIGTERM, and its checkpoint resumes under other layouts.

    kill DIR            8 processes: train under "3d" with asynchronous checkpoints every 5 steps into DIR/killed;
                        every rank SIGKILLs itself right after step 12
    term DIR OUT        8 processes: the same into DIR/term, but rank 5 alone sends itself SIGTERM as the batch of
                        step 7 starts; then validate, rank 5 sending itself SIGTERM as validation batch 7 (of 28)
                        starts; rank 0 writes each rank's (exception raised, global step or validation batch then)
    save DIR OUT        8 processes: train 20 steps uninterrupted (synchronous checkpoints every 5 steps, all
                        kept, into DIR/full), then fit(ckpt_path="last") from DIR/killed and from DIR/term to step
                        20; rank 0 writes the full weights at step 10, the uninterrupted losses and those of the
                        steps resumed after the SIGKILL and after the SIGTERM
    resume DIR OUT NAME resume DIR/full's step-10 checkpoint under NAME (ddp, zero3 or single) to step 15; rank 0
                        writes the full weights right after loading and the losses of steps 11–15

Epochs are 8 steps long (as in resume_worker), so step 10 is mid-epoch.
"""

import os
import signal
import sys
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


class TermAt(Callback):
    """Rank ``TERM_RANK`` alone sends itself SIGTERM as the batch of step ``TERM_AT`` starts (in ``validate``: as
    validation batch ``TERM_AT`` starts); ``stopped`` is the exception the run ended with and the global step (the
    validation batch) then."""

    stopped: tuple[str, int] = ("none", 0)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        self._at(trainer, trainer.global_step + 1)

    def on_validation_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: object,
                                  batch_idx: int, *args: object) -> None:
        self.batch = batch_idx
        if not trainer.training:
            self._at(trainer, batch_idx)

    def _at(self, trainer: pl.Trainer, where: int) -> None:
        if where == TERM_AT and trainer.global_rank == TERM_RANK:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_exception(self, trainer: pl.Trainer, module: pl.LightningModule, exception: BaseException) -> None:
        self.stopped = (type(exception).__name__, trainer.global_step if trainer.training else self.batch)


def train(name: str, checkpoint: DistributedCheckpoint = None, *, stop_after: int = MAX_STEPS, ckpt_path: str = None,
          kill: bool = False, callbacks: tuple[Callback, ...] = ()) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    world = int(os.environ["WORLD_SIZE"])
    dp = 2 if name == "3d" else world
    pl.seed_everything(0, verbose=False)
    losses, weights = Losses(kill), Weights(RESHARD_AT)
    trainer = ml.Trainer(strategy=STRATEGIES[name](), devices=world, accelerator="cpu", max_steps=MAX_STEPS,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         enable_checkpointing=checkpoint is not None,
                         callbacks=[losses, weights, StopAfter(stop_after), *callbacks]
                         + ([checkpoint] if checkpoint else []))
    data = ml.demos.AdditionDataModule(3, batch_size=GLOBAL_BATCH // dp, train_size=GLOBAL_BATCH * STEPS_PER_EPOCH)
    trainer.fit(model(0), data, ckpt_path=ckpt_path)
    return losses.losses, weights.weights


def main(mode: str, directory: Path, out: str = "", name: str = "3d") -> None:
    if mode == "kill":
        train("3d", DistributedCheckpoint(directory / "killed", every_n_train_steps=EVERY, keep_last_k=2), kill=True)
        return
    if mode == "term":
        term, validated = TermAt(), TermAt()
        try:
            train("3d", DistributedCheckpoint(directory / "term", every_n_train_steps=EVERY), callbacks=(term,))
        except SIGTERMException:
            pass
        trainer = ml.Trainer(strategy=STRATEGIES["3d"](), devices=8, accelerator="cpu", logger=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[validated])
        data = ml.demos.AdditionDataModule(3, batch_size=GLOBAL_BATCH // 2, val_size=GLOBAL_BATCH * 4 * TERM_AT)
        try:
            trainer.validate(model(0), data)
        except SIGTERMException:
            pass
        result = {"fit": [None] * dist.get_world_size(), "validate": [None] * dist.get_world_size()}
        dist.all_gather_object(result["fit"], term.stopped)
        dist.all_gather_object(result["validate"], validated.stopped)
    elif mode == "save":
        losses, weights = train("3d", DistributedCheckpoint(directory / "full", every_n_train_steps=EVERY,
                                                            save_top_k=-1, async_save=False))
        resumed, _ = train("3d", DistributedCheckpoint(directory / "killed", every_n_train_steps=EVERY, keep_last_k=2),
                           ckpt_path="last")
        after_term, _ = train("3d", DistributedCheckpoint(directory / "term", every_n_train_steps=EVERY),
                              ckpt_path="last")
        result = {"weights": weights, "losses": losses, "resumed": resumed, "resumed_after_term": after_term}
    else:
        saved = directory / "full" / f"step={RESHARD_AT:09d}"
        losses, weights = train(name, stop_after=RESHARD_TO, ckpt_path=str(saved))
        result = {"weights": weights, "losses": losses}
    if dist.get_rank() == 0:
        torch.save(result, out)


assert KILL_AFTER > RESHARD_AT  # the killed run has committed step 10 (or at least step 5) when it dies

if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
