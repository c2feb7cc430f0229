"""The checkpoint hooks of :class:`~meshlight.strategies.MeshStrategy`: sharded model and optimizer states written
as DCP folders (reshardable to any layout), committed atomically, optionally in the background, with each rank's
random state; resumed into the parallelized model (see :mod:`meshlight.parallel.checkpoint`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.optim import Optimizer
from typing_extensions import override

from meshlight.parallel.checkpoint import (
    OPTIMIZER_STATE,
    AsyncCheckpointWriter,
    CheckpointDamagedError,
    CheckpointError,
    check_intact,
    load_checkpoint,
    load_rng_state,
    save_checkpoint,
)
from meshlight.parallel.compression import powersgd_of
from meshlight.parallel.pretrained import model_configs
from meshlight.strategies.lightning_internals import PathLike, collect_rng_states, set_rng_states
from meshlight.strategies.preemption import newest_whole_hpc_checkpoint

__all__ = ["POWERSGD_KEY", "ShardedCheckpointing"]

#: where a rank's PowerSGD state is kept among its random states (``rng-<rank>.pt``)
POWERSGD_KEY = "powersgd"


class ShardedCheckpointing(ParallelStrategy):
    """Lightning's checkpoint hooks for a strategy whose model and optimizer states are sharded."""

    _checkpoint_writer: Optional[AsyncCheckpointWriter] = None
    #: the whole model's state names where this rank holds only some (pipeline stages)
    _state_names: Optional[set[str]] = None
    #: the random state a resumed run's first training batch starts from (see :meth:`on_train_batch_start`)
    _resumed_rng: Optional[dict[str, Any]] = None
    #: older checkpoints to resume from, newest first, when the one asked for is damaged (``ckpt_path="last"``)
    fallback_checkpoints: Sequence[str] = ()
    #: ``fit(weights_only=...)``: Lightning 2.6 does not hand it to a strategy that restores after setup
    resume_weights_only: Optional[bool] = None

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # sharded states load into the parallelized model

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # optimizer states are restored with the model, resharded, in `load_checkpoint`

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The sharded model state (DTensors stay sharded; nothing is gathered)."""
        assert self.lightning_module is not None
        return get_model_state_dict(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The sharded optimizer state, keyed by parameter name so it reshards on load."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        assert self.lightning_module is not None
        return get_optimizer_state_dict(self.lightning_module, optimizer, options=OPTIMIZER_STATE)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Optional[Any] = None, *,
        asynchronous: bool = False,
    ) -> None:
        """Write a sharded checkpoint folder, committed atomically (see :func:`meshlight.parallel.save_checkpoint`);
        ``asynchronous``: stage it in memory and write it in the background (:meth:`wait_for_checkpoint`)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} writes sharded checkpoints itself: drop `storage_options`.")
        path = self.broadcast(filepath)
        if asynchronous and self._checkpoint_writer is None:
            self._checkpoint_writer = AsyncCheckpointWriter()
        rng = {"world_size": self.world_size, **collect_rng_states(include_cuda=self.root_device.type == "cuda")}
        powersgd = powersgd_of(self.model) if self.model is not None else None
        if powersgd is not None:  # per rank, like the random state: its error feedback differs between ranks
            rng[POWERSGD_KEY] = {"layout": self.layout.describe(), **powersgd.state_dict()}
        # the models' configs, for `meshlight export --to hf`
        checkpoint = {**checkpoint, **model_configs(self.lightning_module)}
        save_checkpoint(path, checkpoint, write_metadata=self.is_global_zero, rng_state=rng,
                        writer=self._checkpoint_writer if asynchronous else None)

    def wait_for_checkpoint(self) -> None:
        """Block until a checkpoint being written in the background is written and committed."""
        if self._checkpoint_writer is not None:
            self._checkpoint_writer.wait()

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
        weights_only = self.resume_weights_only if weights_only is None else weights_only
        path = self.broadcast(newest_whole_hpc_checkpoint(str(checkpoint_path)) if self.is_global_zero
                              else checkpoint_path)
        path = self._intact(path)
        module = self.lightning_module
        assert module is not None
        checkpoint = load_checkpoint(path, module, self.optimizers, strict=module.strict_loading,
                                     weights_only=weights_only, expected_names=self._state_names)
        try:
            rng, refused = load_rng_state(path, weights_only=weights_only), None
        except CheckpointError as error:  # a file of this rank's: every rank stops, none waits in a collective
            rng, refused = None, error
        if self.reduce_boolean_decision(refused is not None, all=False):
            raise refused or CheckpointError(f"Another rank refused its random state in {str(path)!r}: see its error.")
        self._resume_powersgd(rng.pop(POWERSGD_KEY, None) if rng is not None else None, path)
        if rng is not None and rng.pop("world_size", None) == self.world_size:
            set_rng_states(rng)  # same ranks, same streams: dropout continues as if never interrupted
            self._resumed_rng = rng
        return checkpoint

    def _intact(self, path: str) -> str:
        """``path``, or — when it is damaged and the Trainer gave older checkpoints to fall back to — the newest
        intact of those, with a warning naming what was damaged."""
        candidates, self.fallback_checkpoints = [path, *self.fallback_checkpoints], ()
        for candidate, older in zip(candidates, [*candidates[1:], None]):
            try:
                check_intact(candidate)
                return candidate
            except CheckpointDamagedError as error:
                if older is None:
                    raise
                rank_zero_warn(f"{error} Resuming from {older} instead.")
        return path

    def _resume_powersgd(self, state: Optional[dict[str, Any]], path: str) -> None:
        """Continue PowerSGD's error feedback and factors where the checkpoint left them, if it was saved on this
        layout; otherwise they start afresh, with a warning (their buckets and ranks were another layout's)."""
        powersgd = powersgd_of(self.model) if self.model is not None else None
        if powersgd is None:
            return
        layout = self.layout.describe()
        if state is not None and state.pop("layout") == layout:
            powersgd.load_state_dict(state)
            return
        rank_zero_warn(f"{path} holds no PowerSGD state saved on {layout}: PowerSGD's error feedback and factors"
                       " start afresh (after its warm-up of plain all-reduces), so training does not continue"
                       " exactly as an uninterrupted run would.")

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The saved random state was the one after the checkpointed step. Resumed mid-epoch, the training
        loader's iterator is made anew after the state was restored, and drawing its seed moved the stream, where
        the uninterrupted run had made it at the epoch's start: the state is set again before the first batch.
        Resumed at an epoch's end, the uninterrupted run drew that seed after the step too, as the resumed one does."""
        super().on_train_batch_start(batch, batch_idx)
        if self._resumed_rng is not None:
            if batch_idx > 0:
                set_rng_states(self._resumed_rng)
            self._resumed_rng = None

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded, resharded, in `load_checkpoint`

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded, resharded, in `load_checkpoint`
