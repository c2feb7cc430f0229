"""Expert parallelism reproduces single-process training: MoE GPT-tiny with 8 experts, top-2 and top-1,
dropless and with a capacity factor, expert bias, ep = 2 and 4, ep=2 on 4 processes (dp=4), ZeRO 0/1/3,
gradient accumulation and clipping, and a Llama-shaped module with meshlight.nn.MoE; and under tensor parallelism
(tp=2 on 2 processes, tp=2 × ep=2 on 4 with the experts split over tp and folded) — losses and final
weights within 1e-4 over 20 steps, and the same expert loads. A checkpoint saved under ep=2 × ZeRO-3 loads
exactly under ep=4 and in one process; bad layouts fail on every rank before training."""

from pathlib import Path

import pytest
import torch

from meshlight.parallel import load_model_weights
from tests.launch import torchrun
from tests.strategies.parity import assert_parity, train
from tests.strategies.workers import moe_worker

WORKER = Path(moe_worker.__file__)
RUNS = [(world, run) for world in (2, 4) for run in moe_worker.runs(world)]
IDS = [f"{world}proc-ep{r[0]}-zero{r[1]}-{r[2]}-{r[3]}" for world, r in RUNS]


TENSOR_RUNS = [(world, run) for world in (2, 4) for run in moe_worker.tensor_runs(world)]
TENSOR_IDS = [f"{world}proc-{r[0]}-tp{r[1]}-ep{r[2]}-{r[3]}-zero{r[4]}-{r[5]}" for world, r in TENSOR_RUNS]


@pytest.fixture(scope="module")
def controls() -> dict:
    needed = {(model, variant) for _, (_, _, model, variant) in RUNS}
    out = {}
    for model, variant in sorted(needed):
        result = train(variant, model=moe_worker.factory(model))
        result["loads"] = moe_worker.expert_loads(result.pop("module"))
        out[(model, variant)] = result
    return out


@pytest.fixture(scope="module")
def distributed(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("moe")
    results = {}
    for world in (2, 4):
        torchrun(WORKER, world, str(out), str(world))
        results[world] = torch.load(out / f"{world}.pt", weights_only=False)
    results["checkpoint"] = out / "moe.ckpt"
    return results


@pytest.mark.parametrize(("world", "run"), RUNS, ids=IDS)
def test_expert_parallel_matches_single_process_training(distributed, controls, world, run):
    result, control = distributed[world][run], controls[run[2:]]
    assert_parity(result, control)
    # Expert loads are summed over all data-parallel ranks: the same counts as the single process saw.
    assert result["loads"].keys() == control["loads"].keys()
    for name, expected in control["loads"].items():
        torch.testing.assert_close(torch.tensor(result["loads"][name]), torch.tensor(expected), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("world", "run"), TENSOR_RUNS, ids=TENSOR_IDS)
def test_moe_under_tensor_parallelism_matches_single_process_training(distributed, controls, world, run):
    # every tp rank routes the whole sequence: capacity drops the same assignments and the loads are the same counts
    result, control = distributed[world][run], controls[(run[5], "adamw")]
    assert_parity(result, control)
    for name, expected in control["loads"].items():
        torch.testing.assert_close(torch.tensor(result["loads"][name]), torch.tensor(expected), rtol=1e-4, atol=1e-6)


def test_capacity_variants_drop_tokens_and_dropless_ones_do_not(controls):
    # The capacity runs are only meaningful if the capacity factor actually dropped assignments.
    for (model, _), control in controls.items():
        dropped = [load[moe_worker.EXPERTS] for load in control["loads"].values()]
        assert all(d > 0 for d in dropped) if "capacity" in model else all(d == 0 for d in dropped), (model, dropped)


def test_expert_bias_moved_in_the_bias_run(distributed):
    weights = distributed[4][moe_worker.CHECKPOINTED]["weights"]
    biases = [w for name, w in weights.items() if name.endswith("expert_bias")]
    assert biases and all(b.abs().sum() > 0 for b in biases)


def test_checkpoint_saved_under_ep2_zero3_loads_exactly_under_ep4(distributed):
    saved = distributed[4][moe_worker.CHECKPOINTED]["weights"]
    loaded = distributed[4]["loaded"]
    assert loaded.keys() == saved.keys()
    for name, weight in saved.items():
        assert torch.equal(loaded[name], weight), name


def test_checkpoint_saved_under_ep2_zero3_loads_exactly_in_one_process(distributed):
    saved = distributed[4][moe_worker.CHECKPOINTED]["weights"]
    module = moe_worker.factory(moe_worker.CHECKPOINTED[2])()
    load_model_weights(module, distributed["checkpoint"])
    for name, weight in module.state_dict().items():
        assert torch.equal(weight, saved[name]), name


BAD_INPUT = {
    "experts not divisible by ep": "num_experts=6 is not divisible by ep=4: each rank must hold the same number of"
                                   " experts. Choose ep in [1, 2, 3, 6]",
    "ep not dividing the data-parallel size": "ep=3 does not divide dp_shard=4: expert parallelism borrows its ranks"
                                              " from data parallelism; choose ep in [1, 2, 4]",
    "no MoE layers": "ep=2, but the model has no experts to split",
    "expert hidden size not divisible by tp": "The experts' hidden size 33 is not divisible by tp=2: experts='split'"
                                              " splits each expert's hidden width over the tp ranks. Choose tp in"
                                              " [1, 3, 11, 33], or experts='fold'",
    "a layout that cannot fold": "ep=3 cannot fold over tp=2: experts='fold' spreads the experts over the tp ranks"
                                 " and data ranks, so ep must be a multiple of tp; choose ep in [2, 4]",
    "folded experts not divisible by ep": "num_experts=6 is not divisible by ep=4: each rank must hold the same number"
                                          " of experts. Choose ep in [2, 6] that also divides the data-parallel size,"
                                          " a multiple of tp=2 (experts='fold')",
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_fails_on_every_rank_before_training(distributed, case):
    errors = distributed[4]["bad input"]
    assert sorted(errors) == [0, 1, 2, 3]
    for rank_errors in errors.values():
        assert BAD_INPUT[case] in rank_errors[case], rank_errors[case]
