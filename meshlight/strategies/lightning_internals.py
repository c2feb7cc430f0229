"""The one door to Lightning's private names: every underscore import, ``trainer._…`` attribute, loop or connector
internal that meshlight needs is reached through this module, and nowhere else.

Each touch point is a small function or adapter with a test of its own
(``tests/strategies/test_lightning_internals.py``), so a Lightning release that renames or changes one breaks one
test loudly instead of a run silently. The installed Lightning is checked against the range these were tested with,
once, at import.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import lightning
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _set_num_threads_if_needed,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.connectors.signal_connector import log as signal_log
from lightning.pytorch.utilities.data import _update_dataloader
from torch.optim import Optimizer
from torch.utils.data import DataLoader, Sampler

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "TESTED_LIGHTNING",
    "ForwardRedirection",
    "LightningChanged",
    "PathLike",
    "ScriptLauncher",
    "SignalConnector",
    "StrategyInternals",
    "accumulating",
    "attached_trainer",
    "callback_state_key",
    "check_lightning_version",
    "checkpoint_state",
    "collect_rng_states",
    "default_backend",
    "distributed_is_initialized",
    "epoch_ends_with_this_batch",
    "fit_dataloader",
    "hpc_checkpoint_path",
    "init_process_group",
    "install_signal_connector",
    "optimizers_to_device",
    "processed_batches",
    "set_device_mesh",
    "set_num_threads_if_needed",
    "set_rng_states",
    "should_update_logs",
    "signal_connector",
    "signal_log",
    "skip_sigterm_broadcast",
    "tested_range",
    "uses_distributed_sampler",
    "with_sampler",
    "world_group",
]

#: Lightning versions every touch point here was tested with: ``[lower, upper)``, as ``pyproject.toml`` requires
TESTED_LIGHTNING = ((2, 6), (2, 7))

PathLike = _PATH
ForwardRedirection = _ForwardRedirection
distributed_is_initialized = _distributed_is_initialized
collect_rng_states = _collect_rng_states
set_rng_states = _set_rng_states


def tested_range() -> str:
    """:data:`TESTED_LIGHTNING` as a requirement: ``">=2.6,<2.7"``."""
    (low, high) = TESTED_LIGHTNING
    return f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"


def check_lightning_version(version: str = lightning.__version__) -> Optional[str]:
    """Warn when ``version`` lies outside :data:`TESTED_LIGHTNING`; returns the warning's text (None inside)."""
    numbers = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    (low, high) = TESTED_LIGHTNING
    if low <= numbers < high:
        return None
    message = (f"meshlight was tested with lightning {tested_range()}; lightning {version} is"
               " installed. If a strategy fails inside Lightning, install a tested version"
               f" (pip install 'lightning{tested_range()}').")
    warnings.warn(message, UserWarning, stacklevel=2)
    return message


class LightningChanged(RuntimeError):
    """A private name of Lightning's that meshlight relies on is gone: the installed Lightning is not one it was
    tested with."""


def _private(owner: Any, name: str) -> Any:
    """``owner.name``, or :class:`LightningChanged` naming it and the tested versions, where a silent fallback
    would change what a run does."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise LightningChanged(
            f"lightning {lightning.__version__} has no {type(owner).__name__}.{name}, which meshlight needs; it was"
            f" tested with lightning{tested_range()}: pip install 'lightning{tested_range()}'."
        ) from None


def world_group() -> Any:
    """Lightning's handle of the default (world) process group."""
    return _group.WORLD


def default_backend(device: torch.device) -> str:
    """The process-group backend Lightning chooses for ``device`` (``"nccl"`` on CUDA, ``"gloo"`` on CPU)."""
    return _get_default_process_group_backend_for_device(device)


def optimizers_to_device(optimizers: list[Optimizer], device: torch.device) -> None:
    """Move the optimizers' states to ``device``, as Lightning's strategies do after setup."""
    _optimizers_to_device(optimizers, device)


def attached_trainer(module: LightningModule) -> Optional[Trainer]:
    """The Trainer ``module`` is attached to, or None (``module.trainer`` raises when there is none)."""
    return getattr(module, "_trainer", None)


def fit_dataloader(trainer: Optional[Trainer]) -> Any:
    """What was passed to ``fit`` as its training data (a DataLoader, a DataModule, …), before Lightning made loaders
    from it; None when nothing was."""
    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    return getattr(source, "instance", None)


def processed_batches(trainer: Trainer) -> Callable[[], int]:
    """A function returning how many batches of the current epoch the fit loop has processed (restored on resume)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    return lambda: progress.processed


def with_sampler(dataloader: DataLoader, sampler: Sampler) -> DataLoader:
    """``dataloader`` re-created with ``sampler`` (Lightning's re-instantiation, which keeps the loader's class and
    arguments), declared resumable mid-epoch: ``sampler`` skips what the interrupted epoch consumed, so Lightning's
    warning that a plain loader cannot resume does not apply. Its state is the fit loop's batch counter, which
    Lightning restores itself, so the loader's own state is empty."""
    loader = _update_dataloader(dataloader, sampler)
    # Lightning tests resumability with its ``_Stateful`` protocol: a ``state_dict``/``load_state_dict`` pair.
    loader.state_dict = dict  # type: ignore[attr-defined]
    loader.load_state_dict = lambda state: None  # type: ignore[attr-defined]
    return loader


def set_device_mesh(module: LightningModule, mesh: DeviceMesh) -> None:
    """Make ``mesh`` what ``module.device_mesh`` returns (read-only in Lightning's API)."""
    module._device_mesh = mesh


class StrategyInternals:
    """The private members of Lightning's ``Strategy`` that a strategy must override or call, as public ones.

    Put it before Lightning's strategy class among the bases: ``class MeshStrategy(StrategyInternals,
    ParallelStrategy)``.
    """

    def _configure_launcher(self) -> None:
        # The strategy's ``make_launcher()``: the launcher that starts the other processes, None where they are
        # started outside (torchrun, SLURM).
        self._launcher = self.make_launcher()  # type: ignore[attr-defined]

    def reset_optimizers(self) -> None:
        """Forget the optimizers and schedulers of a previous setup (fit, then test)."""
        self._reset_optimizers_and_schedulers()  # type: ignore[attr-defined]

    def set_forward_redirection(self, redirection: ForwardRedirection) -> None:
        """Run the LightningModule's steps through the strategy's model with ``redirection``'s hooks around them."""
        self._forward_redirection = redirection

    # Lightning's ModelParallelStrategy has these as a strategy over a device mesh needs them: borrowed, not copied.
    root_device = ModelParallelStrategy.root_device
    num_processes = ModelParallelStrategy.num_processes
    barrier = ModelParallelStrategy.barrier
    broadcast = ModelParallelStrategy.broadcast
    _determine_device_ids = ModelParallelStrategy._determine_device_ids


# ---------------------------------------------------------------- process group and launcher


def init_process_group(environment: ClusterEnvironment, backend: str, timeout: Optional[timedelta],
                       device_id: Any) -> None:
    """Lightning's process-group initialization: rendezvous through ``environment`` (its address, port, ranks)."""
    _init_dist_connection(environment, backend, timeout=timeout, device_id=device_id)


def set_num_threads_if_needed(num_processes: int) -> None:
    """Lightning's share of the node's cores for each of its ``num_processes`` ranks (as ``OMP_NUM_THREADS``,
    unless that is set)."""
    _set_num_threads_if_needed(num_processes=num_processes)


class ScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher that starts a node's other ranks by re-running the script, with its private steps as
    public methods: override :meth:`start_children`."""

    def _call_children_scripts(self) -> None:
        self.start_children()

    def start_children(self) -> None:
        """Start the node's other ranks (``self.procs``, watched by Lightning); by default as Lightning does."""
        self.rerun_script_in_children()

    def rerun_script_in_children(self) -> None:
        """Lightning's way: one new interpreter per other rank, re-running the script."""
        super()._call_children_scripts()

    def check_can_start_children(self) -> None:
        """Raise, as Lightning's launcher does, when ranks were started already or this is not a node's rank 0."""
        self._check_can_spawn_children()


# ---------------------------------------------------------------- signals (see meshlight.strategies.preemption)


class SignalConnector(_SignalConnector):
    """Lightning's signal connector — it installs the trainer's SIGTERM and SLURM-requeue handlers around each
    ``fit``, ``validate``, … and holds ``received_sigterm`` — with its private handlers as public hooks."""

    def _sigterm_notifier_fn(self, signum: Any, _: Any) -> None:
        self.on_sigterm(signum)

    def _slurm_sigusr_handler_fn(self, signum: Any, _: Any) -> None:
        self.on_requeue_signal(signum)

    def on_sigterm(self, signum: Any) -> None:
        """SIGTERM arrived (inside a signal handler); by default Lightning's answer."""
        super()._sigterm_notifier_fn(signum, None)

    def on_requeue_signal(self, signum: Any) -> None:
        """SLURM's requeue signal arrived under auto-requeue (inside a signal handler); by default Lightning's
        answer."""
        super()._slurm_sigusr_handler_fn(signum, None)


def signal_connector(trainer: Trainer) -> _SignalConnector:
    """The trainer's signal connector (Lightning's, or the one :func:`install_signal_connector` put there)."""
    return trainer._signal_connector


def install_signal_connector(trainer: Trainer, kind: type[SignalConnector]) -> SignalConnector:
    """Make a ``kind(trainer)`` the trainer's signal connector (before ``fit`` registers its handlers), unless it
    has one of that kind already; returns it."""
    if not isinstance(trainer._signal_connector, kind):
        trainer._signal_connector = kind(trainer)
    return trainer._signal_connector


def skip_sigterm_broadcast(trainer: Trainer) -> None:
    """Turn off the broadcast of rank 0's SIGTERM flag that Lightning's training loop makes at the start of every
    batch (for a strategy that agrees on signals itself). Its absence raises :class:`LightningChanged`: a loop that
    broadcast elsewhere would bring back the hang this avoids."""
    epoch_loop = trainer.fit_loop.epoch_loop
    _private(epoch_loop, "_broadcast_sigterm_tensor")
    epoch_loop._broadcast_sigterm_tensor = lambda: None


# ---------------------------------------------------------------- the loop's and the connectors' state


def accumulating(trainer: Trainer) -> bool:
    """Whether the current training batch only accumulates gradients (no optimizer step at its end)."""
    return _private(trainer.fit_loop.epoch_loop, "_should_accumulate")()


def epoch_ends_with_this_batch(trainer: Trainer) -> bool:
    """Whether the current training batch is the epoch's last."""
    return _private(trainer.fit_loop.epoch_loop, "_num_ready_batches_reached")()


def uses_distributed_sampler(trainer: Trainer) -> bool:
    """``Trainer(use_distributed_sampler=...)``: whether Lightning gives every rank its share of the data."""
    return _private(trainer, "_accelerator_connector").use_distributed_sampler


def hpc_checkpoint_path(trainer: Trainer) -> str:
    """The next ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``: where Lightning saves on SLURM's requeue signal, and
    what the requeued job resumes from."""
    return _private(trainer, "_checkpoint_connector").hpc_save_path(trainer.default_root_dir)


def checkpoint_state(trainer: Trainer) -> dict[str, Any]:
    """Everything ``trainer.save_checkpoint`` would save (model, optimizers, loops, callbacks …), as a dict."""
    return _private(trainer, "_checkpoint_connector").dump_checkpoint(weights_only=False)


def should_update_logs(trainer: Trainer) -> bool:
    """Whether the loggers write at this step (``log_every_n_steps``)."""
    return _private(trainer, "_logger_connector").should_update_logs


def callback_state_key(callback: Callback, **values: Any) -> str:
    """Lightning's ``state_key`` for a callback told apart from others of its class by ``values``."""
    return callback._generate_state_key(**values)


check_lightning_version()
