"""Lightning features behave under every strategy as without one: synced epoch logging, torchmetrics,
sanity validation, ModelCheckpoint(monitor=...), test, predict, resuming with fit(ckpt_path=...) and manual
optimization, with a LightningModule written here (not meshlight's GPT), on 2 processes."""

from pathlib import Path

import pytest
import torch

from meshlight.parallel import checkpoint_keys
from tests.launch import torchrun
from tests.strategies.compat import EPOCHS, run_scenarios
from tests.strategies.parity import assert_parity
from tests.strategies.workers import compat_worker

WORLD = 2


@pytest.fixture(scope="module")
def control(tmp_path_factory) -> dict:
    return run_scenarios("auto", 1, tmp_path_factory.mktemp("control"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("compat")
    torchrun(Path(compat_worker.__file__), WORLD, str(out), str(WORLD))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


STRATEGIES = compat_worker.STRATEGIES


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-4 * abs(b)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_synced_epoch_metrics_equal_single_process(ranks, control, strategy):
    for rank in ranks:
        epochs = rank[strategy]["epochs"]
        assert len(epochs) == EPOCHS
        for got, expected in zip(epochs, control["epochs"]):
            for name, value in expected.items():
                assert _close(got[name], value), (name, got[name], value)


def test_reduce_averages_sums_and_takes_maxima_over_the_world_without_a_barrier(ranks):
    for rank in ranks:  # values rank + 1 = 1, 2
        assert rank["reductions"] == {"values": {"mean": 1.5, "sum": 3.0, "max": 2.0, None: 3.0,
                                                 "mean of integers": 1, "mean of large integers": 100_000_002},
                                      "barriers": 0}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sanity_validation_and_progress_bar(ranks, strategy):
    for rank in ranks:
        assert rank[strategy]["sanity_batches"] == 2
        assert {"train/loss_step", "train/loss_epoch"} <= set(rank[strategy]["progress_bar_keys"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_model_checkpoint_monitors_the_synced_validation_loss(ranks, control, strategy):
    best = [rank[strategy]["best"] for rank in ranks]
    assert best[0] == best[1], "all ranks agree on the best checkpoint"
    expected_epoch = min(range(EPOCHS), key=lambda e: control["epochs"][e]["val/loss"])
    assert Path(best[0]["path"]).name.startswith(f"epoch={expected_epoch}-")
    assert _close(best[0]["score"], control["best"]["score"])
    assert {"state_dict", "optimizer_0"} <= set(checkpoint_keys(best[0]["path"]))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_final_weights_equal_single_process(ranks, control, strategy):
    result = {"losses": [], "weights": ranks[0][strategy]["weights"]}
    assert_parity(result, {"losses": [], "weights": control["weights"]})


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_test_metrics_equal_single_process(ranks, control, strategy):
    for rank in ranks:
        for name, value in control["test"].items():
            assert _close(rank[strategy]["test"][name], value), name


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_rank_predicts_its_share_of_the_data(ranks, control, strategy):
    for r, rank in enumerate(ranks):
        assert torch.equal(rank[strategy]["predictions"], control["predictions"][r::WORLD])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resuming_from_a_checkpoint_reproduces_the_uninterrupted_run(ranks, strategy):
    result = ranks[0][strategy]
    for name, weight in result["weights"].items():
        torch.testing.assert_close(result["resumed_weights"][name], weight, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_manual_optimization_with_clipping_equals_single_process(ranks, control, strategy):
    result = {"losses": [], "weights": ranks[0][strategy]["manual_weights"]}
    assert_parity(result, {"losses": [], "weights": control["manual_weights"]})
