"""Tests that train in the pytest process itself (one CPU process) leave no process group or rendezvous
variables behind: a later subprocess would inherit MASTER_PORT and find the port still held (EADDRINUSE).
Restored to the values of the session's start, since module-scoped fixtures train before a test's setup.
``one_process_group``: a gloo group of this one process, for DTensors on a mesh of one rank."""

import os
import socket

import pytest
import torch.distributed as dist

RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")
AT_START = {name: os.environ.get(name) for name in RENDEZVOUS}


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    for name, value in AT_START.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def one_process_group() -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
