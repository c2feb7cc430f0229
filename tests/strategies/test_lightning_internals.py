"""Every touch point of :mod:`meshlight.strategies.lightning_internals` against the installed Lightning: each test
fails when Lightning renames, removes or changes the private name behind one (one process, no launches)."""

from __future__ import annotations

import os
import re
import signal
import socket
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from packaging.requirements import Requirement
from torch import nn
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

from meshlight.strategies import lightning_internals as internals

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- the tested range


def test_the_installed_lightning_lies_in_the_tested_range():
    assert internals.check_lightning_version() is None
    assert internals.check_lightning_version("2.6.6") is None
    assert internals.tested_range() == ">=2.6,<2.7"


@pytest.mark.parametrize("version", ["2.5.1", "2.7.0", "3.0.0rc1"])
def test_a_lightning_outside_the_tested_range_is_warned_of_naming_the_range(version):
    with pytest.warns(UserWarning, match=re.escape(f"tested with lightning >=2.6,<2.7; lightning {version} is")):
        message = internals.check_lightning_version(version)
    assert "pip install 'lightning>=2.6,<2.7'" in message


def test_pyproject_requires_the_tested_range():
    text = (ROOT / "pyproject.toml").read_text()
    (requirement,) = [Requirement(r) for r in re.findall(r'"(lightning[<>=!~ ].*?)"', text)]
    low, high = internals.TESTED_LIGHTNING
    lower = {s.version for s in requirement.specifier if s.operator == ">="}
    upper = {s.version for s in requirement.specifier if s.operator == "<"}
    assert lower == {f"{low[0]}.{low[1]}"}
    assert upper <= {f"{high[0]}.{high[1]}"}  # no cap, or the tested one; above it check_lightning_version warns


def test_a_missing_private_name_is_a_loud_error_naming_the_tested_range():
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace()))
    with pytest.raises(internals.LightningChanged, match=r"_broadcast_sigterm_tensor.*lightning>=2\.6,<2\.7"):
        internals.skip_sigterm_broadcast(trainer)  # type: ignore[arg-type]
    with pytest.raises(internals.LightningChanged, match="_should_accumulate"):
        internals.accumulating(trainer)  # type: ignore[arg-type]


# ---------------------------------------------------------------- plain names


def test_path_like_is_lightnings_path_type():
    from lightning.fabric.utilities.types import _PATH

    assert internals.PathLike is _PATH
    assert str in _PATH.__args__ and Path in _PATH.__args__


def test_distributed_is_initialized_follows_torch(one_process_group):
    assert internals.distributed_is_initialized() is True
    assert internals.world_group() is dist.group.WORLD
    dist.destroy_process_group()
    assert internals.distributed_is_initialized() is False


def test_rng_states_round_trip():
    states = internals.collect_rng_states()
    assert {"torch", "numpy", "python"} <= set(states)
    first = torch.rand(3)
    internals.set_rng_states(states)
    assert torch.equal(torch.rand(3), first)


def test_default_backend_is_gloo_on_cpu_and_nccl_on_cuda():
    assert internals.default_backend(torch.device("cpu")) == "gloo"
    assert internals.default_backend(torch.device("cuda", 0)) == "nccl"


def test_optimizers_to_device_moves_their_state():
    weight = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([weight])
    weight.grad = torch.ones(2)
    optimizer.step()
    internals.optimizers_to_device([optimizer], torch.device("meta"))
    assert optimizer.state[weight]["exp_avg"].device.type == "meta"


def test_with_sampler_rebuilds_the_loader_around_the_sampler_with_an_empty_state():
    dataset = TensorDataset(torch.arange(6.0))
    sampler = SequentialSampler(dataset)
    loader = internals.with_sampler(DataLoader(dataset, batch_size=2, shuffle=True, drop_last=True), sampler)
    assert isinstance(loader, DataLoader) and loader.sampler is sampler
    assert (loader.batch_size, loader.drop_last) == (2, True)
    assert [batch[0].tolist() for batch in loader] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert loader.state_dict() == {}
    loader.load_state_dict({"anything": 1})


def test_attached_trainer_and_device_mesh_of_a_lightning_module():
    module = pl.LightningModule()
    assert internals.attached_trainer(module) is None
    trainer = _trainer()
    module.trainer = trainer
    assert internals.attached_trainer(module) is trainer
    mesh = object()
    internals.set_device_mesh(module, mesh)  # type: ignore[arg-type]
    assert module.device_mesh is mesh


# ---------------------------------------------------------------- the strategy


class _Launcher:
    is_interactive_compatible = True


class _Probe(internals.StrategyInternals, DDPStrategy):
    def make_launcher(self):
        return _Launcher()


def test_strategy_internals_give_lightning_the_launcher_and_reset_optimizers():
    trainer = pl.Trainer(strategy=_Probe(), accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False)
    strategy = trainer.strategy
    assert isinstance(strategy.launcher, _Launcher)  # Lightning called _configure_launcher
    assert strategy.root_device == torch.device("cpu") and strategy.num_processes == 1
    assert strategy.broadcast(7) == 7
    strategy.barrier()
    strategy.optimizers = [torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0)]
    strategy.reset_optimizers()
    assert strategy.optimizers == []


def test_set_forward_redirection_routes_the_steps_through_the_strategys_model():
    seen = []

    class Redirection(internals.ForwardRedirection):
        def on_after_inner_forward(self, wrapper_module, original_module):
            seen.append(("inner", type(wrapper_module).__name__))

        def on_after_outer_forward(self, wrapper_module, original_module):
            seen.append(("outer", type(wrapper_module).__name__))

    class Module(pl.LightningModule):
        def training_step(self, batch, batch_idx):
            return batch * 2

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            return self.inner(*args)

    strategy = _Probe()
    module = Module()
    strategy.connect(module)
    strategy.model = Wrapper(module)
    strategy.set_forward_redirection(Redirection())
    assert strategy.training_step(torch.tensor(3.0), 0) == 6.0
    assert seen == [("inner", "Wrapper"), ("outer", "Wrapper")]


# ---------------------------------------------------------------- process group and launcher


def test_init_process_group_rendezvous_through_the_environment(monkeypatch):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    internals.init_process_group(LightningEnvironment(), "gloo", None, None)
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"


def test_set_num_threads_if_needed_shares_the_cores_unless_told(monkeypatch):
    threads = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        internals.set_num_threads_if_needed(2)
        assert torch.get_num_threads() == threads  # told: left alone
        monkeypatch.delenv("OMP_NUM_THREADS")
        internals.set_num_threads_if_needed(2)
        assert os.environ["OMP_NUM_THREADS"] == str(torch.get_num_threads())
    finally:
        torch.set_num_threads(threads)


def _launcher(kind: type, processes: int = 2) -> internals.ScriptLauncher:
    return kind(LightningEnvironment(), num_processes=processes, num_nodes=1)


def test_lightnings_launch_starts_the_children_through_start_children(monkeypatch):
    from lightning.pytorch.strategies.launchers import subprocess_script

    monkeypatch.setattr(subprocess_script, "_launch_process_observer", lambda procs: None)  # no watching thread
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    calls = []

    class Recording(internals.ScriptLauncher):
        def start_children(self):
            calls.append("start_children")

    assert _launcher(Recording).launch(lambda: "ran") == "ran"
    assert calls == ["start_children"]


def test_rerun_script_in_children_starts_one_process_per_other_rank(monkeypatch):
    from lightning.pytorch.strategies.launchers import subprocess_script

    started = []

    class Process:
        def __init__(self, command, env, cwd):
            started.append((command, env["LOCAL_RANK"], env["WORLD_SIZE"]))

    monkeypatch.setattr(subprocess_script.subprocess, "Popen", Process)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    launcher = _launcher(internals.ScriptLauncher, processes=3)
    launcher.start_children()
    assert [(rank, world) for _, rank, world in started] == [("1", "3"), ("2", "3")]
    assert len(launcher.procs) == 2
    with pytest.raises(RuntimeError, match="only create subprocesses once"):
        launcher.check_can_start_children()


# ---------------------------------------------------------------- signals


class _RecordingSignals(internals.SignalConnector):
    def __init__(self, trainer):
        super().__init__(trainer)
        self.calls = []

    def on_sigterm(self, signum):
        self.calls.append(("sigterm", signum))

    def on_requeue_signal(self, signum):
        self.calls.append(("requeue", signum))


def _trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False, **kwargs)


def test_install_signal_connector_replaces_lightnings_once():
    trainer = _trainer()
    assert type(internals.signal_connector(trainer)).__name__ == "_SignalConnector"
    connector = internals.install_signal_connector(trainer, _RecordingSignals)
    assert internals.signal_connector(trainer) is connector
    assert internals.install_signal_connector(trainer, _RecordingSignals) is connector
    connector.received_sigterm = True
    assert trainer.received_sigterm  # Lightning's loops read the flag from this connector


def test_lightnings_sigterm_handler_calls_on_sigterm():
    assert _fire_through_lightnings_handler(signal.SIGTERM) == [("sigterm", signal.SIGTERM)]


def test_lightnings_slurm_requeue_handler_calls_on_requeue_signal(monkeypatch):
    job = {"SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": "1", "SLURM_PROCID": "0",
           "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "127.0.0.1", "SLURM_JOB_NAME": "train",
           "SLURM_JOB_ID": "4242"}  # a SLURM job: Lightning's SLURMEnvironment with auto-requeue
    for name, value in job.items():
        monkeypatch.setenv(name, value)
    for name in ("RANK", "LOCAL_RANK", "SLURM_ARRAY_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    assert _fire_through_lightnings_handler(signal.SIGUSR1) == [("requeue", signal.SIGUSR1)]


def _fire_through_lightnings_handler(signum: int) -> list:
    """Install the recording connector, call the handler Lightning registers for ``signum``, restore the old one;
    the public hooks that handler called."""
    trainer = _trainer()
    connector = internals.install_signal_connector(trainer, _RecordingSignals)
    before = signal.getsignal(signum)
    connector.register_signal_handlers()
    try:
        signal.getsignal(signum)(signum, None)
    finally:
        connector.teardown()
    assert signal.getsignal(signum) == before
    return connector.calls


def test_skip_sigterm_broadcast_replaces_the_broadcast_lightnings_loop_makes_each_batch():
    import inspect

    trainer = _trainer()
    epoch_loop = trainer.fit_loop.epoch_loop
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(type(epoch_loop).advance)
    internals.skip_sigterm_broadcast(trainer)
    assert epoch_loop._broadcast_sigterm_tensor() is None


# ---------------------------------------------------------------- the loop's and the connectors' state, in a fit


class _Linear(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Observer(Callback):
    """What the door says at each training batch."""

    def __init__(self):
        self.seen: dict[str, list] = {"accumulating": [], "last": [], "processed": [], "logs": [], "sampler": []}
        self.state = None

    def on_train_start(self, trainer, pl_module):
        self.processed = internals.processed_batches(trainer)
        self.loader = internals.fit_dataloader(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen["accumulating"].append(internals.accumulating(trainer))
        self.seen["logs"].append(internals.should_update_logs(trainer))
        self.seen["sampler"].append(internals.uses_distributed_sampler(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen["last"].append(internals.epoch_ends_with_this_batch(trainer))
        self.seen["processed"].append(self.processed())
        if batch_idx == 1:
            self.state = internals.checkpoint_state(trainer)

    def state_dict(self):
        return {"seen": True}

    @property
    def state_key(self):
        return internals.callback_state_key(self, name="observer")


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)
    observer = _Observer()
    trainer = _trainer(max_epochs=1, accumulate_grad_batches=2, log_every_n_steps=2, callbacks=[observer],
                       use_distributed_sampler=False, default_root_dir=tmp_path_factory.mktemp("fit"))
    trainer.fit(_Linear(), loader)
    return trainer, observer, loader


def test_accumulating_is_true_inside_an_accumulation_window(fitted):
    _, observer, _ = fitted
    assert observer.seen["accumulating"] == [True, False, True, False]


def test_epoch_ends_with_this_batch_only_at_the_last(fitted):
    _, observer, _ = fitted
    assert observer.seen["last"] == [False, False, False, True]


def test_processed_batches_counts_the_epochs_batches(fitted):
    _, observer, _ = fitted
    assert observer.seen["processed"] == [1, 2, 3, 4]  # at a batch's end, that batch included


def test_should_update_logs_follows_log_every_n_steps(fitted):
    _, observer, _ = fitted
    assert observer.seen["logs"] == [False, False, True, True]  # the second optimizer step's batches


def test_uses_distributed_sampler_is_the_trainers_flag(fitted):
    _, observer, _ = fitted
    assert observer.seen["sampler"] == [False] * 4
    assert internals.uses_distributed_sampler(_trainer()) is True


def test_fit_dataloader_is_what_fit_was_given(fitted):
    _, observer, loader = fitted
    assert observer.loader is loader
    assert internals.fit_dataloader(None) is None


def test_checkpoint_state_is_what_save_checkpoint_writes_keyed_by_the_callbacks_state_key(fitted):
    trainer, observer, _ = fitted
    state = observer.state
    assert set(state["state_dict"]) == {"layer.weight", "layer.bias"}
    assert state["global_step"] == 1 and len(state["optimizer_states"]) == 1 and "loops" in state
    assert observer.state_key == "_Observer{'name': 'observer'}"
    assert state["callbacks"][observer.state_key] == {"seen": True}


def test_hpc_checkpoint_path_is_the_next_number_in_default_root_dir(fitted):
    trainer, _, _ = fitted
    root = Path(trainer.default_root_dir)
    assert internals.hpc_checkpoint_path(trainer) == str(root / "hpc_ckpt_1.ckpt")
    (root / "hpc_ckpt_3.ckpt").write_bytes(b"")
    assert internals.hpc_checkpoint_path(trainer) == str(root / "hpc_ckpt_4.ckpt")


def test_signal_log_is_lightnings_signal_connector_logger():
    assert internals.signal_log.name == "lightning.pytorch.trainer.connectors.signal_connector"
