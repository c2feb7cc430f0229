"""Checkpoints are portable: saved under ZeRO-3 on 4 processes, they load under DDP on 2 processes, under
tensor parallelism and in a single process with equal weights, and training resumes from them under DDP and
under pipeline parallelism. Bad input fails on every rank, fast."""

import warnings
from pathlib import Path

import pytest
import torch

from meshlight.parallel import load_model_weights
from tests.launch import torchrun
from tests.strategies.parity import assert_parity
from tests.strategies.workers import checkpoint_worker

WORKER = Path(checkpoint_worker.__file__)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("checkpoint")
    torchrun(WORKER, 4, "save", str(out))
    return out


def _first_epoch_checkpoint(out: Path) -> Path:
    return sorted((out / "ckpt").glob("epoch=0-*.ckpt"))[0]


def test_zero3_checkpoint_loads_under_ddp_on_two_processes_and_training_resumes(saved):
    torchrun(WORKER, 2, "load", str(saved))
    reference = torch.load(saved / "save.pt", weights_only=False)
    for name, weight in reference["first_epoch_weights"].items():
        assert torch.equal(torch.load(saved / "loaded_weights.pt")[name], weight), name
    # Adam moments and the LR schedule come back resharded: the second epoch trains as it did under ZeRO-3.
    assert len(reference["losses"]) == checkpoint_worker.STEPS_PER_EPOCH
    assert_parity(torch.load(saved / "load.pt", weights_only=False), reference)


def test_zero3_checkpoint_loads_in_a_single_process(saved):
    reference = torch.load(saved / "save.pt", weights_only=False)["first_epoch_weights"]
    module = checkpoint_worker.model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: one process is the intent (DCP warned it "assumes" so)
        load_model_weights(module, _first_epoch_checkpoint(saved))
    for name, weight in module.state_dict().items():
        assert torch.equal(weight, reference[name]), name


@pytest.fixture(scope="module")
def other_layouts(saved) -> Path:
    torchrun(WORKER, 2, "layouts", str(saved))
    return saved


def test_zero3_checkpoint_loads_under_tensor_parallelism_and_back_into_one_process(other_layouts):
    reference = torch.load(other_layouts / "save.pt", weights_only=False)["first_epoch_weights"]
    for name, weight in torch.load(other_layouts / "tp_weights.pt").items():
        assert torch.equal(weight, reference[name]), name
    module = checkpoint_worker.model()
    load_model_weights(module, other_layouts / "from_tp.ckpt")
    for name, weight in module.state_dict().items():
        assert torch.equal(weight, reference[name]), name


def test_zero3_checkpoint_resumes_under_pipeline_parallelism(other_layouts):
    # weights, Adam moments and the LR schedule split into pipeline stages: the second epoch trains as under ZeRO-3
    reference = torch.load(other_layouts / "save.pt", weights_only=False)
    pipelined = torch.load(other_layouts / "layouts.pt", weights_only=False)
    assert len(pipelined["losses"]) == checkpoint_worker.STEPS_PER_EPOCH
    assert_parity(pipelined, reference)


def test_mismatched_names_fail_in_a_single_process_with_the_names(saved):
    with pytest.raises(KeyError, match=r"missing from the checkpoint \(\d+\): model\.blocks\.2\."):
        load_model_weights(checkpoint_worker.model(n_layers=3), _first_epoch_checkpoint(saved))


def test_mismatched_names_fail_on_every_rank_without_hanging(saved):
    result = torchrun(WORKER, 2, "mismatch", str(saved), timeout=120, check=False)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    for rank in (0, 1):
        assert f"[rank{rank}]: meshlight.parallel.checkpoint.CheckpointMismatchError" in output, output[-3000:]
    assert "missing from the checkpoint (8): model.blocks.2." in output
    assert "unexpected in the checkpoint (0): none" in output


def test_a_layout_that_does_not_fit_the_world_fails_on_every_rank_without_hanging():
    result = torchrun(WORKER, 2, "badlayout", timeout=120, check=False)
    assert result.returncode != 0
    # Raised while the Trainer is built, before any process group exists: each rank prints its own traceback.
    assert (result.stdout + result.stderr).count("uses 3 processes but the world has 2") >= 2
