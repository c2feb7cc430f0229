"""examples/train_moe.py trains a mixture-of-experts GPT with its experts split over ep=2 and reports the worst
layer's expert load from the ExpertLoadMonitor meshlight.Trainer adds."""

import re

from tests.examples.run import run_example


def test_moe_example_trains_over_two_expert_parallel_ranks(tmp_path):
    result = run_example("train_moe.py", "--max-steps", "20", "--val-every", "10", "--dim", "32",
                         "--batch-size", "16", "--out", str(tmp_path))
    assert "ep=2" in result.stdout
    match = re.search(r"Trained 20 steps .*val/loss ([\d.]+).*worst layer (\S+) (\d+\.\d+)", result.stdout, re.S)
    assert match, result.stdout[-2000:]
    assert float(match[1]) < 2.77  # below ln(16): it learned something
    assert 1.0 <= float(match[3]) < 8.0  # max/mean of 8 experts' loads
    assert (tmp_path / "lightning_logs" / "version_0").is_dir()
