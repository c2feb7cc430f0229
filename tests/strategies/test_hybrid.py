"""Hybrid 3-D parallelism reproduces single-process training: (dp, pp, tp) = (1, 2, 2) and (2, 2, 1) on 4
processes and (2, 2, 2) on 8, each with ZeRO-1 and ZeRO-3 and under 1F1B and Interleaved1F1B (4-block GPT; two
runs per layout, on 8 the ZeRO-1 one with biases and the ZeRO-3 one the MoE GPT's below), and an MoE GPT under
dp=2 × pp=2 × ep=2, and strategy="3d" with no sizes on 4 processes — logged losses and final weights within 1e-4
over 20 steps; models that read the sequence length on every pipeline stage (rotary GPT, a user-written Llama)
under pp=2 × tp=2 with sequence parallelism, and a Llama with modules outside its blocks that no tensor-parallel role
describes (sequence parallelism then covers the blocks only) under pp=2 × tp=2 ZeRO-3; a grouped-query Llama whose
attention keeps only head_dim (the planner reads its heads as tensor parallelism does) under pp=2 × tp=2 ZeRO-3; a
GPT with a vocabulary tp does not divide (61) and its embedding tied to the head across the first and last stage
under pp=2 × tp=2; an 8-expert MoE GPT under dp=2 × pp=2 × tp=2 × ep=2 (top-1 and top-2, dropless and with a
capacity factor; experts split over tp, and folded); and torchmetrics and a loss left a DTensor under pp=2 × tp=2."""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import meshlight as ml
from tests.launch import torchrun
from tests.strategies.parity import assert_parity, train
from tests.strategies.workers import hybrid_worker

WORKER = Path(hybrid_worker.__file__)
RUNS = [(world, run) for world in (4, 8) for run in hybrid_worker.runs(world)]


@pytest.fixture(scope="module")
def controls() -> dict:
    return {name: train("adamw", model=factory) for name, factory in hybrid_worker.MODELS.items()}


@pytest.fixture(scope="module")
def distributed(tmp_path_factory) -> dict:
    results = {}
    for world in (4, 8):
        out = tmp_path_factory.mktemp("hybrid") / f"{world}.pt"
        torchrun(WORKER, world, str(out), str(world), timeout=900)
        results.update(torch.load(out, weights_only=False))
    return results


IDS = [f"dp{r[0]}-pp{r[1]}-tp{r[2]}-ep{r[3]}-zero{r[4]}-{r[5]}-{r[6]}" + "".join(f"-{e}" for e in r[7:])
       for _, r in RUNS]


@pytest.mark.parametrize(("world", "run"), RUNS, ids=IDS)
def test_3d_matches_single_process_training(distributed, controls, world, run):
    assert_parity(distributed[run], controls[run[6]])


def test_3d_keeps_the_gathered_inputs_where_the_layout_fits_with_them_unless_told_not_to(distributed):
    # tiny models on CPU fit either way: "auto" (ZeRO-1 runs) keeps them; the ZeRO-3 runs asked to gather again
    runs = [(run, result) for run, result in distributed.items() if isinstance(run, tuple) and run[2] > 1]
    assert runs
    for run, result in runs:
        assert result["keep_gathered_inputs"] is (run[4] == 1), run  # run[4]: the ZeRO stage


def test_auto_gathers_again_where_keeping_the_gathered_inputs_would_not_fit():
    from types import SimpleNamespace

    from meshlight.parallel.planner import HARDWARE, MODELS, plan
    from meshlight.parallel.transforms import TensorParallelOptions

    h100 = HARDWARE["h100"]
    # Megatron 462B's published layout fits only gathered again (tests/parallel/test_planner.py); 32B's either way
    for name, world, batch, (dp, pp, tp), kept in (("megatron-462b", 6144, 3072, (48, 16, 8), False),
                                                   ("megatron-32b", 384, 192, (48, 1, 8), True)):
        model = MODELS[name]
        best = plan(model, h100, world, batch, dp=dp, pp=pp, tp=tp, recompute=False)[0]
        strategy = SimpleNamespace(_keep_gathered="auto", world_size=world, tensor_parallel=TensorParallelOptions())
        ml.Hybrid3DStrategy._settle_gathered_inputs(strategy, model, h100, best, best.recompute)
        assert strategy.tensor_parallel.keep_gathered_inputs is kept, name


def test_3d_without_sizes_trains_the_planners_layout(distributed, controls):
    planned = distributed["planned"]
    # A tiny model on CPU processes: the planner finds nothing worth splitting and replicates it.
    assert planned["plan"].startswith("dp=4 pp=1 tp=1"), planned["plan"]
    assert planned["layout"].startswith("dp=4 "), planned["layout"]  # the strategy trained what it printed
    assert_parity(planned, controls["gpt4"])


def test_torchmetrics_count_each_validation_sequence_once_and_stages_without_updates_stay_quiet(distributed):
    # tensor-parallel ranks see the same batch; pipeline stages before the last never update the metrics
    ranks = distributed["metrics"]
    assert [rank["val/sequences"] for rank in ranks] == [32.0] * 4
    assert len({rank["val/answer_accuracy"] for rank in ranks}) == 1
    assert [rank["warnings"] for rank in ranks] == [[]] * 4


def test_a_loss_left_a_dtensor_by_loss_parallelism_is_logged_and_returned_under_pipelining(distributed):
    # plain F.cross_entropy on vocabulary-sharded logits (dp=1 × pp=2 × tp=2): the second step, which broadcasts
    # the last stage's values as one tensor, failed with "aten.copy_.default got mixed torch.Tensor and DTensor"
    losses = [rank["train_losses"] for rank in distributed["metrics"]]
    assert len(losses[0]) == 2 and all(0 < loss < 10 for loss in losses[0]), losses
    assert losses == [losses[0]] * 4


def test_a_given_layout_that_cannot_fit_in_memory_is_refused_before_training():
    import meshlight as ml
    from meshlight.demos import AdditionDataModule, LitGPT
    from meshlight.parallel.planner import HARDWARE, PlanError

    small = HARDWARE["cpu"].replace(memory=2e6)  # bytes: below the tiny GPT's AdamW state; 4 devices fit
    strategy = ml.Hybrid3DStrategy(dp=1, pp=1, tp=1, ep=1, zero=1, hardware=small)
    trainer = ml.Trainer(strategy=strategy, devices=1, accelerator="cpu", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    module = LitGPT()
    with pytest.raises(PlanError, match=r"dp=1 \(.*\) · pp=1 · tp=1 · ep=1 is not expected to fit GPT.* needs .* No"
                                        r" layout of this world fits\. GPT fits from 4 devices: dp=\d pp=\d tp=\d"):
        trainer.fit(module, AdditionDataModule(batch_size=4, train_size=16))
    assert trainer.global_step == 0


def test_sizes_that_cannot_fill_the_world_fail_when_the_trainer_is_built():
    # the planner waits for the model (fit), but sizes given are checked at once: no process has started yet
    for sizes, devices, message in (
            ({"dp": 2, "pp": 2, "tp": 2}, 4, r"dp=2 × pp=2 × tp=2 uses 8 processes but the world has 4\. For example"
                                             r" keep pp=2, tp=2 and use data-parallel size 1"),
            ({"pp": 3}, 4, r"pp=3 does not divide the 4 processes of the world"),
            ({"dp": 3, "tp": 2}, 8, r"dp=3 × tp=2 does not divide the 8 processes of the world: .* a multiple of 6")):
        with pytest.raises(ValueError, match=message):
            ml.Trainer(strategy=ml.Hybrid3DStrategy(**sizes), devices=devices, accelerator="cpu", logger=False)
    with pytest.raises(ValueError, match=r"pp=0 is not a valid size"):
        ml.Hybrid3DStrategy(pp=0)
    with pytest.raises(ValueError, match=r"zero=4 is not a ZeRO stage"):
        ml.Hybrid3DStrategy(zero=4)


def test_the_planner_takes_the_batch_of_a_dataloader_given_to_fit_and_plans_an_unknown_one_with_the_least(caplog):
    from torch.utils.data import DataLoader

    from meshlight.demos import LitGPT

    def planned_batch(strategy):
        return strategy.plan[0].tokens_per_step // strategy.plan[0].dp // 128  # GPT's max_seq_len: 128

    # Planned at fit start, before the DataModule's setup or any loader: here on a Trainer of 4 processes, none
    # started. LitGPT has no batch_size anywhere: dp=2 × pp=2 is planned with the least batch 1F1B runs, 2 —
    # with a batch of 1 no layout had pp=2, and the given sizes were refused.
    strategy = ml.Hybrid3DStrategy(dp=2, pp=2, tp=1)
    trainer = ml.Trainer(strategy=strategy, devices=4, accelerator="cpu", logger=False)
    module = LitGPT()
    strategy.connect(module)
    module.trainer = trainer
    with caplog.at_level("INFO"):
        assert strategy._resolve_layout().pp == 2
    assert planned_batch(strategy) == 2
    assert "The batch per data replica is not known before the data is set up: planned with 2" in caplog.text
    # a DataLoader given to fit says its batch
    trainer._data_connector.attach_data(module, train_dataloaders=DataLoader(range(64), batch_size=8))
    strategy.plan = None
    strategy._resolve_layout()
    assert planned_batch(strategy) == 8


def test_a_model_the_planner_cannot_read_is_told_to_give_every_size():
    from meshlight.parallel.planner import PlanError

    class Regression(pl.LightningModule):  # no repeated blocks
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    strategy = ml.Hybrid3DStrategy(dp=1, pp=1, tp=1)
    ml.Trainer(strategy=strategy, devices=1, accelerator="cpu", logger=False)
    strategy.connect(Regression())
    with pytest.raises(PlanError, match=r"Regression has no repeated blocks .* give every size \(dp, pp, tp, ep and"
                                        r" zero\)\. For example: Hybrid3DStrategy\(dp=1, pp=1, tp=1, ep=1, zero=1\)"):
        strategy._resolve_layout()


def test_the_planner_leaves_out_tensor_parallelism_for_a_model_no_plan_splits(caplog):
    pytest.importorskip("transformers")
    from tests.strategies.hf_models import lit_causal_lm

    # GPT-2 whose attention keeps its head count under a name meshlight does not know: the parts of its fused q|k|v
    # cannot be told, so the planner is held at tp=1 (from the config's heads alone it would plan tp); litgpt's fused
    # q|k|v and an HF Llama keep tp among its choices. None has meshlight.nn.MoE layers: ep stays 1.
    unknown = lit_causal_lm("gpt2")
    for block in unknown.model.transformer.h:
        block.attn.n_h = block.attn.__dict__.pop("num_heads")
        del block.attn.head_dim
    for module, tp_planned in ((unknown, False), (lit_causal_lm("litgpt"), True), (lit_causal_lm("llama"), True)):
        strategy = ml.Hybrid3DStrategy()
        ml.Trainer(strategy=strategy, devices=1, accelerator="cpu", logger=False)
        strategy.connect(module)
        with caplog.at_level("INFO"):
            assert strategy._unsplittable() == ({"ep": 1} if tp_planned else {"tp": 1, "ep": 1})
    assert ("Planning with tp=1: tensor parallelism cannot split this model (model.transformer.h.0.attn looks like a"
            " fused projection (model.transformer.h.0.attn.c_attn)") in caplog.text


def test_the_planner_pipelines_a_vision_language_model_keeping_the_layers_its_encoder_feeds_on_the_first_stage():
    """A vision-language model's encoder goes to the first pipeline stage: pp stays the planner's (LLaVA's and
    Qwen3-VL's). Qwen3-VL's decoder adds its encoder's features after its first layers (its deepstack: one here), which
    only the first stage has: that stage holds them and the next, which bounds the stages at pp · virtual_stages ≤
    layers − 1 (its 2 layers: no pipeline; its 4: 3 stages at most, so no interleaving over 2 ranks)."""
    pytest.importorskip("transformers")
    from meshlight.parallel.planner import HARDWARE, model_spec_of, plan
    from tests.strategies.hf_vlm import lit_vlm

    for family in ("llava", "qwen3_vl_moe"):
        strategy = ml.Hybrid3DStrategy()
        ml.Trainer(strategy=strategy, devices=1, accelerator="cpu", logger=False)
        strategy.connect(lit_vlm(family))
        assert strategy._unsplittable() == ({"ep": 1} if family == "llava" else {}), family
    spec = model_spec_of(lit_vlm("qwen3_vl-deep"))
    assert (spec.layers, spec.first_stage_layers) == (4, 2)
    layouts = {(c.pp, c.virtual_stages) for c in plan(spec, HARDWARE["h100"], 4, 8, dp=1)}
    assert max(pp * stages for pp, stages in layouts) == 2 and (2, 1) in layouts
    assert model_spec_of(lit_vlm("llava")).first_stage_layers == 1


def test_the_planner_splits_a_models_own_experts_over_tp_where_it_can_else_keeps_them_whole():
    pytest.importorskip("transformers")
    from tests.strategies.hf_models import experts_in_another_layout, lit_causal_lm

    # Mixtral's and GPT-OSS's stacked experts split over tp as meshlight's own do: the planner chooses freely
    for family in ("mixtral", "gpt_oss"):
        for arguments in ({}, {"tp": 2}, {"tp": 2, "ep": 1}):
            strategy = ml.Hybrid3DStrategy(**arguments)
            ml.Trainer(strategy=strategy, devices=arguments.get("tp", 1), accelerator="cpu", logger=False)
            strategy.connect(lit_causal_lm(family))
            assert strategy._unsplittable() == {}, (family, arguments)
    # experts in a layout it cannot split, and experts held as a list (litgpt's), are kept whole: tp stays 1 unless
    # given, and under a given tp expert parallelism folds over the tp ranks (or is 1, the experts whole on each);
    # experts given are the user's
    for model in (lambda: experts_in_another_layout(lit_causal_lm("mixtral")), lambda: lit_causal_lm("litgpt_moe")):
        for arguments, fixed in (({}, {"tp": 1}), ({"tp": 2}, {"experts": "fold"}), ({"tp": 2, "ep": 1}, {}),
                                 ({"tp": 2, "experts": "split"}, {}), ({"tp": 1}, {})):
            strategy = ml.Hybrid3DStrategy(**arguments)
            ml.Trainer(strategy=strategy, devices=arguments.get("tp", 1), accelerator="cpu", logger=False)
            strategy.connect(model())
            assert strategy._unsplittable() == fixed, arguments
    # a load-balancing loss from every layer's router logits: they travel down the pipeline, nothing is fixed
    strategy = ml.Hybrid3DStrategy()
    ml.Trainer(strategy=strategy, devices=1, accelerator="cpu", logger=False)
    strategy.connect(lit_causal_lm("mixtral-aux"))
    assert strategy._unsplittable() == {}
    # PEFT's LoRA on Qwen3-MoE's stacked experts (which PEFT adapts in place, target_modules naming gate_proj …) follows
    # them as they are split: nothing is fixed, as for Mixtral with LoRA on its attention; LoRA on a Linear's weight
    # (target_parameters naming it) fixes tp and ep
    import peft

    on_weight = lit_causal_lm("llama")
    on_weight.model = peft.get_peft_model(on_weight.model, peft.LoraConfig(
        r=4, target_modules=[], target_parameters=["layers.0.self_attn.q_proj.weight"]))
    for module, fixed in ((lit_causal_lm("qwen3_moe-lora"), {}), (lit_causal_lm("mixtral-lora"), {}),
                          (on_weight, {"tp": 1, "ep": 1})):
        strategy = ml.Hybrid3DStrategy()
        ml.Trainer(strategy=strategy, devices=1, accelerator="cpu", logger=False)
        strategy.connect(module)
        assert strategy._unsplittable() == fixed, module


def test_the_strategy_runs_the_virtual_stages_the_planner_chose():
    """Over 2 microbatches an 8-block GPT interleaves 4 stages a rank (each microbatch's bubble a quarter of plain
    1F1B's); the strategy runs those 4, not Interleaved1F1B's default 2."""
    from meshlight.demos import LitGPT
    from meshlight.models import GPTConfig
    from meshlight.parallel.planner import HARDWARE

    strategy = ml.Hybrid3DStrategy(dp=1, pp=2, tp=1, microbatches=2, hardware=HARDWARE["cpu"])
    ml.Trainer(strategy=strategy, devices=2, accelerator="cpu", logger=False)
    module = LitGPT(GPTConfig.tiny(n_layers=8))
    module.batch_size = 64
    strategy.connect(module)
    strategy._choose_layout()
    assert (strategy.plan[0].schedule, strategy.plan[0].virtual_stages) == ("interleaved1f1b", 4)
    options = strategy._pipeline_options
    assert (options.schedule, options.microbatches, options.virtual_stages) == ("interleaved1f1b", 2, 4)


def test_a_split_naming_where_stages_begin_is_planned_with_that_many_stages():
    """A split of an 8-block GPT into 4 named stages, on 2 processes: the planner pipelines it (it would not, free:
    tensor and data parallelism win on gloo) over 2 ranks of 2 stages each, as the split needs, each rank priced
    with the blocks of its stages."""
    from meshlight.demos import LitGPT
    from meshlight.models import GPTConfig
    from meshlight.parallel.planner import HARDWARE

    split = ["blocks.3", "blocks.5", "blocks.7"]
    strategy = ml.Hybrid3DStrategy(split=split, hardware=HARDWARE["cpu"])
    ml.Trainer(strategy=strategy, devices=2, accelerator="cpu", logger=False)
    module = LitGPT(GPTConfig.tiny(n_layers=8))
    module.batch_size = 64
    strategy.connect(module)
    strategy._choose_layout()
    assert {(c.pp, c.virtual_stages) for c in strategy.plan} == {(2, 2)}
    assert strategy._run_options()["stage_blocks"] == (3, 2, 2, 1)  # rank 0 runs 5 blocks, rank 1 3 and the head
    options = strategy._pipeline_options
    assert (options.schedule, options.virtual_stages, options.split) == ("interleaved1f1b", 2, split)


def test_the_planner_prices_each_pipeline_rank_by_the_blocks_the_split_gives_it_and_chooses_the_split():
    """Each pipelined layout is priced by the blocks its split gives each stage, as the strategy will run it; with no
    split given, the planner prices the default (balancing parameters) and a split by block count, and the strategy
    runs the faster. Here the embeddings weigh 3 blocks: balancing parameters leaves the first stage 3 blocks and
    the last 5 beside the LM head, where a split by count runs 4 and 4."""
    from meshlight.demos import LitGPT
    from meshlight.models import GPTConfig
    from meshlight.parallel.pipeline import plan_stages
    from meshlight.parallel.planner import HARDWARE

    def planned(**options):
        strategy = ml.Hybrid3DStrategy(pp=2, hardware=HARDWARE["cpu"], **options)
        ml.Trainer(strategy=strategy, devices=2, accelerator="cpu", logger=False)
        module = LitGPT(GPTConfig.tiny(n_layers=8, max_seq_len=2048))  # embeddings as large as 3 blocks
        module.batch_size = 64
        strategy.connect(module)
        strategy._choose_layout()
        return strategy, module

    def priced_as(strategy, module, split):
        for candidate in strategy.plan:
            stages = plan_stages(module.model, "blocks", 2 * candidate.virtual_stages, split).blocks
            assert candidate.stage_blocks == tuple(len(blocks) for blocks in stages), candidate.describe()

    strategy, module = planned()
    assert strategy._pipeline_options.split == "layers" and strategy.plan[0].stage_blocks == (4, 4)
    priced_as(strategy, module, "layers")
    # a split given is the one priced and run
    strategy, module = planned(split="parameters")
    assert strategy._pipeline_options.split == "parameters"
    priced_as(strategy, module, "parameters")
    assert strategy.plan[0].tokens_per_second_per_device < planned()[0].plan[0].tokens_per_second_per_device


@pytest.mark.parametrize("name", ["llama", "litgpt"])
def test_pipelines_of_hugging_face_and_litgpt_models_are_priced_by_their_stages_blocks(name):
    """The same pricing on models we did not write: every pipelined candidate's stage sizes are those the split the
    strategy runs gives their blocks (``stage_plan``, as ``setup_pipeline`` splits them)."""
    from meshlight.parallel.planner import HARDWARE
    from meshlight.strategies.pipeline_steps import stage_plan
    from tests.strategies.hf_models import lit_causal_lm

    strategy = ml.Hybrid3DStrategy(pp=2, hardware=HARDWARE["cpu"])
    ml.Trainer(strategy=strategy, devices=2, accelerator="cpu", logger=False)
    module = lit_causal_lm(name)
    module.batch_size = 8
    strategy.connect(module)
    strategy._choose_layout()
    split = strategy._pipeline_options.split or "parameters"
    for candidate in strategy.plan:
        stages = stage_plan(module, 2 * candidate.virtual_stages, split, probe=False)[2].blocks
        assert candidate.stage_blocks == tuple(len(blocks) for blocks in stages), candidate.describe()
    assert any(candidate.pp == 2 for candidate in strategy.plan)


def _fit_on_one_process(strategy, callbacks=(), batch_size=4, **trainer_options):
    from meshlight.demos import AdditionDataModule, LitGPT

    trainer = ml.Trainer(strategy=strategy, devices=1, accelerator="cpu", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=list(callbacks), **trainer_options)
    module = LitGPT()
    trainer.fit(module, AdditionDataModule(batch_size=batch_size, train_size=16))
    return trainer, module


def test_what_would_fit_on_the_same_process_is_named_and_does_fit():
    from meshlight.callbacks import MixedPrecision
    from meshlight.parallel.planner import HARDWARE, PlanError

    small = HARDWARE["cpu"].replace(memory=6e6)  # bytes: the tiny GPT at batch 4 fits in none of its layouts
    with pytest.raises(PlanError) as error:
        _fit_on_one_process(ml.Hybrid3DStrategy(hardware=small))
    message = str(error.value)
    # fastest first: the smaller batch needs no recomputation
    assert ("On this device it fits with a batch of 2 per replica and accumulate_grad_batches=2 as dp=1 pp=1 tp=1"
            " zero=0 (4.9 MB of 5.4 MB usable, 27,918 tokens/s per device); or MixedPrecision(\"bf16\") as dp=1 pp=1"
            " tp=1 zero=0 recompute (4.8 MB of 5.4 MB usable, 21,529 tokens/s per device).") in message
    assert "Offload" not in message  # a CPU process's memory is the host's: offloading frees none of it
    trainer, _ = _fit_on_one_process(ml.Hybrid3DStrategy(hardware=small), [MixedPrecision("bf16")])
    assert trainer.global_step == 1
    trainer, _ = _fit_on_one_process(ml.Hybrid3DStrategy(hardware=small), batch_size=2, accumulate_grad_batches=2)
    assert trainer.global_step == 1
    # what the user fixed stays fixed in the remedy: here ZeRO-1 and no recomputation (which MixedPrecision needs)
    for sizes in ({"zero": 1}, {"dp": 1, "pp": 1, "tp": 1, "ep": 1, "zero": 1}):  # planned, and given whole
        with pytest.raises(PlanError) as error:
            _fit_on_one_process(ml.Hybrid3DStrategy(hardware=small, recompute=False, **sizes))
        message = str(error.value)
        assert ("On this device it fits with a batch of 2 per replica and accumulate_grad_batches=2 as dp=1 pp=1"
                " tp=1 zero=1 (4.9 MB of 5.4 MB usable") in message and "MixedPrecision" not in message
    fixed = ml.Hybrid3DStrategy(hardware=small, recompute=False, dp=1, pp=1, tp=1, ep=1, zero=1)
    trainer, _ = _fit_on_one_process(fixed, batch_size=2, accumulate_grad_batches=2)
    assert trainer.global_step == 1


def test_a_given_device_gives_the_monitors_mfu_its_peak_and_the_host_step_the_runs_threads():
    from meshlight.callbacks import TrainingMonitor
    from meshlight.parallel.planner import HARDWARE

    monitor, strategy = TrainingMonitor(), ml.Hybrid3DStrategy(hardware=HARDWARE["cpu"].replace(peak_flops=123e9))
    _fit_on_one_process(strategy, [monitor])
    assert monitor.peak_flops == 123e9
    # a device given without a host thread count is planned with the run's own; one given with it keeps it
    assert strategy.hardware.host_threads == torch.get_num_threads()
    strategy = ml.Hybrid3DStrategy(hardware=HARDWARE["cpu"].replace(host_threads=5))
    _fit_on_one_process(strategy)
    assert strategy.hardware.host_threads == 5


def test_the_recomputation_the_layout_was_planned_with_is_what_runs(caplog):
    from meshlight.parallel.blocks import repeated_blocks
    from meshlight.parallel.planner import HARDWARE, PlanError

    # 7 MB: the tiny GPT's AdamW state and activations fit on one process only when its blocks recompute
    small = HARDWARE["cpu"].replace(memory=7e6)
    for sizes in ({}, {"dp": 1, "pp": 1, "tp": 1, "ep": 1, "zero": 0}):  # planned, and a layout given whole
        strategy = ml.Hybrid3DStrategy(hardware=small, **sizes)
        with caplog.at_level("INFO"):
            trainer, module = _fit_on_one_process(strategy)
        assert strategy.plan[0].recompute, strategy.plan[0].describe()
        assert all(block._meshlight_recompute for block in repeated_blocks(module)), sizes
        assert trainer.global_step == 1
        assert "Every block recomputes its activations in backward, as planned" in caplog.text
        caplog.clear()
    # told not to recompute: refused before training, naming what would fit
    with pytest.raises(PlanError, match=r"It fits as dp=1 pp=1 tp=1 zero=\d recompute: leave recompute to the"
                                        r" planner\."):
        _fit_on_one_process(ml.Hybrid3DStrategy(hardware=small, recompute=False))
    with pytest.raises(PlanError, match=r"dp=1 .* is not expected to fit .* Nearest layouts that fit: dp=1 pp=1 tp=1"
                                        r" zero=\d recompute"):
        _fit_on_one_process(ml.Hybrid3DStrategy(dp=1, pp=1, tp=1, ep=1, zero=0, recompute=False, hardware=small))
    # asked for: recomputed, though it fits without
    strategy = ml.Hybrid3DStrategy(recompute=True)
    _, module = _fit_on_one_process(strategy)
    assert all(c.recompute for c in strategy.plan)
    assert all(block._meshlight_recompute for block in repeated_blocks(module))


def test_an_activation_checkpointing_callback_is_what_the_planner_plans_with():
    from meshlight.callbacks import ActivationCheckpointing
    from meshlight.parallel.blocks import repeated_blocks
    from meshlight.parallel.planner import HARDWARE

    small = HARDWARE["cpu"].replace(memory=7e6)
    # every second block: the memory check counts it as full recomputation (it refuses only what cannot fit)
    strategy = ml.Hybrid3DStrategy(hardware=small)
    trainer, module = _fit_on_one_process(strategy, [ActivationCheckpointing(every_n_blocks=2)])
    assert strategy.plan[0].recompute and trainer.global_step == 1
    assert [getattr(block, "_meshlight_recompute", False) for block in repeated_blocks(module)] == [False, True]
    # with plenty of memory the planner would not recompute, but the callback asked for it
    strategy = ml.Hybrid3DStrategy()
    _fit_on_one_process(strategy, [ActivationCheckpointing()])
    assert all(c.recompute for c in strategy.plan)
    with pytest.raises(ValueError, match=r"recompute=False\) and an ActivationCheckpointing callback both choose"):
        _fit_on_one_process(ml.Hybrid3DStrategy(recompute=False), [ActivationCheckpointing()])


def test_the_planner_counts_the_bytes_the_runs_precision_keeps():
    from meshlight.callbacks import MixedPrecision
    from meshlight.parallel.planner import AUTOCAST_ACTIVATION_BYTES, HARDWARE

    # 7 MB: the tiny GPT fits without recomputation when its activations are 16-bit, not in fp32
    small = HARDWARE["cpu"].replace(memory=7e6, param_bytes=2, activation_bytes=2)
    for options, callbacks, (param_bytes, activation_bytes, state_bytes, recompute) in (
        ({}, [], (4, 4, 4, True)),
        ({"precision": "bf16-mixed"}, [], (4, AUTOCAST_ACTIVATION_BYTES, 4, False)),
        ({}, [MixedPrecision("bf16")], (2, 2, 4, False)),
        ({"precision": "bf16-true"}, [], (2, 2, 2, False)),
    ):
        strategy = ml.Hybrid3DStrategy(hardware=small)
        trainer, module = _fit_on_one_process(strategy, callbacks, **options)
        hardware = strategy.hardware
        assert (hardware.param_bytes, hardware.activation_bytes, hardware.state_bytes) == (
            param_bytes, activation_bytes, state_bytes)
        assert strategy.plan[0].recompute is recompute, options
        assert trainer.global_step == 1
        if param_bytes == state_bytes:  # one process, no FSDP: what autograd and AdamW hold is all there is
            held = sum(t.untyped_storage().nbytes() for p in module.parameters() for t in (p, p.grad))
            held += sum(t.untyped_storage().nbytes() for state in trainer.optimizers[0].state.values()
                        for t in state.values() if t.dim())
            assert strategy.plan[0].model_state_bytes == pytest.approx(held, rel=0.02), options


def test_an_offload_callback_is_what_the_planner_plans_with():
    from meshlight.callbacks import Offload
    from meshlight.demos import LitGPT
    from meshlight.parallel.blocks import BlockSelection, repeated_blocks
    from meshlight.parallel.offload import OffloadPolicy
    from meshlight.strategies.hybrid import _offloaded

    module, cuda = LitGPT(), torch.device("cuda")
    assert _offloaded(OffloadPolicy(), module, cuda) == {"offload_optimizer": True, "offload_activations": 0.0}
    every_other = OffloadPolicy(optimizer=False, activations=BlockSelection(every_n_blocks=2))
    assert _offloaded(every_other, module, cuda) == {"offload_optimizer": False, "offload_activations": 0.5}
    block_type = type(repeated_blocks(module)[0])
    by_type = OffloadPolicy(activations=BlockSelection(module_types=(block_type,)))
    assert _offloaded(by_type, module, cuda)["offload_activations"] == 1.0
    # a CPU's host memory is its memory: offloading frees none, and the plan counts everything
    assert _offloaded(OffloadPolicy(), module, torch.device("cpu")) == {}
    strategy = ml.Hybrid3DStrategy()
    _fit_on_one_process(strategy, [Offload(optimizer=True, pin_memory=False)])
    assert not strategy.hardware.offload_optimizer and strategy.hardware.offload_activations == 0
