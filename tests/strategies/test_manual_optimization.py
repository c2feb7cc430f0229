"""Manual optimization (``automatic_optimization=False``) under tensor parallelism, expert parallelism and 3-D
reproduces single-process automatic training within 1e-4; under pipeline parallelism, which runs backward inside its
schedule, it is refused, saying what to use. (Under ddp and ZeRO-1–3: tests/strategies/test_lightning_compat.py.)"""

from pathlib import Path

import pytest
import torch

from tests.launch import torchrun
from tests.strategies.parity import assert_parity, train
from tests.strategies.workers import manual_worker


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("manual") / "runs.pt"
    torchrun(Path(manual_worker.__file__), manual_worker.WORLD, str(out), check=False, timeout=900)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("name", list(manual_worker.RUNS))
def test_manual_optimization_matches_single_process_automatic_training(runs, name):
    moe = manual_worker.RUNS[name][2]
    control = train("adamw", model=lambda: manual_worker.model(moe))  # automatic optimization
    assert_parity(runs[name], control)


def test_manual_optimization_under_pipelining_is_refused_saying_what_to_use(runs):
    assert runs["pipeline"].startswith("PipelineError: Pipeline parallelism runs forward and backward inside the"
                                       " schedule")
    assert "Use automatic optimization" in runs["pipeline"]
