"""Run an example as a user would, from the repository root in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

from tests.launch import REPO


def run_command(command: list[str], env: Optional[dict[str, str]] = None,
                timeout: float = 300) -> subprocess.CompletedProcess:
    """The command's completed run; fails the test, with the end of its output, unless it exits 0."""
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})})
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def run_example(script: str, *args: str, env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``python examples/<script> <args>``."""
    return run_command([sys.executable, f"examples/{script}", *args], env)
