"""Pipeline splitting plans, in one process: the pipelined module, balanced and explicit stage plans, loop and V
placement, schedule validation (the stage modules: tests/parallel/test_pipeline_stages.py; schedules run on
processes in tests/strategies)."""

import pytest

from meshlight.demos import LitGPT
from meshlight.models import GPT, GPTConfig
from meshlight.parallel.pipeline import (
    PipelineError,
    find_pipelined_module,
    plan_stages,
    stages_of_rank,
    validate_schedule,
)
from tests.strategies.llama import LitLlama
from tests.strategies.nanogpt import LitNanoGPT


def gpt(**overrides) -> GPT:
    return GPT(GPTConfig.tiny(n_layers=8, **overrides))


def test_the_pipelined_module_is_the_owner_of_the_blocks():
    name, module, container = find_pipelined_module(LitGPT(GPTConfig.tiny()))
    assert (name, type(module).__name__, container) == ("model", "GPT", "blocks")
    assert find_pipelined_module(LitLlama())[0::2] == ("model", "layers")
    # nanoGPT's ModuleDict of different pieces is a namespace: the blocks are its list h
    assert find_pipelined_module(LitNanoGPT())[0::2] == ("model.transformer", "h")


def test_balancing_by_parameters_counts_embeddings_and_head():
    plan = plan_stages(gpt(), "blocks", 2)
    assert (plan.pre, plan.post) == (("embed",), ("norm", "head"))
    assert plan.blocks == (tuple("0123"), tuple("4567"))  # embed and head weigh the same here
    long_positions = gpt(max_seq_len=4096)  # a 4096 × 64 position table: stage 0 starts heavy
    assert len(plan_stages(long_positions, "blocks", 2).blocks[0]) < 4


def test_balancing_by_layers_and_explicit_split_points():
    assert plan_stages(gpt(), "blocks", 3, "layers").blocks == (("0", "1"), ("2", "3", "4"), ("5", "6", "7"))
    explicit = plan_stages(gpt(), "blocks", 3, ["model.blocks.2", "blocks.6"])
    assert explicit.blocks == (("0", "1"), ("2", "3", "4", "5"), ("6", "7"))
    with pytest.raises(PipelineError, match="must name 2 distinct blocks in increasing order"):
        plan_stages(gpt(), "blocks", 3, ["blocks.6", "blocks.2"])
    with pytest.raises(PipelineError, match="names no block"):
        plan_stages(gpt(), "blocks", 2, ["blocks.9"])


def test_a_split_the_pipeline_given_cannot_have_is_refused_before_any_process_starts():
    import meshlight as ml

    def trainer(strategy, devices=2):  # the Trainer settles the layout of its world, then checks the split
        return ml.Trainer(strategy=strategy, devices=devices, accelerator="cpu", logger=False)

    three = ["blocks.2", "blocks.4"]  # where stages 2 and 3 begin: 3 stages in all
    with pytest.raises(PipelineError, match=r"starts 3 stages, but pp=2 × virtual_stages=1 runs 2: name 1 blocks"):
        trainer(ml.PipelineStrategy(split=three))
    with pytest.raises(PipelineError, match="starts 3 stages, but pp=1 runs no pipeline: give a pp above 1 that"):
        trainer(ml.MeshStrategy(split=three))
    with pytest.raises(PipelineError, match="but pp=1 runs no pipeline"):
        ml.Hybrid3DStrategy(pp=1, split=three)
    with pytest.raises(PipelineError, match="which pp=2 ranks cannot share evenly: give a pp that divides 3"):
        ml.Hybrid3DStrategy(pp=2, split=three)
    with pytest.raises(PipelineError, match="split='blocks': use 'parameters', 'layers' or a list of block names"):
        ml.Hybrid3DStrategy(split="blocks")
    trainer(ml.PipelineStrategy(split=three), devices=3)
    # with pp given, a rank's stages follow (the planner chooses both where pp is not given)
    options = ml.Hybrid3DStrategy(pp=2, split=[*three, "blocks.6"])._pipeline_options
    assert (options.schedule, options.virtual_stages, options.split) == ("interleaved1f1b", 2, [*three, "blocks.6"])


def test_more_stages_than_blocks_is_refused():
    with pytest.raises(PipelineError, match="9 pipeline stages but only 8 blocks"):
        plan_stages(gpt(), "blocks", 9)


def test_loop_and_v_placement():
    assert [stages_of_rank(r, 4, 2, "interleaved1f1b") for r in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert [stages_of_rank(r, 4, 2, "zbvzerobubble") for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]


@pytest.mark.parametrize(("schedule", "virtual", "message"), [
    ("1f2b", 1, r"Unknown pipeline schedule '1f2b'; choose one of \['gpipe', '1f1b'"),
    ("1f1b", 2, "runs one stage per rank"),
    ("zbvzerobubble", 1, "places exactly 2 stages per rank"),
    ("interleaved1f1b", 1, "set virtual_stages >= 2"),
])
def test_invalid_schedules_are_refused_when_the_strategy_is_made(schedule, virtual, message):
    with pytest.raises(PipelineError, match=message):
        validate_schedule(schedule, 2, virtual, 4)
    import meshlight as ml

    with pytest.raises(PipelineError, match=message):
        ml.PipelineStrategy(pp=2, schedule=schedule, virtual_stages=virtual)
