"""The optimizer step the host takes under optimizer offload: torch's default for host tensors (its per-parameter
loop) against the fused host kernel meshlight gives the groups left to that default
(:func:`meshlight.parallel.offload.fuse_host_steps`), side by side in one process.

For each optimizer, ``--params`` parameters in 8 tensors with their gradients; seconds per step as the median over
``--rounds`` rounds of ``--steps`` steps, the two implementations alternating so that drift cancels; on one
thread (what each rank gets under torchrun's default ``OMP_NUM_THREADS=1``) and on every core of this machine.
Also the largest difference between the two implementations' parameters after the steps (rounding only).

    python benchmarks/host_step.py [--params 25000000] [--steps 5] [--rounds 3] [--optimizers AdamW ...]  # JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from lightning.fabric.utilities.data import _num_cpus_available

from meshlight.parallel.offload import fuse_host_steps

OPTIMIZERS = {
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1),
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "SGD momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "Adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-3),
}


def _parameters(count: int) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(count // 8)) for _ in range(8)]
    for param in params:
        param.grad = torch.randn_like(param)
    return params


def measure(name: str, count: int, steps: int, rounds: int) -> dict[str, Any]:
    """Seconds per step of ``name`` with torch's default and with the fused host kernel, and their difference."""
    params = {"default": _parameters(count), "fused": _parameters(count)}
    optimizers = {kind: OPTIMIZERS[name](p) for kind, p in params.items()}
    assert fuse_host_steps(optimizers["fused"]) == [0]
    for optimizer in optimizers.values():  # state allocated outside the timing
        optimizer.step()
    times: dict[str, list[float]] = {kind: [] for kind in optimizers}
    for _ in range(rounds):
        for kind, optimizer in optimizers.items():
            started = time.perf_counter()
            for _ in range(steps):
                optimizer.step()
            times[kind].append((time.perf_counter() - started) / steps)
    seconds = {kind: statistics.median(t) for kind, t in times.items()}
    difference = max((a - b).abs().max().item() for a, b in zip(params["default"], params["fused"]))
    return {"optimizer": name, "threads": torch.get_num_threads(), "default_seconds": seconds["default"],
            "fused_seconds": seconds["fused"], "fused_params_per_second": count / seconds["fused"],
            "speedup": seconds["default"] / seconds["fused"],
            "max_abs_difference": difference}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=25_000_000)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--optimizers", nargs="+", choices=list(OPTIMIZERS), default=list(OPTIMIZERS))
    args = parser.parse_args()
    cores = _num_cpus_available()
    rows = []
    for threads in sorted({1, cores}):
        torch.set_num_threads(threads)
        rows += [measure(name, args.params, args.steps, args.rounds) for name in args.optimizers]
    print(json.dumps({"params": args.params, "steps": args.steps, "rounds": args.rounds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
