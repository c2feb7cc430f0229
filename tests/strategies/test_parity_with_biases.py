"""Parity with biases at the examples' learning rate: GPT with a bias in every Linear and norm (``GPTConfig``'s
default) under tp=2, pp=2 and ep=2 reproduces single-process training over 20 steps within 1e-4 (losses and final
weights), in fp32; in fp64 the same runs agree to about 1e-12. The key projections' biases are the exception, and
why: their gradient is exactly zero (softmax ignores what they add to a query's every score), so they hold rounding
noise that Adam scales up, different in every layout and never read by the model — about 1e-5 after 20 steps in
fp32, 1e-14 in fp64. They are compared in absolute value, and the trained model's output does not depend on them.
(3-D with biases: tests/strategies/test_hybrid.py.)"""

from pathlib import Path

import pytest
import torch

from tests.launch import torchrun
from tests.strategies.parity import GAUGE_WEIGHTS, assert_parity, train
from tests.strategies.workers import bias_worker

WORKER = Path(bias_worker.__file__)
RUNS = [(layout, dtype) for layout in bias_worker.LAYOUTS for dtype in bias_worker.DTYPES]


@pytest.fixture(scope="module")
def controls() -> dict:
    out = {}
    for layout, dtype in RUNS:
        result = train("adamw", model=bias_worker.model_factory(layout, dtype))
        out[(layout, dtype)] = result
    return out


@pytest.fixture(scope="module")
def distributed(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bias") / "2.pt"
    torchrun(WORKER, 2, str(out))
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("layout", list(bias_worker.LAYOUTS))
def test_biased_gpt_at_the_examples_learning_rate_matches_one_process(distributed, controls, layout):
    assert_parity(distributed[(layout, "fp32")], controls[(layout, "fp32")])


@pytest.mark.parametrize("layout", list(bias_worker.LAYOUTS))
def test_in_fp64_the_gap_shrinks_by_orders_of_magnitude(distributed, controls, layout):
    result, control = distributed[(layout, "fp64")], controls[(layout, "fp64")]
    for name, weight in control["weights"].items():
        if not name.endswith(GAUGE_WEIGHTS):
            error = (result["weights"][name] - weight).norm() / weight.norm().clamp_min(1e-12)
            assert error <= 1e-10, f"{name}: {error:.1e}"
    # (the pipeline broadcasts its logged losses as fp32: compared at fp32's resolution)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(control["losses"]),
                               rtol=1e-6 if layout == "pp2" else 1e-12, atol=0.0)


@pytest.mark.parametrize("layout", list(bias_worker.LAYOUTS))
def test_key_biases_hold_only_rounding_noise_that_the_model_never_reads(distributed, controls, layout):
    def largest_key_bias(weights: dict) -> float:
        return max(float(w.abs().max()) for name, w in weights.items() if name.endswith(GAUGE_WEIGHTS))

    fp32, fp64 = largest_key_bias(distributed[(layout, "fp32")]["weights"]), largest_key_bias(
        distributed[(layout, "fp64")]["weights"])
    assert 0 < fp32 < 1e-4 and fp64 < 1e-6 * fp32
    module = controls[(layout, "fp32")]["module"]
    tokens = torch.randint(0, 13, (4, 12))
    with torch.no_grad():
        before = module(tokens)
        for name, parameter in module.named_parameters():
            if name.endswith(GAUGE_WEIGHTS):
                parameter.fill_(1.0)  # far from the noise: the scores of each query shift alike
        after = module(tokens)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
