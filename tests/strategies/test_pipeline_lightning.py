"""Lightning behaves under pp=2 as without pipelining: synced logged values (with a torchmetrics metric),
sanity validation, the progress bar, ModelCheckpoint(monitor="val/loss") on every rank, TensorBoard on rank
0, predictions on every rank, checkpoints that resume exactly and load in one process; keyword arguments of the
forward on every stage, validation inside an accumulation window, logged values combined by their reduce_fx."""

from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from meshlight.parallel import load_model_weights
from tests.launch import torchrun
from tests.strategies.parity import assert_parity
from tests.strategies.workers import pipeline_lightning_worker as worker


@pytest.fixture(scope="module")
def control(tmp_path_factory) -> dict:
    return worker.run(lambda: "auto", 1, tmp_path_factory.mktemp("control"))


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pipeline-lightning")
    torchrun(Path(worker.__file__), 2, str(out))
    return out


@pytest.fixture(scope="module")
def ranks(out) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_every_rank_logs_the_single_process_values(ranks, control):
    for rank in ranks:
        assert len(rank["epochs"]) == worker.EPOCHS
        for got, expected in zip(rank["epochs"], control["epochs"]):
            for name, value in expected.items():
                assert abs(got[name] - value) <= 1e-4 * abs(value) + 1e-7, (name, got[name], value)


def test_sanity_validation_runs_and_the_progress_bar_shows_the_loss(ranks):
    for rank in ranks:
        assert rank["sanity_batches"] == 2
        assert {"train/loss", "val/loss", "val/answer_accuracy"} <= set(rank["progress_bar"])


def test_stages_train_in_training_mode_after_validation_and_evaluate_in_eval_mode(ranks, control):
    # Lightning restores the LightningModule's modes after validation, not the stages' own copies: training
    # after the sanity check once ran every stage in eval mode (no dropout, gathered logits under tp).
    for rank in [*ranks, control]:
        assert rank["wrong_modes"] == []
        assert rank["forwards"][True] > 0 and rank["forwards"][False] > 0


def test_model_checkpoint_monitoring_val_loss_saves_the_same_best_everywhere(ranks, control):
    assert ranks[0]["best"] == ranks[1]["best"] == control["best"]


def test_rank_zero_tensorboard_holds_train_and_validation_losses(out, control):
    events = EventAccumulator(str(out / "tb" / "version_0"))
    events.Reload()
    val_loss = [e.value for e in events.Scalars("val/loss")]
    assert len(events.Scalars("train/loss")) == 5 * worker.EPOCHS and len(val_loss) == worker.EPOCHS
    assert val_loss[-1] == pytest.approx(control["epochs"][-1]["val/loss"], rel=1e-4)


def test_rank_zero_tensorboard_shows_the_pipeline_timeline(out):
    import io

    import numpy as np
    from PIL import Image

    from meshlight.callbacks.pipeline_timeline import COLORS, IDLE

    events = EventAccumulator(str(out / "tb" / "version_0"), size_guidance={"images": 0})
    events.Reload()
    (timeline,) = events.Images("pipeline/timeline")
    image = np.asarray(Image.open(io.BytesIO(timeline.encoded_image_string)).convert("RGB"))
    assert timeline.step == 2 and image.shape[1] == 960  # the labelled figure (tests/callbacks/test_figures.py)
    # 1F1B on 2 stages: the ranks ran forward and backward chunks, and idled in between
    assert {COLORS["F"], COLORS["B"], IDLE} <= {tuple(pixel) for pixel in image.reshape(-1, 3)}
    (bubble,) = events.Scalars("pipeline/bubble")
    assert 0.0 < bubble.value < 1.0


def test_a_second_trainer_validates_the_same_pipelined_module(ranks, control):
    for rank in ranks:
        for name, value in control["validated_again"].items():
            assert rank["validated_again"][name] == pytest.approx(value, rel=1e-4), name


def test_every_rank_of_the_pipeline_gets_the_predictions(ranks, control):
    for rank in ranks:
        assert torch.equal(rank["predictions"], control["predictions"])


def test_weights_match_one_process_and_resuming_reproduces_them(ranks, control):
    assert_parity({"losses": [], "weights": ranks[0]["weights"]}, {"losses": [], "weights": control["weights"]})
    for name, weight in ranks[0]["weights"].items():
        torch.testing.assert_close(ranks[0]["resumed_weights"][name], weight, rtol=1e-6, atol=1e-7)


def test_a_pipeline_checkpoint_loads_in_one_process(out, ranks):
    module = worker.gpt8()
    load_model_weights(module, out / "final.ckpt")
    for name, weight in module.state_dict().items():
        assert torch.equal(weight, ranks[0]["weights"][name]), name


def test_keyword_arguments_of_the_forward_reach_every_stage(ranks, control):
    # The padding mask PaddedLM passes by keyword once reached stage 0 only: stage 1's block read None.
    expected = control["padded"]
    assert expected["validations"]
    for rank in ranks:
        got = rank["padded"]
        assert got["batches"][0]["window/loss"] == pytest.approx(expected["batches"][0]["window/loss"], rel=1e-4)
        assert got["validations"] == pytest.approx(expected["validations"], rel=1e-4)


def test_validation_inside_an_accumulation_window_leaves_its_gradients_alone(ranks, control):
    # torch's evaluation schedule divides .grad by the microbatch count: once, the window's first half.
    assert_parity({"losses": [], "weights": ranks[0]["padded"]["weights"]},
                  {"losses": [], "weights": control["padded"]["weights"]})


def test_logged_values_combine_over_microbatches_by_their_reduce_fx(ranks, control):
    expected = control["padded"]["batches"]
    assert len(expected) == 4 and all(batch["window/samples"] == worker.BATCH for batch in expected)
    for rank in ranks:
        assert len(rank["padded"]["batches"]) == len(expected)
        for got, want in zip(rank["padded"]["batches"], expected):
            for name, value in want.items():
                assert got[name] == pytest.approx(value, rel=1e-4), name
