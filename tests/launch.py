"""Run a script on several CPU processes with torchrun's environment, as a user would; pytest itself stays
single-process. (Lightning's own launcher re-executes ``sys.argv``, which inside pytest would re-run pytest.)

Ranks are forked by one fork server per test session (``tests/forkrun.py --serve``), which has imported torch,
Lightning and meshlight once: same environment variables, failure handling and exit status as ``torchrun
--standalone``, without ~4 s of imports per launch. Runs that need torchrun's restarts use torchrun itself.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
def benchmark_modules(*names: str) -> list[ModuleType]:
    """The scripts ``benchmarks/<name>.py`` as modules (with what they import from that folder at their top)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


ENVIRONMENT = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def torchrun(
    script: Path, nprocs: int, *args: str, timeout: float = 600, check: bool = True, max_restarts: int = 0
) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nprocs`` gloo processes (restarting them all up to ``max_restarts`` times when one
    fails, as ``torchrun --max-restarts`` does); on failure (when ``check``) fail with the tail of its output."""
    if max_restarts:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
            f"--max-restarts={max_restarts}", str(script), *args,
        ]
        result = subprocess.run(command, cwd=REPO, env={**os.environ, **ENVIRONMENT}, capture_output=True,
                                text=True, timeout=timeout)
    else:
        result = _FORK_SERVER.run(script, nprocs, list(args), timeout)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{script.name} on {nprocs} processes exited with {result.returncode}:\n"
            f"{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
        )
    return result


class ForkServer:
    """The session's ``tests/forkrun.py --serve`` process, started at the first launch."""

    def __init__(self) -> None:
        self.process: Optional[subprocess.Popen] = None
        self._buffer = b""

    def run(self, script: Path, nprocs: int, args: list[str], timeout: float) -> subprocess.CompletedProcess:
        server = self._server()
        command = ["forkrun", str(nprocs), str(script), *args]
        with tempfile.TemporaryDirectory() as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            request = {"nprocs": nprocs, "script": str(script), "args": args, "cwd": str(REPO),
                       "env": {**os.environ, **ENVIRONMENT}, "stdout": str(out), "stderr": str(err)}
            server.stdin.write((json.dumps(request) + "\n").encode())
            server.stdin.flush()
            launcher = self._answer(None)["pid"]
            answer = self._answer(timeout)
            if answer is None:  # kill the launch (launcher and ranks), then collect the server's answer
                os.killpg(launcher, signal.SIGKILL)
                self._answer(None)
                raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text())
            return subprocess.CompletedProcess(command, answer["returncode"], out.read_text(), err.read_text())

    def _server(self) -> subprocess.Popen:
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, str(REPO / "tests" / "forkrun.py"), "--serve"], cwd=REPO,
                env={**os.environ, **ENVIRONMENT}, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self._buffer = b""
            atexit.register(self.close)
        return self.process

    def _answer(self, timeout: Optional[float]) -> Optional[dict]:
        """The server's next answer line, or None after ``timeout`` seconds without one."""
        fd = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            if not select.select([fd], [], [], timeout)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the fork server exited with {self.process.wait()}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)


_FORK_SERVER = ForkServer()
