"""The traffic of compressed gradient reductions, as benchmarks/compression.py measures it for RESULTS.md: bf16
reductions move at most 0.52× the uncompressed bytes under ddp, zero2 and zero3, with and without gradient
accumulation, and leave the weight all-gathers unchanged; PowerSGD at rank 4 moves at most 0.1× on a model whose
layers are 128 wide."""

import json
import subprocess
import sys

import pytest

from tests.launch import REPO


@pytest.fixture(scope="module")
def traffic() -> list[dict]:
    done = subprocess.run([sys.executable, "benchmarks/compression.py", "--sections", "traffic"], cwd=REPO,
                          check=True, capture_output=True, text=True, timeout=900)
    return json.loads(done.stdout)["traffic"]


def test_every_layout_and_accumulation_is_measured(traffic):
    measured = {(row["strategy"], row["micro_batches"], row["compression"]) for row in traffic}
    assert measured == {(s, a, "bf16") for s in ("ddp", "zero2", "zero3") for a in (1, 2)} | {
        ("ddp", 1, "powersgd"), ("ddp", 2, "powersgd")}


def test_bf16_reductions_move_half_the_bytes_and_the_gathers_are_unchanged(traffic):
    for row in (row for row in traffic if row["compression"] == "bf16"):
        assert row["reduction_ratio"] <= 0.52, row
        assert row["gather_bytes"] == row["uncompressed_gather_bytes"], row
    # ZeRO-3's all-gathers are then most of the step's bytes: they are not compressed
    assert all(row["gather_share"] > 0.75 for row in traffic if row["strategy"] == "zero3")


def test_powersgd_at_rank_4_moves_a_tenth_at_most(traffic):
    for row in (row for row in traffic if row["compression"] == "powersgd"):
        assert 0 < row["reduction_ratio"] <= 0.1, row
