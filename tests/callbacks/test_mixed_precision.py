"""MixedPrecision under every kind of layout (2 processes, and pp=2 × tp=2 on 4): low-precision Linears, fp32
norms and routers, fp32 master weights and gradients, losses within 2% of fp32; Lightning's "bf16-mixed" under
tensor, pipeline, expert and 3-D parallelism and "bf16-true" under ZeRO-3; fp16 loss scaling skips overflowing
steps on every rank and never leaves inf/NaN in any rank's weights after any step; misuse fails with a message
that says what to change."""


import pytest
import torch
from lightning.pytorch.callbacks import Callback

import meshlight as ml
from meshlight.callbacks import MixedPrecision, MixedPrecisionError
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig
from meshlight.parallel.precision import keep_fp32

LOW_PRECISION_RUNS = {  # run -> (reference run, compute dtype)
    "bf16 zero2": ("fp32", "torch.bfloat16"),
    "bf16 ddp": ("fp32", "torch.bfloat16"),
    "bf16 tp": ("fp32", "torch.bfloat16"),
    "fp16 pipeline": ("fp32", "torch.float16"),
    "moe bf16": ("moe fp32", "torch.bfloat16"),
    "bf16 3d": ("fp32 3d", "torch.bfloat16"),  # pp=2 × tp=2 on 4 processes
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from tests.callbacks.workers import precision_worker
    from tests.launch import results_of

    return {**results_of(precision_worker, 2, tmp_path_factory.mktemp("precision")),
            **results_of(precision_worker, 4, tmp_path_factory.mktemp("precision"))}


@pytest.mark.parametrize("run", list(LOW_PRECISION_RUNS))
def test_low_precision_compute_over_fp32_master_weights(runs, run):
    reference, dtype = LOW_PRECISION_RUNS[run]
    result, expected = runs[run], runs[reference]
    assert result["seen"]["linear"] == {(dtype, dtype)}
    assert result["seen"]["norm"] == {("torch.float32", "torch.float32")}
    if "moe" in run:
        assert result["seen"]["router"] == {("torch.float32", "torch.float32")}
    assert result["stored"] == {"torch.float32/torch.float32"}  # weights and gradients as the optimizer sees them
    assert result["finite"] and all(result["changed"])
    worst = max(abs(a - b) / b for a, b in zip(result["losses"], expected["losses"]))
    assert len(result["losses"]) == 20 and 0 < worst <= 0.02, worst


LIGHTNING_FLAG_RUNS = {"bf16-mixed tp": "fp32", "bf16-mixed pipeline": "fp32", "bf16-mixed moe": "moe fp32",
                      "bf16-mixed 3d": "fp32 3d"}  # run -> reference


@pytest.mark.parametrize("run", list(LIGHTNING_FLAG_RUNS))
def test_lightnings_bf16_mixed_flag_autocasts_over_fp32_weights_under_every_layout(runs, run):
    result, expected = runs[run], runs[LIGHTNING_FLAG_RUNS[run]]
    assert result["stored"] == {"torch.float32/torch.float32"} and result["finite"] and all(result["changed"])
    worst = max(abs(a - b) / b for a, b in zip(result["losses"], expected["losses"]))
    assert len(result["losses"]) == 20 and 0 < worst <= 0.02, worst  # bf16 compute, tracking fp32


def test_lightnings_bf16_true_flag_trains_bf16_weights_under_zero3(runs):
    result = runs["bf16-true zero3"]
    assert result["stored"] == {"torch.bfloat16/torch.bfloat16"} and result["finite"] and all(result["changed"])
    worst = max(abs(a - b) / b for a, b in zip(result["losses"], runs["fp32"]["losses"]))
    assert len(result["losses"]) == 20 and 0 < worst <= 0.02, worst  # measured: 0.004


def test_fp16_overflow_skips_steps_until_the_scale_fits(runs):
    result = runs["fp16 zero3 overflow"]  # initial scale 2^24
    first = result["changed"].index(True)
    assert first >= 3 and result["scales"][:first] == [2.0 ** (23 - i) for i in range(first)]
    # every skipped step (the weights unchanged) halved the scale; every taken step kept it
    previous = [2.0**24, *result["scales"][:-1]]
    for changed, scale, before in zip(result["changed"], result["scales"], previous):
        assert scale == (before if changed else before / 2)
    assert sum(result["changed"]) >= 10 and result["finite"]


@pytest.mark.parametrize("run", ["fp16 pipeline", "16-mixed zero2 inf"])
def test_fp16_gradients_once_unscaled_are_the_fp32_gradients_to_fp16s_rounding(runs, run):
    # A wrong loss scale hides from the losses (AdamW divides it out: doubled gradients move 20 steps' losses by
    # 3e-5), not from the gradients themselves: at the first step, from the same weights and batch, every tensor is
    # the fp32 run's within 1e-2 of its norm.
    fp32, fp16 = runs["fp32"]["gradients"], runs[run]["gradients"]
    assert fp16.keys() == fp32.keys() and len(fp32) > 10
    errors = {name: float((fp16[name] - grad).norm() / grad.norm()) for name, grad in fp32.items()}
    assert max(errors.values()) <= 1e-2, errors
    assert max(errors.values()) > 1e-5  # computed in fp16, not fp32


def test_one_rank_overflowing_skips_the_step_on_every_rank(runs):
    result = runs["16-mixed zero2 inf"]  # Lightning's fp16 plugin; rank 1 alone sees inf at step 3
    assert result["changed"] == [i != 3 for i in range(20)]  # recorded on rank 0
    assert result["scales"][2:4] == [2.0**16, 2.0**15]
    assert result["finite"]
    assert result["seen"]["linear"] >= {("torch.float16", "torch.float32")}  # autocast over fp32 weights


def _trainer(**options) -> ml.Trainer:
    return ml.Trainer(devices=1, accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, **options)


def _fit(trainer) -> None:
    config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=32, n_layers=2)
    trainer.fit(LitGPT(config), AdditionDataModule(3, batch_size=4, train_size=8))


def test_an_unknown_dtype_names_the_choices():
    with pytest.raises(MixedPrecisionError, match="choose 'bf16' or 'fp16'"):
        MixedPrecision("fp8")


def test_a_precision_flag_and_the_callback_together_are_refused():
    trainer = _trainer(strategy="zero1", precision="bf16-mixed", callbacks=[MixedPrecision()])
    with pytest.raises(MixedPrecisionError, match="remove one"):
        _fit(trainer)


def test_a_lightning_strategy_is_refused_with_the_alternative():
    import lightning.pytorch as pl

    trainer = pl.Trainer(strategy="auto", devices=1, accelerator="cpu", max_steps=1, logger=False,
                         callbacks=[MixedPrecision()], enable_progress_bar=False)
    with pytest.raises(MixedPrecisionError, match="precision='bf16-mixed'"):
        _fit(trainer)


@pytest.mark.parametrize("fp32_norms", [True, False])
def test_norms_compute_in_fp32_unless_asked_to_follow_their_block(fp32_norms):
    seen = {}

    class NormDtypes(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            norms = [m for m in module.modules() if isinstance(m, torch.nn.LayerNorm)]
            for norm in norms:
                norm.register_forward_hook(lambda norm, args, output: seen.setdefault(
                    "norm", set()).add((str(norm.weight.dtype), str(output.dtype))))

    _fit(_trainer(strategy="zero2", callbacks=[MixedPrecision("bf16", fp32_norms=fp32_norms), NormDtypes()]))
    # fp32 norms gather fp32 weights and hand their block a bf16 output; otherwise the weights are gathered in bf16
    weight = "torch.float32" if fp32_norms else "torch.bfloat16"
    assert seen["norm"] == {(weight, "torch.bfloat16")}


def test_a_forward_set_on_a_kept_fp32_module_is_kept_with_the_casts_around_it():
    # e.g. ActivationCheckpointing(module_types=[nn.LayerNorm]) patches the norm's forward before mixed precision
    norm, seen = torch.nn.LayerNorm(4), []
    inner = norm.forward
    norm.forward = lambda x: seen.append(x.dtype) or inner(x)
    keep_fp32(norm, torch.bfloat16)
    assert norm(torch.ones(2, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert seen == [torch.float32]


def test_the_callback_asks_meshlights_strategies_for_mixed_precision_by_a_policy_value():
    from meshlight.parallel.precision import PrecisionPolicy
    from meshlight.parallel.transforms import Transforms

    callback = MixedPrecision("fp16", fp32_norms=False)
    expected = PrecisionPolicy(torch.float16, torch.float32, (), fp32_norms=False)
    assert Transforms.collect([callback]) == Transforms(precision=expected)
