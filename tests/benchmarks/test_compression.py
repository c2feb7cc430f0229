"""Compression as benchmarks/compression.py measures it for RESULTS.md: bf16 gradient reductions move at most 0.52× the
uncompressed bytes under ddp, zero2 and zero3, with and without gradient accumulation, and leave the weight all-gathers
unchanged; PowerSGD at rank 4 moves at most 0.1× on a model whose layers are 128 wide; saved activations in bf16 take
at most 0.55× the bytes."""

import json
import subprocess
import sys

import pytest

from tests.launch import REPO


@pytest.fixture(scope="module")
def measured() -> dict:
    done = subprocess.run([sys.executable, "benchmarks/compression.py", "--sections", "traffic", "activations"],
                          cwd=REPO, check=True, capture_output=True, text=True, timeout=900)
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def traffic(measured) -> list[dict]:
    return measured["traffic"]


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


def test_saved_activations_in_bf16_take_at_most_055_of_the_bytes(measured):
    ratios = {row["dtype"]: row["ratio"] for row in measured["activations"]}
    assert ratios["bf16"] <= 0.55 and ratios["fp8_e4m3"] <= 0.3, ratios  # outside the blocks stays fp32
