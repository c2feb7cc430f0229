"""Hugging Face models users bring, unchanged, under meshlight's strategies: each dense family (Llama; Qwen2 with
q/k/v biases; Qwen3 with QK-norm and an explicit head_dim) matches one process's training within 1e-4 over 20
steps, under tensor (+ sequence) parallelism and data parallelism. Every run trains in one launch."""

from pathlib import Path

import pytest
import torch

from tests.launch import torchrun
from tests.strategies import parity
from tests.strategies.hf_models import FAMILIES, LitCausalLM, training_options
from tests.strategies.workers import hf_worker

WORKER = Path(hf_worker.__file__)


@pytest.fixture(scope="module")
def controls() -> dict[str, dict]:
    results = {}
    for family in FAMILIES:
        result = parity.train("adamw", model=lambda family=family: LitCausalLM(family, **training_options(family)))
        result.pop("module")
        results[family] = result
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf")
    torchrun(WORKER, 2, str(out), *hf_worker.LAYOUTS)
    return out


@pytest.mark.parametrize("layout", hf_worker.LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_layout_matches_single_process_training(runs, controls, layout, family):
    """tp2: tensor parallelism with sequence parallelism on 2 processes; ddp and zero3: 2 data replicas."""
    result = torch.load(runs / f"{layout}-{family}.pt", weights_only=False)
    assert len(result["losses"]) == parity.STEPS
    parity.assert_parity(result, controls[family])
