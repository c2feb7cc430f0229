"""examples/long_context.py splits each sequence of the copy task over cp=2 ranks and trains."""

import re

from tests.examples.run import run_example


def test_long_context_example_trains_with_each_sequence_over_two_ranks(tmp_path):
    result = run_example("long_context.py", "--seq-len", "64", "--max-steps", "20", "--val-every", "10",
                         "--dim", "32", "--out", str(tmp_path))
    match = re.search(r"Trained 20 steps of 64-token sequences .*cp=2, each rank holding 32 tokens of a sequence\):"
                      r" train/loss ([\d.]+), val/loss ([\d.]+), copy accuracy", result.stdout, re.S)
    assert match, result.stdout[-2000:]
    assert float(match[2]) < 4.5  # ln(63) = 4.14 is the guess of a model that learned nothing
