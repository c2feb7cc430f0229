"""Context parallelism's memory as benchmarks/context_parallel.py measures it for RESULTS.md: on a GQA model
(kv heads = heads / 4) the bytes autograd saves per rank at cp=4 are at most 0.35× those of the whole sequence on one
rank; the gathered K/V backward keeps are counted among them."""

import json
import subprocess
import sys

from tests.launch import REPO, benchmark_modules


def test_cp4_saves_at_most_035_of_the_whole_sequences_bytes_per_rank():
    done = subprocess.run([sys.executable, "benchmarks/context_parallel.py", "--nprocs", "4"], cwd=REPO, check=True,
                          capture_output=True, text=True, timeout=600)
    (row,) = json.loads(done.stdout)["memory"]
    assert row["cp"] == 4 and row["seq"] == 1024 and row["model"]["n_heads"] == 4 * row["model"]["n_kv_heads"]
    # balanced: every rank keeps about the same (rank 0's first chunk attends to itself alone: a plain causal mask)
    assert max(row["cp_bytes_per_rank"]) <= 1.01 * min(row["cp_bytes_per_rank"])
    assert row["ratio"] <= 0.35
    # each layer keeps the whole sequence's K and V at the kv heads: 4 layers × 2 × 2 sequences × 2 heads × 1024 × 32
    assert row["kv_bytes"] == 4 * 2 * 2 * 2 * 1024 * 32 * 4


def test_the_recorded_cuda_run_matched_the_whole_sequence_with_both_attention_methods():
    # benchmarks/gpu_context_parallel.json: what `benchmarks/context_parallel.py --gpu` printed on a lent H200
    run_all, common = benchmark_modules("run_all", "common")

    recorded = json.loads(common.GPU_CONTEXT.read_text())["gpu"]
    for method in ("allgather", "ring"):
        compared = recorded[f"{method}_vs_whole"]
        assert compared["loss_rel"] <= 1e-5 and compared["grad_norm_rel"] <= 1e-5
    section = run_all.context_section({"memory": []}, {"gpu": recorded})
    assert "| allgather | 0.0e+00 | 0.0e+00 |" in section and "| ring |" in section
