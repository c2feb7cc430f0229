"""How meshlight starts the processes of one node when nothing else did (no torchrun, SLURM or other launcher).

Lightning's script launcher re-runs the user's script in a fresh interpreter per extra rank: every rank imports
torch and Lightning again (~4 s of CPU each, most of a short CPU run's start-up) and re-runs the script up to
``fit``. On CPU under Linux meshlight forks those ranks instead, from the process that calls ``fit``, at the
moment Lightning would have started them: same environment variables, same supervision (a rank that fails has
the others terminated), and each rank then runs the rest of the script exactly as a re-run script would. What a
forked rank does not repeat is the script's code before ``fit``: it inherits its results — the model, the data,
the seeded random state — as rank 0 computed them.

Forking is unsafe once other threads or an accelerator runtime exist, so it happens only when neither does (an OpenMP
pool's native threads are let be where the ranks run on one thread each, Lightning's share of a small node's cores,
which never asks for them); else, and off Linux, on GPUs or under Hydra, Lightning's own launcher runs unchanged.
``MESHLIGHT_FORK=0`` turns it off.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Optional

import torch
from lightning.fabric.plugins import ClusterEnvironment
from typing_extensions import override

from meshlight.strategies.lightning_internals import ScriptLauncher, set_num_threads_if_needed

__all__ = ["ForkingScriptLauncher"]


class ForkingScriptLauncher(ScriptLauncher):
    """Lightning's script launcher, forking the extra ranks of a CPU node instead of re-running the script."""

    def __init__(self, cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int,
                 device: torch.device, set_ranks: Callable[[], None]) -> None:
        """``set_ranks`` re-reads a forked rank's identity (``LOCAL_RANK``) into the strategy."""
        super().__init__(cluster_environment, num_processes, num_nodes)
        self._device, self._set_ranks = device, set_ranks

    @override
    def start_children(self) -> None:
        # One node's ranks share its cores: before they exist, so that every rank inherits it (Lightning's launcher
        # sets it after starting them, in rank 0 only — each re-run rank then used every core).
        set_num_threads_if_needed(self.num_processes)
        if not self._can_fork():
            self.rerun_script_in_children()
            return
        self.check_can_start_children()
        env = self.cluster_environment
        os.environ.update({
            "MASTER_ADDR": env.main_address, "MASTER_PORT": str(env.main_port), "NODE_RANK": str(env.node_rank()),
            "LOCAL_RANK": "0", "WORLD_SIZE": str(self.num_processes * self.num_nodes),
        })
        sys.stdout.flush()  # else what is buffered now would be printed once more by every rank
        sys.stderr.flush()
        self.procs = []
        for local_rank in range(1, self.num_processes):
            pid = os.fork()
            if pid == 0:  # the new rank: continue into `fit` as this rank, supervising nobody
                os.environ["LOCAL_RANK"] = str(local_rank)
                self.procs = []
                self._set_ranks()
                return
            self.procs.append(_ForkedRank(pid))

    def _can_fork(self) -> bool:
        return (
            sys.platform == "linux"
            and os.environ.get("MESHLIGHT_FORK", "1") != "0"
            and self._device.type == "cpu"
            and not torch.cuda.is_initialized()
            and threading.active_count() == 1
            and (torch.get_num_threads() == 1 or _native_threads() == 1)
            and not _hydra_in_use()
        )


def _native_threads() -> int:
    """The threads this process runs (Linux), native ones too: an OpenMP pool's workers, which a forked child lacks
    while its OpenMP runtime still counts on them — its first parallel region on more than one thread waits for them
    forever (a child running on one thread never asks for them)."""
    return len(os.listdir("/proc/self/task"))


class _ForkedRank:
    """A forked rank, with the part of :class:`subprocess.Popen` that Lightning's launcher and its watchdog use."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _hydra_in_use() -> bool:
    hydra = sys.modules.get("hydra.core.hydra_config")
    return hydra is not None and hydra.HydraConfig.initialized()
