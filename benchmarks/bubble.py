"""Pipeline bubble per schedule: the fraction of a training step a rank is not computing a stage.

Measured from instrumentation around stage compute (``forward_one_chunk``, ``backward_one_chunk``,
``backward_weight_one_chunk`` of each ``PipelineStage``): bubble = 1 − busy time / step time, averaged over
ranks, median over 3 steps after a warm-up; a step ends when every rank is done (as the optimizer step
waits for the last). Stages come from meshlight's splitter (an 8-block chain model)
and schedules from meshlight's builder.

Compute is simulated: each block sleeps 4 ms forward, 4 ms for the input gradient and 4 ms for the weight
gradient (a function on the weight, so zero-bubble schedules can defer it), per microbatch. Four processes
on two cores then behave like four devices, and the bubble measures the schedule, not CPU contention.

Theory (bubble as a fraction of step time, p ranks, m microbatches, v stages per rank): GPipe and 1F1B
(p−1)/(m+p−1); Interleaved1F1B (p−1)/(v·m+p−1). Zero-bubble schedules should sit below 1F1B.

    python benchmarks/bubble.py [--nprocs 2 4] [--microbatches 4 8 16]      # prints JSON
"""

from __future__ import annotations

import argparse
import json

from common import is_worker, launch, report

BLOCKS = 8
SECONDS = 0.004  # per block and microbatch, for each of forward, input gradient, weight gradient


def theory(schedule: str, p: int, m: int, v: int) -> float | None:
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved1f1b":
        return (p - 1) / (v * m + p - 1)
    return None


def worker(microbatch_counts: list[int]) -> None:
    import statistics
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    from meshlight.parallel.pipeline import (
        SCHEDULES,
        SINGLE_STAGE,
        PipelineError,
        build_schedule,
        plan_stages,
        split_stages,
        stages_of_rank,
    )

    class Busy(torch.autograd.Function):
        """Identity that takes ``SECONDS`` forward and again for the gradient of its input."""

        @staticmethod
        def forward(ctx, x):  # noqa: ANN001, ANN205
            time.sleep(SECONDS)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001, ANN205
            time.sleep(SECONDS)
            return grad

    class BusyWeightGradient(torch.autograd.Function):
        """Identity on a weight whose gradient takes ``SECONDS``."""

        @staticmethod
        def forward(ctx, weight):  # noqa: ANN001, ANN205
            return weight.view_as(weight)

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001, ANN205
            time.sleep(SECONDS)
            return grad

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.eye(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Busy.apply(x @ BusyWeightGradient.apply(self.weight))

    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    dist.init_process_group("gloo")
    p, rank = dist.get_world_size(), dist.get_rank()
    results = []
    for schedule in SCHEDULES:
        v = 1 if schedule in SINGLE_STAGE else 2
        for m in microbatch_counts:
            model = Chain()
            plan = plan_stages(model, "blocks", p * v, "layers")
            indices = stages_of_rank(rank, p, v, schedule)
            stages = [PipelineStage(module, i, p * v, torch.device("cpu"))
                      for module, i in zip(split_stages(model, plan, indices), indices)]
            busy = [0.0]
            for stage in stages:
                for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                    setattr(stage, name, _timed(getattr(stage, name), busy))
            try:
                runner = build_schedule(stages, schedule, m, lambda out, target: out.sum())
            except PipelineError as error:
                results.append({"schedule": schedule, "p": p, "m": m, "v": v, "skipped": str(error)})
                continue
            fractions, step_times = [], []
            for step in range(4):
                busy[0] = 0.0
                dist.barrier()
                start = time.perf_counter()
                inputs = (torch.ones(m, 8, requires_grad=False),) if 0 in indices else ()
                runner.step(*inputs, target=torch.zeros(m) if p * v - 1 in indices else None)
                dist.barrier()  # the step ends when the last rank is done: the optimizer step waits for it
                elapsed = time.perf_counter() - start
                if step:
                    fractions.append(1 - busy[0] / elapsed)
                    step_times.append(elapsed)
            mine = torch.tensor([statistics.median(fractions), statistics.median(step_times)])
            dist.all_reduce(mine)
            bubble, step_seconds = (mine / p).tolist()
            results.append({"schedule": schedule, "p": p, "m": m, "v": v, "bubble": bubble,
                            "theory": theory(schedule, p, m, v), "step_seconds": step_seconds})
    report(results)
    dist.destroy_process_group()


def _timed(method, busy):  # noqa: ANN001, ANN202 - wraps a stage method, adding its duration to busy[0]
    import time

    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            busy[0] += time.perf_counter() - start

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    args = parser.parse_args()
    counts = [str(m) for m in args.microbatches]
    print(json.dumps([row for n in args.nprocs for row in launch(__file__, n, *counts)], indent=1))


if __name__ == "__main__":
    import sys

    worker([int(m) for m in sys.argv[1:]]) if is_worker() else main()
