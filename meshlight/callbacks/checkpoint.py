"""DistributedCheckpoint: sharded, atomically committed, optionally asynchronous checkpoints that resume exactly.

Each save is a folder ``<dirpath>/step=<global step, 9 digits>`` of DCP shards (every rank writes its own part
of the model and optimizer states), ``meta.pt`` (loops, LR schedulers, callbacks, the data position) and one
``rng-<rank>.pt`` per rank. A folder becomes visible to resume only once complete (see
:func:`meshlight.parallel.save_checkpoint`): a crash mid-save leaves an ``.incomplete`` folder that
``ckpt_path="last"`` skips and the next cleanup deletes.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional

import fsspec
import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from meshlight.parallel.checkpoint import is_complete, is_interrupted, numbered_entries
from meshlight.strategies.lightning_internals import callback_state_key, checkpoint_state
from meshlight.strategies.mesh import MeshStrategy

__all__ = ["DistributedCheckpoint"]

FOLDER = re.compile(r"^step=(\d+)$")


class DistributedCheckpoint(Checkpoint):
    """Save sharded checkpoints of everything training needs to continue bit for bit, to any fsspec URL.

    The arguments mean what they mean in Lightning's ``ModelCheckpoint``, except that ``save_last`` defaults to
    True and that without ``monitor`` ``save_top_k`` keeps that many of the newest (Lightning allows only
    -1, 0 or 1 there); ``keep_last_k`` is meshlight's:

    Args:
        dirpath: folder or URL (``/ckpts``, ``memory://ckpts``, ``s3://bucket/run`` with s3fs installed).
        every_n_train_steps: save after every N optimizer steps (None: only on validation / at the end).
        monitor, mode: a logged metric ranking checkpoints, saved after each validation (None: no ranking).
        save_top_k: with ``monitor``, how many of the best to keep (-1: all); without, how many of the newest.
        save_last: also keep the newest checkpoint (and save one when training ends), whatever its rank.
        async_save: stage the state in memory and write in the background while training continues (one
            checkpoint in flight: the next save, or the end of training, waits for it).
        keep_last_k: with ``monitor``, keep this many of the newest besides the best ``save_top_k``; without,
            the newest ``max(save_top_k, keep_last_k)`` stay.
        save_on_sigterm: when SIGTERM (a preemption) stops training, save the step every rank stopped after
            (see :mod:`meshlight.strategies.preemption`), written before ``fit`` raises ``SIGTERMException``.

    Resume with ``trainer.fit(model, ckpt_path="last")`` (meshlight's Trainer resolves it to the newest
    complete checkpoint here, or to a newer one SLURM's requeue signal left) or with a folder's path. The data
    position is restored with plain ``DataLoader``s: the sampler skips, without loading them, the samples the
    interrupted epoch consumed.
    """

    def __init__(
        self,
        dirpath: str,
        every_n_train_steps: Optional[int] = None,
        monitor: Optional[str] = None,
        mode: Literal["min", "max"] = "min",
        save_top_k: int = 1,
        save_last: bool = True,
        async_save: bool = True,
        keep_last_k: Optional[int] = None,
        save_on_sigterm: bool = True,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r}: choose 'min' or 'max'.")
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps={every_n_train_steps} must be >= 1 (or None).")
        if save_top_k < -1:
            raise ValueError(f"save_top_k={save_top_k} must be >= -1 (-1 keeps every checkpoint).")
        if keep_last_k is not None and keep_last_k < 1:
            raise ValueError(f"keep_last_k={keep_last_k} must be >= 1 (or None).")
        self.dirpath = str(dirpath).rstrip("/")
        self.every_n_train_steps, self.monitor, self.mode = every_n_train_steps, monitor, mode
        self.save_top_k, self.save_last, self.keep_last_k = save_top_k, save_last, keep_last_k
        self.async_save, self.save_on_sigterm = async_save, save_on_sigterm
        self.scores: dict[int, float] = {}  # step -> monitored value, for the checkpoints that have one
        self.last_saved_step: Optional[int] = None
        self.global_batch: Optional[int] = None  # samples per optimizer step, as saved and as now
        self.max_steps: Optional[int] = None  # the Trainer's, as saved and as now

    # ---------------------------------------------------------------- what resume and the user see

    @property
    def state_key(self) -> str:
        return callback_state_key(self, dirpath=self.dirpath, monitor=self.monitor)

    def path_of(self, step: int) -> str:
        return f"{self.dirpath}/step={step:09d}"

    def complete_steps(self) -> list[int]:
        """Steps of the complete checkpoints in ``dirpath``, oldest first."""
        return sorted(step for step, path in self._folders().items() if is_complete(path))

    def last_checkpoint(self) -> Optional[str]:
        """The newest complete checkpoint, or None."""
        steps = self.complete_steps()
        return self.path_of(steps[-1]) if steps else None

    @property
    def best_model_path(self) -> Optional[str]:
        if not self.scores:
            return None
        pick = min if self.mode == "min" else max
        return self.path_of(pick(self.scores, key=self.scores.get))

    # ---------------------------------------------------------------- when to save

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, MeshStrategy):
            raise TypeError(
                f"DistributedCheckpoint writes through meshlight's strategies and {type(trainer.strategy).__name__}"
                " is not one: use ml.Trainer (on one device it runs meshlight's \"ddp\", a mesh of one process), pass a"
                " meshlight strategy (ml.DDPStrategy(), \"zero3\", \"3d\", …), or use Lightning's ModelCheckpoint."
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        saved_steps, self.max_steps = self.max_steps, trainer.max_steps
        if saved_steps is not None and saved_steps != self.max_steps:
            rank_zero_warn(
                f"Resuming with max_steps={self.max_steps}; the checkpoint was saved by a run with max_steps="
                f"{saved_steps}. A learning-rate schedule that configure_optimizers builds from max_steps (or"
                " trainer.estimated_stepping_batches) is not in the checkpoint: after one step at the saved rate"
                f" it follows the schedule of {self.max_steps} steps, not the interrupted run's. Keep max_steps to"
                " resume exactly; to train longer on purpose, make the schedule's length a hyper-parameter."
            )
        saved, self.global_batch = self.global_batch, _global_batch(trainer)
        if saved is not None and self.global_batch is not None and saved != self.global_batch:
            rank_zero_warn(
                f"Resuming with a global batch of {self.global_batch} samples per optimizer step; the checkpoint was"
                f" saved with {saved}. Training goes on from the saved step, but it is not a continuation of the"
                " interrupted run: the learning-rate schedule counts steps, and the data position is restored as"
                " the number of batches the epoch had consumed, now of the new size. Keep the global batch (per-"
                "replica batch × data-parallel size × accumulate_grad_batches) to resume exactly."
            )

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        n = self.every_n_train_steps
        if n and trainer.global_step % n == 0 and self._is_new_step(trainer):
            self._save(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor is None or trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            rank_zero_warn(f"DistributedCheckpoint(monitor={self.monitor!r}): no such metric was logged; known: "
                           f"{sorted(trainer.callback_metrics)}.")
            return
        self.scores[trainer.global_step] = float(value)
        if self._is_new_step(trainer):
            self._save(trainer)
        else:
            self._clean_up(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_last and self._is_new_step(trainer) and trainer.global_step > 0:
            self._save(trainer)
        self._wait(trainer)
        self._clean_up(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(trainer.strategy, MeshStrategy):
            return
        self._wait(trainer)  # finish a write in flight
        # Every rank raised SIGTERMException after the same optimizer step: a collective write is safe. (After any
        # other exception the ranks may be anywhere: nothing more.)
        preempted = isinstance(exception, SIGTERMException) and trainer.state.fn == TrainerFn.FITTING
        if preempted and self.save_on_sigterm and self._is_new_step(trainer) and trainer.global_step > 0:
            self._save(trainer, asynchronous=False)
            rank_zero_info(f"SIGTERM: saved {self.path_of(trainer.global_step)}")

    def state_dict(self) -> dict[str, Any]:
        return {"scores": dict(self.scores), "last_saved_step": self.last_saved_step, "dirpath": self.dirpath,
                "global_batch": self.global_batch, "max_steps": self.max_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("dirpath") == self.dirpath:
            self.scores = {int(k): v for k, v in state_dict.get("scores", {}).items()}
            self.last_saved_step = state_dict.get("last_saved_step")
        self.global_batch = state_dict.get("global_batch")
        self.max_steps = state_dict.get("max_steps")

    # ---------------------------------------------------------------- how

    def _is_new_step(self, trainer: pl.Trainer) -> bool:
        return trainer.global_step != self.last_saved_step

    def _save(self, trainer: pl.Trainer, asynchronous: Optional[bool] = None) -> None:
        self.last_saved_step = trainer.global_step
        path = self.path_of(trainer.global_step)
        checkpoint = checkpoint_state(trainer)
        asynchronous = self.async_save if asynchronous is None else asynchronous
        trainer.strategy.save_checkpoint(checkpoint, path, asynchronous=asynchronous)
        self._clean_up(trainer)

    def _wait(self, trainer: pl.Trainer) -> None:
        trainer.strategy.wait_for_checkpoint()

    def _keep(self, steps: list[int]) -> set[int]:
        """The steps whose checkpoints stay, given the complete ones (oldest first)."""
        newest = steps[::-1]
        if self.monitor is None:
            count = len(steps) if self.save_top_k == -1 else max(self.save_top_k, self.keep_last_k or 0, 1)
            return set(newest[:count])
        ranked = sorted((s for s in steps if s in self.scores), key=self.scores.get, reverse=self.mode == "max")
        keep = set(ranked if self.save_top_k == -1 else ranked[: self.save_top_k])
        if self.save_last and newest:
            keep.add(newest[0])
        if self.keep_last_k:
            keep.update(newest[: self.keep_last_k])
        return keep

    def _clean_up(self, trainer: pl.Trainer) -> None:
        """Delete (global rank 0) the complete checkpoints no longer kept and incomplete ones left by crashes,
        never the one being written."""
        if not trainer.is_global_zero:
            return
        folders = self._folders()
        complete = sorted(step for step, path in folders.items() if is_complete(path))
        keep = self._keep(complete)
        for step, path in folders.items():
            in_flight = step == self.last_saved_step
            if in_flight or step in keep or (step not in complete and not is_interrupted(path)):
                continue
            fs, root = fsspec.core.url_to_fs(path)
            fs.rm(root, recursive=True)
            self.scores.pop(step, None)

    def _folders(self) -> dict[int, str]:
        return numbered_entries(self.dirpath, FOLDER)


def _global_batch(trainer: pl.Trainer) -> Optional[int]:
    """Samples per optimizer step over all data-parallel ranks (None when the loader has no batch size)."""
    loaders = trainer.train_dataloader
    loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
    sizes = [getattr(loader, "batch_size", None) for loader in loaders]
    if not sizes or any(size is None for size in sizes):
        return None
    replicas = trainer.strategy.distributed_sampler_kwargs["num_replicas"]  # a meshlight strategy (see setup)
    return sum(sizes) * replicas * trainer.accumulate_grad_batches

