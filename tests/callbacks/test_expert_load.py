"""ExpertLoadMonitor: MoE telemetry reaches Lightning's logging and TensorBoard (scalars and heatmaps), the
auxiliary-loss gradients follow gradient accumulation, meshlight.Trainer adds the monitor by default, and the
monitor attaches the MoE layers' post-step updates under Lightning's own Trainer and strategies."""

import warnings

import lightning.pytorch as pl
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import meshlight as ml
from meshlight.callbacks import ExpertLoadMonitor, load_heatmap
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig
from meshlight.nn import MoE, MoEConfig, attach_moe_updates


def moe_gpt() -> LitGPT:
    config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=32, n_layers=2,
                            moe=MoEConfig(num_experts=4, capacity_factor=1.0, min_capacity=1), moe_every=2)
    return LitGPT(config)


class LoadRecorder(ml.callbacks.ExpertLoadMonitor):
    """Also keeps what each layer reported after every step, to compare with what was logged."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.reported: dict[int, dict[str, float]] = {}
        self.scales: list[float] = []
        self.routed = torch.zeros(4)  # token assignments per expert since the last optimizer step, counted here
        self.routed_by_step: dict[int, list[float]] = {}
        self.tokens_by_step: dict[int, list[float]] = {}
        self.log_steps: list[int] = []  # the optimizer step after which the monitor called log_dict

    def on_fit_start(self, trainer, pl_module) -> None:
        super().on_fit_start(trainer, pl_module)

        def count(router, args, routing) -> None:
            self.routed += torch.bincount(routing.experts.flatten(), minlength=4)

        pl_module.model.blocks[1].mlp.router.register_forward_hook(count)

    def on_train_batch_start(self, trainer, pl_module, *args) -> None:
        super().on_train_batch_start(trainer, pl_module, *args)
        self.scales.append(pl_module.model.blocks[1].mlp.aux_gradient_scale)
        self.step_before = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        logged = pl_module.log_dict
        pl_module.log_dict = lambda *a, **k: (self.log_steps.append(trainer.global_step), logged(*a, **k))
        try:
            super().on_train_batch_end(trainer, pl_module, *args)
        finally:
            del pl_module.log_dict
        load = pl_module.model.blocks[1].mlp.last_step
        if trainer.global_step > self.step_before:  # an optimizer step was taken in this batch
            self.routed_by_step[trainer.global_step] = self.routed.tolist()
            self.tokens_by_step[trainer.global_step] = load.tokens.tolist()
            self.routed.zero_()
        if load is not None:
            self.reported[trainer.global_step] = {"imbalance": load.imbalance, "aux_loss": load.aux_loss,
                                                  "dropped": load.dropped_fraction,
                                                  "expert_2": load.fraction[2].item()}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("expert_load")
    monitor = LoadRecorder(heatmap_every_n_steps=4)
    trainer = ml.Trainer(max_steps=8, accelerator="cpu", default_root_dir=out, callbacks=[monitor], log_every_n_steps=2,
                         accumulate_grad_batches=2, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0)
    trainer.fit(moe_gpt(), AdditionDataModule(3, batch_size=8, train_size=256, val_size=16))
    events = EventAccumulator(str(out / "lightning_logs" / "version_0"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    return trainer, monitor, events


def test_only_the_moe_blocks_are_reported(run):
    _, _, events = run
    layers = {tag.split("/")[1] for tag in events.Tags()["scalars"] if tag.startswith("moe/")}
    assert layers == {"model.blocks.1.mlp"}  # moe_every=2: block 0 is dense


def test_scalars_are_the_layers_statistics_every_n_steps(run):
    _, monitor, events = run
    for key in ("imbalance", "aux_loss", "dropped", "expert_2"):
        # Lightning files the metrics of optimizer step s under s - 1 and writes every log_every_n_steps=2.
        logged = {e.step + 1: e.value for e in events.Scalars(f"moe/model.blocks.1.mlp/{key}")}
        assert sorted(logged) == [2, 4, 6, 8]
        for step, value in logged.items():
            assert value == pytest.approx(monitor.reported[step][key], rel=1e-6), (key, step)
    assert all(0 < r["dropped"] < 1 for r in monitor.reported.values())  # capacity factor 1.0 drops some
    z_losses = [e.value for e in events.Scalars("moe/model.blocks.1.mlp/z_loss")]
    assert all(z > 0 for z in z_losses)


def test_values_are_logged_only_on_the_steps_loggers_write(run):
    # self.log is slow (16 ms per step for a 4-layer, 4-expert GPT): values of other steps would reach no logger.
    _, monitor, _ = run
    assert monitor.log_steps == [2, 4, 6, 8]  # one MoE layer, log_every_n_steps=2


def test_a_heatmap_per_layer_every_n_steps(run):
    _, _, events = run
    images = events.Images("moe/model.blocks.1.mlp/load")
    assert [image.step + 1 for image in images] == [4, 8]  # filed like the scalars
    # the labelled figure (tests/callbacks/test_figures.py); its cells are the bare heatmap's
    assert images[-1].width == 768 and images[-1].height > 100


def test_statistics_are_those_of_the_step_just_taken(run):
    # Lightning runs each step's forwards inside optimizer.step(closure): the load reported after step s
    # must count exactly the two accumulated micro-batches of step s, not one shifted by a micro-batch.
    _, monitor, _ = run
    assert sorted(monitor.routed_by_step) == list(range(1, 9))
    assert monitor.tokens_by_step == monitor.routed_by_step


def test_auxiliary_gradients_are_scaled_like_the_loss_under_accumulation(run):
    _, monitor, _ = run
    assert monitor.scales and set(monitor.scales) == {0.5}


def test_heatmap_colours_load_relative_to_an_even_share():
    image = load_heatmap([torch.tensor([0.25, 0.5, 0.125, 0.125])], cell=1)  # 4 experts, one step
    assert image.shape == (3, 4, 1)
    assert image[:, 0, 0].tolist() == pytest.approx([1.0, 1.0, 1.0])  # even share: white
    assert image[:, 1, 0].tolist() == pytest.approx([0.8, 0.1, 0.1])  # 2×: red
    assert image[:, 2, 0].tolist() == pytest.approx([0.1, 0.3, 0.8])  # ½×: blue


def test_meshlight_trainer_adds_one_monitor_unless_given():
    default = ml.Trainer(logger=False, enable_progress_bar=False)
    assert sum(isinstance(c, ExpertLoadMonitor) for c in default.callbacks) == 1
    mine = ExpertLoadMonitor(heatmap_every_n_steps=7)
    given = ml.Trainer(logger=False, enable_progress_bar=False, callbacks=[mine])
    assert [c for c in given.callbacks if isinstance(c, ExpertLoadMonitor)] == [mine]


def test_models_without_moe_layers_log_nothing(tmp_path):
    trainer = ml.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
                         log_every_n_steps=1, default_root_dir=tmp_path)
    trainer.fit(LitGPT(GPTConfig.tiny(vocab_size=16, max_seq_len=12)), AdditionDataModule(3, batch_size=4))
    assert not any(key.startswith("moe/") for key in trainer.callback_metrics)
    assert not any(isinstance(m, MoE) for m in trainer.lightning_module.modules())


def biased_moe_gpt() -> LitGPT:
    config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=32, n_layers=2,
                            moe=MoEConfig(num_experts=4, score="sigmoid", aux_loss_coeff=0.0, expert_bias_rate=0.01,
                                          expert_bias_update="sign"),
                            moe_every=2)
    return LitGPT(config)


def lightning_trainer(tmp_path, callbacks: list) -> pl.Trainer:
    return pl.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      default_root_dir=tmp_path, callbacks=callbacks)


class StepLoads(ExpertLoadMonitor):
    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        super().on_train_batch_end(trainer, pl_module, *args)
        self.tokens.append(pl_module.model.blocks[1].mlp.last_step.tokens)


def test_under_lightnings_own_trainer_the_monitor_attaches_the_expert_bias_updates(tmp_path):
    module, monitor = biased_moe_gpt(), StepLoads()
    trainer = lightning_trainer(tmp_path, [monitor])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="This MoE layer")
        trainer.fit(module, AdditionDataModule(3, batch_size=8))
    layer = module.model.blocks[1].mlp
    (optimizer,) = trainer.optimizers
    assert attach_moe_updates(optimizer, module).layers == [layer]  # the monitor's hook, found again
    assert len(optimizer._optimizer_step_post_hooks) == 1
    # Each step moved each expert's bias by 0.01 against its load in that step (DeepSeek-V3's sign rule).
    assert len(monitor.tokens) == 3
    expected = sum(0.01 * (tokens.mean() - tokens).sign() for tokens in monitor.tokens)
    assert layer.router.expert_bias.tolist() == pytest.approx(expected.tolist())
    assert layer.router.expert_bias.abs().sum() > 0


def test_under_lightnings_own_trainer_without_the_monitor_a_biased_layer_warns(tmp_path):
    module = biased_moe_gpt()
    with pytest.warns(UserWarning, match=r"no optimizer moves its expert bias: call meshlight\.nn\.attach_moe_updates"):
        lightning_trainer(tmp_path, []).fit(module, AdditionDataModule(3, batch_size=8))
    assert module.model.blocks[1].mlp.router.expert_bias.abs().sum() == 0
