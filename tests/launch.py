"""Run a script on several CPU processes with torchrun's environment, as a user would; pytest itself stays
single-process. (Lightning's own launcher re-executes ``sys.argv``, which inside pytest would re-run pytest.)

Ranks are forked by one fork server per test session (``tests/forkrun.py --serve``), which has imported torch,
Lightning and meshlight once: same environment variables, failure handling and exit status as ``torchrun
--standalone``, without ~4 s of imports per launch. Runs that need torchrun's restarts use torchrun itself.

A test module's launches can run on a thread of their own (:func:`in_background`) while the session computes their
single-process controls: two ranks on this 2-core machine leave about a quarter of it idle, waiting on each other
(measured: 147% of 200% CPU for Hugging Face models under tp=2). Launches are made one at a time, whichever thread
asks.
"""

from __future__ import annotations

import atexit
import importlib
import itertools
import json
import math
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, TypeVar

T = TypeVar("T")

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
    fails, as ``torchrun --max-restarts`` does); on failure (when ``check``) fail with the tail of its output. One
    launch at a time: a second thread's call waits for the first's to end."""
    with _ONE_LAUNCH:
        result = _launch(script, nprocs, list(args), timeout, max_restarts)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{script.name} on {nprocs} processes exited with {result.returncode}:\n{_first_errors(result.stderr)}\n"
            f"{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
        )
    return result


def results_of(worker: ModuleType, nprocs: int, folder: Path, *args: str, timeout: float = 600) -> Any:
    """What ``worker`` (a worker module whose first argument names the file its rank 0 saves its results to) saved
    when run on ``nprocs`` processes: the file is in ``folder``; ``args`` follow it."""
    import torch

    out = folder / "results.pt"
    torchrun(Path(worker.__file__), nprocs, str(out), *args, timeout=timeout)
    return torch.load(out, weights_only=False)


def _first_errors(stderr: str) -> str:
    """What a failed launch's ranks said first that the tails may have cut: the supervisor's line naming the rank
    that failed first; each rank's first exception (torch.distributed prefixes a rank's traceback with
    ``[rank<r>]:`` once its process group exists; the first exception printed is the cause of any chained after
    it); and what a rank that aborted printed, which names no rank: C++'s ``terminate called …`` and ``what(): …``
    lines, and the first Python stacks ``faulthandler`` dumped (forkrun enables it in every rank)."""
    first: dict[float, str] = {}  # the supervisor's line first, then by rank, a traceback of no rank's last
    aborted: list[str] = []
    dump: list[str] = []
    lines = stderr.splitlines()
    for index, line in enumerate(lines):
        if line.startswith("forkrun: "):
            first.setdefault(-1, line)
        elif line.startswith(("terminate called", "  what(): ")) and line not in aborted:
            aborted.append(line)
        elif line.startswith("Fatal Python error: ") and not dump:
            dump = list(itertools.takewhile(lambda text: not text.startswith("Extension modules:"),
                                            filter(str.strip, lines[index:index + 80])))[:40]
        elif match := re.match(r"(?:\[rank(\d+)\]: )?([\w.]+(?:Error|Exception|Interrupt)\b.*)", line):
            rank = int(match[1]) if match[1] else math.inf
            first.setdefault(rank, f"rank {match[1] or '?'}: {match[2]}")
    return "\n".join([first[rank] for rank in sorted(first)] + aborted + dump)


def in_background(launches: Callable[[], T]) -> Future[T]:
    """Start ``launches`` (a function making :func:`torchrun` launches) on the launching thread and return at once;
    the future's ``result()`` waits for it (and raises what it raised). A module's ``runs`` fixture asks for its
    ``controls`` after starting its launches this way, so one process trains the controls beside the ranks. The
    launches get the environment of now: the session's thread may change ``os.environ`` meanwhile (Lightning's
    seeding does)."""
    environment = dict(os.environ)

    def launch() -> T:
        _LAUNCHING.environment = environment
        return launches()

    return _LAUNCHER.submit(launch)


def _launch(script: Path, nprocs: int, args: list[str], timeout: float,
            max_restarts: int) -> subprocess.CompletedProcess:
    env = {**getattr(_LAUNCHING, "environment", os.environ), **ENVIRONMENT}
    if max_restarts:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
            f"--max-restarts={max_restarts}", str(script), *args,
        ]
        return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return _FORK_SERVER.run(script, nprocs, args, timeout, env)


class ForkServer:
    """The session's ``tests/forkrun.py --serve`` process, started at the first launch."""

    def __init__(self) -> None:
        self.process: Optional[subprocess.Popen] = None
        self._buffer = b""

    def run(self, script: Path, nprocs: int, args: list[str], timeout: float,
            env: dict[str, str]) -> subprocess.CompletedProcess:
        server = self._server(env)
        command = ["forkrun", str(nprocs), str(script), *args]
        with tempfile.TemporaryDirectory() as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            request = {"nprocs": nprocs, "script": str(script), "args": args, "cwd": str(REPO),
                       "env": env, "stdout": str(out), "stderr": str(err)}
            server.stdin.write((json.dumps(request) + "\n").encode())
            server.stdin.flush()
            launcher = self._answer(None)["pid"]
            answer = self._answer(timeout)
            if answer is None:  # kill the launch (launcher and ranks), then collect the server's answer
                os.killpg(launcher, signal.SIGKILL)
                self._answer(None)
                raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text())
            return subprocess.CompletedProcess(command, answer["returncode"], out.read_text(), err.read_text())

    def _server(self, env: dict[str, str]) -> subprocess.Popen:
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, str(REPO / "tests" / "forkrun.py"), "--serve"], cwd=REPO,
                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
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
_ONE_LAUNCH = threading.Lock()
_LAUNCHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="launches")
_LAUNCHING = threading.local()  # on the launching thread: the environment in_background was called with
