"""Run a script on several CPU processes with torchrun's environment, as a user would; pytest itself stays
single-process. (Lightning's own launcher re-executes ``sys.argv``, which inside pytest would re-run pytest.)

Ranks are forked from one interpreter that has imported torch, Lightning and meshlight already
(``tests/forkrun.py``: same environment variables, failure handling and exit status as ``torchrun
--standalone``), which saves each rank's imports; runs that need torchrun's restarts use torchrun itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def torchrun(
    script: Path, nprocs: int, *args: str, timeout: float = 600, check: bool = True, max_restarts: int = 0
) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nprocs`` gloo processes (restarting them all up to ``max_restarts`` times when one
    fails, as ``torchrun --max-restarts`` does); on failure (when ``check``) fail with the tail of its output."""
    command = [sys.executable, str(REPO / "tests" / "forkrun.py"), str(nprocs), str(script), *args]
    if max_restarts:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
            f"--max-restarts={max_restarts}", str(script), *args,
        ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{script.name} on {nprocs} processes exited with {result.returncode}:\n"
            f"{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
        )
    return result
