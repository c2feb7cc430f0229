"""A script started as users start one (no torchrun, devices=2): on this CPU machine meshlight forks the second
rank from the first at `fit` instead of re-running the script (meshlight/strategies/launcher.py). The forked
job trains bit for bit as Lightning's re-run launcher does, and a rank that fails ends the whole job."""

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.launch import REPO

WORKER = Path(__file__).parent / "workers" / "launch_worker.py"


def _run(mode: str, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WORKER), mode], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), **env})


def _ranks(result: subprocess.CompletedProcess) -> dict[str, str]:
    assert result.returncode == 0, result.stderr[-4000:]
    return dict(re.findall(r"^rank (\d/2 local \d) in process \d+: (.*)$", result.stdout, re.MULTILINE))


def test_forked_ranks_train_exactly_as_re_run_ranks():
    # (one thread per rank, as Lightning's share of this node's cores sets it where OMP_NUM_THREADS is unset; a test
    # before may have left another in pytest's environment, which test_a_script_that_started_other_threads… covers)
    forked, re_run = _run("ok", MESHLIGHT_FORK="1", OMP_NUM_THREADS="1"), _run("ok", MESHLIGHT_FORK="0",
                                                                              OMP_NUM_THREADS="1")
    assert forked.stdout.count("script start") == 1  # the second rank inherited the script's start
    assert re_run.stdout.count("script start") == 2  # Lightning's launcher ran the script again
    ranks = _ranks(forked)
    assert sorted(ranks) == ["0/2 local 0", "1/2 local 1"]
    assert ranks["0/2 local 0"].endswith("LOCAL_RANK=0") and ranks["1/2 local 1"].endswith("LOCAL_RANK=1")
    weights = {text.split(" env")[0] for text in ranks.values()}
    assert len(weights) == 1  # data-parallel replicas agree
    assert _ranks(re_run) == ranks  # and equal, bit for bit, those of a re-run rank (one thread per rank in both)


def test_a_failing_forked_rank_ends_the_job():
    result = _run("fail", MESHLIGHT_FORK="1", OMP_NUM_THREADS="1")
    assert result.returncode != 0
    assert "rank 1 fails on purpose" in result.stderr


def test_a_script_that_started_other_threads_is_re_run_not_forked():
    """An OpenMP pool's worker thread (not a Python thread) exists once the script ran an op on two threads: a
    forked rank would lack it while its OpenMP runtime counts on it (a rank forked so once hung in its first
    parallel region), so the second rank is started as Lightning starts it, by re-running the script."""
    result = _run("threads", timeout=120, MESHLIGHT_FORK="1", OMP_NUM_THREADS="2")
    assert result.stdout.count("script start") == 2
    assert sorted(_ranks(result)) == ["0/2 local 0", "1/2 local 1"]
