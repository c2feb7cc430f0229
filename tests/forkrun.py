"""Run a script on N ranks the way ``torchrun --standalone`` does, from one interpreter that has already
imported torch, Lightning and meshlight and forks the ranks.

Each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``,
``TORCHELASTIC_RUN_ID``, … — Lightning detects a torchelastic launch, as under torchrun) and runs the script as
``__main__`` with its arguments; as with torchrun, the first rank to fail has the others terminated, and the exit
status is 0 only when every rank succeeded. What it saves: each rank's ~4 s of imports (torch, Lightning —
which imports Dynamo — and meshlight), a third to a half of a short multi-process test on this 2-core machine.
Restarts (``--max-restarts``) are not handled here: tests that need them run the real torchrun.

    python tests/forkrun.py NPROCS SCRIPT [ARGS...]
    python tests/forkrun.py --serve      # a fork server: one launch per request, without importing again

The fork server (what ``tests/launch.py`` uses) imports once for the whole test session and reads one JSON
request per line on stdin — ``{"nprocs", "script", "args", "env", "cwd", "stdout", "stderr"}`` — forks a launcher
for it (its own process group, its output to the files named, the environment given) and answers two lines on
stdout: ``{"pid": …}`` at once, ``{"returncode": …}`` when the launch is over. It never computes anything
itself, so no thread pool exists when it forks.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import json
import os
import runpy
import signal
import socket
import sys
import time
import uuid

PRELOAD = ("torch", "torch.distributed.pipelining", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.tensor.parallel", "lightning.pytorch", "torchmetrics", "meshlight")
#: imported too where installed (the extras): what the Hugging Face workers' ranks would each import (peft ~0.4 s)
PRELOAD_IF_INSTALLED = ("transformers", "peft")


def main() -> int:
    _preload()
    if sys.argv[1] == "--serve":
        return serve()
    return launch(int(sys.argv[1]), os.path.abspath(sys.argv[2]), sys.argv[3:])


def _preload() -> None:
    import importlib
    import importlib.util

    for name in PRELOAD:  # before any thread exists: forking then is safe
        importlib.import_module(name)
    for name in PRELOAD_IF_INSTALLED:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)


def launch(nprocs: int, script: str, args: list[str]) -> int:
    """Fork ``nprocs`` ranks running ``script`` with torchrun's environment; the job's exit status."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(nprocs), "TORCHELASTIC_RUN_ID": uuid.uuid4().hex, "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    })
    sys.stdout.flush()
    sys.stderr.flush()
    children = {}
    for rank in range(nprocs):
        pid = os.fork()
        if pid == 0:
            sys.exit(_rank(rank, script, args))  # unwinds out of main(): the child exits as a script would
        children[pid] = rank
    return _supervise(children)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _rank(rank: int, script: str, args: list[str]) -> int:
    """Run ``script`` as rank ``rank`` in this (forked) process; its exit status."""
    _die_with_parent()  # a test's timeout kills the launcher
    faulthandler.enable(all_threads=True)  # a rank that aborts (a C++ exception, a failed assertion) says where
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)})
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports an uncaught exception
        sys.excepthook(*sys.exc_info())  # torch.distributed's hook prefixes each line with "[rank<r>]: "
        code = 1
    return code


def _supervise(children: dict[int, int]) -> int:
    """Wait for every rank (``children``: pid -> rank); once one fails, say which and how on stderr (a rank killed by
    a signal prints no traceback) and terminate the others (SIGTERM, then SIGKILL after 30 s)."""
    failed, deadline = False, None
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if deadline is not None and time.monotonic() > deadline:
                for other in children:
                    os.kill(other, signal.SIGKILL)
                deadline = None
            time.sleep(0.05)
            continue
        if pid not in children:
            continue
        rank = children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
            print(f"forkrun: rank {rank} {how} first; stopping the others", file=sys.stderr, flush=True)
            failed, deadline = True, time.monotonic() + 30
            for other in children:
                os.kill(other, signal.SIGTERM)
    return 1 if failed else 0


def serve() -> int:
    """Answer launch requests from stdin until it closes (see the module docstring)."""
    # What the imports made lives as long as the test session: out of the collector's sight, full collections in
    # the ranks skip it, and the forked ranks do not touch (and copy) its memory pages by traversing it. (Only
    # here: a single launch, as benchmarks make them, keeps the collector as a user's process has it.)
    gc.freeze()
    answers = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os._exit(_launch_request(request, answers))
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()
    return 0


def _launch_request(request: dict, answers: object) -> int:
    """In the server's forked child: become the launcher of one request."""
    code, launcher = 1, os.getpid()
    try:
        os.setpgrp()  # the client kills the whole launch (this launcher and its ranks) on a timeout
        _die_with_parent()
        answers.close()  # type: ignore[attr-defined]
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        code = launch(request["nprocs"], os.path.abspath(request["script"]), request["args"])
    except SystemExit:
        if os.getpid() != launcher:
            raise  # a rank, leaving launch() through sys.exit: it exits as a script does (atexit handlers run)
    except BaseException:  # noqa: BLE001 - report in the launch's stderr
        import traceback

        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
