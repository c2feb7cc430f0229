"""torchrun worker: pipeline parity runs — every schedule, pp = world (2 or 4), microbatches 4 and 8 (on 4: 8 for
two schedules; on 2, Interleaved1F1B with 4 virtual stages over 2, and with 2 a rank of a split naming uneven
stages) — and pp=2 × dp=2 (DDP, ZeRO-1/2/3; ZeRO-3 also over 4 virtual stages and 2 microbatches) on 4 processes. A
configuration the schedule cannot run is recorded with its error."""

import sys
from typing import Any

import torch
import torch.distributed as dist

import meshlight as ml
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig
from meshlight.parallel.pipeline import SCHEDULES, PipelineError
from tests.strategies.parity import train


def gpt8() -> LitGPT:
    # lr 3e-3: at 1e-2 Adam amplifies the rounding of a different gradient-accumulation order (LoopedBFS)
    # to ~4e-4 over 20 steps of this 8-block model; under SGD every schedule is within 3e-5 either way.
    config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=32, n_layers=8, bias=False)
    return LitGPT(config, lr=3e-3, warmup_steps=2)


#: the blocks where stages 2, 3 and 4 begin in the run with a split naming them
SPLIT = ("blocks.3", "blocks.5", "blocks.7")


def runs(world: int) -> list[tuple[Any, ...]]:
    """(pp, dp, zero, schedule, microbatches, variant[, virtual stages[, split]]) for this world size."""
    # microbatches 4 and 8 for every schedule on 2 stages; on 4 (a run costs about 2.5 of those on 2) 8 only where the
    # schedule needs them (DualPipeV: as many as stages, and its V of two stages per rank) or where its order over
    # 8 virtual stages differs most (InterleavedZeroBubble)
    grid = [(world, 1, 1, schedule, m, "adamw") for schedule in SCHEDULES for m in (4, 8)
            if world == 2 or m == 4 or schedule in ("dualpipev", "interleavedzerobubble")]
    if world == 2:  # Lightning's gradient accumulation, and clipping by the norm over both stages
        grid += [(2, 1, 1, "1f1b", 4, variant) for variant in ("accumulate", "clip")]
        # interleaving 4 virtual stages over 2 microbatches, fewer than pp·v (torch needs a multiple of pp)
        grid.append((2, 1, 1, "interleaved1f1b", 2, "adamw", 4))
        # stages of 3, 2, 2 and 1 blocks where a split names them: rank 0 runs 5 blocks, rank 1 3 and the head
        grid.append((2, 1, 1, "interleaved1f1b", 4, "adamw", 2, SPLIT))
    if world == 4:  # pp=2 × dp=2: ZeRO-1 (the default) under three schedules, DDP, ZeRO-2, ZeRO-3 under 1F1B
        grid += [(2, 2, 1, schedule, 4, "adamw") for schedule in ("1f1b", "interleaved1f1b", "zbvzerobubble")]
        grid += [(2, 2, zero, "1f1b", 4, "adamw") for zero in (0, 2, 3)]
        grid += [(2, 2, 1, "1f1b", 4, "clip")]
        grid.append((2, 2, 3, "interleaved1f1b", 2, "adamw", 4))  # ZeRO-3 over 4 virtual stages and 2 microbatches
    return grid


if __name__ == "__main__":
    out, world = sys.argv[1], int(sys.argv[2])
    results = {}
    for run in runs(world):
        pp, dp, zero, schedule, microbatches, variant, *stages = run
        strategy = ml.PipelineStrategy(pp=pp, schedule=schedule, microbatches=microbatches, zero=zero,
                                       virtual_stages=stages[0] if stages else None,
                                       split=list(stages[1]) if len(stages) > 1 else None)
        try:
            result = train(variant, strategy, devices=world, data_parallel=dp, model=gpt8)
            result.pop("module")
        except PipelineError as error:
            result = {"rejected": str(error)}
        results[run] = result
    if dist.get_rank() == 0:
        torch.save(results, out)
