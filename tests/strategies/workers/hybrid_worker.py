"""torchrun worker: 3-D parity runs — (dp, pp, tp) with ZeRO-1 and ZeRO-3 under 1F1B and Interleaved1F1B on a
4-block GPT (one block per virtual stage), an MoE GPT under dp=2 × pp=2 × ep=2, and strategy="3d" with no sizes
(the planner's layout) — for the world size it is launched with (4 or 8)."""

import sys

import torch
import torch.distributed as dist

import meshlight as ml
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig
from meshlight.nn import MoEConfig
from tests.strategies.parity import train

SCHEDULES = ("1f1b", "interleaved1f1b")


def gpt4(**config: object) -> LitGPT:
    config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=32, n_layers=4, bias=False,
                            **config)
    return LitGPT(config, lr=3e-3, warmup_steps=2)


def moe_gpt4() -> LitGPT:
    return gpt4(moe=MoEConfig(num_experts=4), moe_every=2)


MODELS = {"gpt4": gpt4, "moe": moe_gpt4}


def runs(world: int) -> list[tuple[int, int, int, int, int, str, str]]:
    """(dp, pp, tp, ep, zero, schedule, model) for this world size."""
    layouts = [(2, 2, 2)] if world == 8 else [(1, 2, 2), (2, 2, 1)]
    grid = [(dp, pp, tp, 1, zero, schedule, "gpt4") for dp, pp, tp in layouts for zero in (1, 3)
            for schedule in SCHEDULES]
    if world == 4:
        grid += [(2, 2, 1, 2, 1, "1f1b", "moe")]
    return grid


if __name__ == "__main__":
    out, world = sys.argv[1], int(sys.argv[2])
    results = {}
    for run in runs(world):
        dp, pp, tp, ep, zero, schedule, model = run
        # Two microbatches (one per stage) halve the run time against four; the schedules themselves are tested
        # with 4 and 8 in test_pipeline.py.
        strategy = ml.Hybrid3DStrategy(dp=dp, pp=pp, tp=tp, ep=ep, zero=zero, schedule=schedule, microbatches=2)
        result = train("adamw", strategy, devices=world, data_parallel=dp, model=MODELS[model])
        result.pop("module")
        results[run] = result
    if world == 4:  # no sizes: the planner chooses (and must keep 4 sequences per data replica)
        strategy = ml.Hybrid3DStrategy()
        result = train("adamw", strategy, devices=world, model=gpt4)
        result.pop("module")
        results["planned"] = {**result, "layout": strategy.layout.describe(), "plan": strategy.plan[0].describe()}
    if dist.get_rank() == 0:
        torch.save(results, out)
