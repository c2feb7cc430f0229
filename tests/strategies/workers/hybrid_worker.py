"""torchrun worker: 3-D parity runs — (dp, pp, tp) with ZeRO-1 and ZeRO-3 and under 1F1B and Interleaved1F1B on a
4-block GPT (one block per virtual stage; each layout in two runs that cover both stages and both schedules; on 8
processes the GPT with biases, ZeRO-1 and interleaved, and the MoE GPT's runs, ZeRO-3 and 1F1B among them), an MoE GPT
under dp=2 × pp=2 × ep=2, and strategy="3d" with no sizes (the planner's layout) — for the world size it is launched
with (4 or 8); on 4 also torchmetrics under pp=2 × tp=2, and under pp=2 × tp=2 with sequence parallelism models whose
forward reads the sequence length from its input on every stage (rotary tables: the GPT with rotary positions, the
user-written Llama, here with a gate Linear that tensor parallelism leaves whole); and a 4-block grouped-query Llama
whose attention keeps only ``head_dim`` (its head counts read from the projections' widths, by the planner as by
tensor parallelism) under pp=2 × tp=2 (ZeRO-3, 1F1B), ep left to the planner; on 8 also the GPT with biases
(GPTConfig's default) at the examples' learning rate, and an 8-expert MoE GPT under dp=2 × pp=2 × tp=2 × ep=2 with
every routing (top-1, top-2, dropless, capacity), its experts split over tp and folded."""

import functools
import sys
import warnings
from typing import Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torchmetrics
from torch.nn import functional as F

import meshlight as ml
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig
from meshlight.nn import MoEConfig
from tests.strategies.llama import LitLlama
from tests.strategies.parity import WITHOUT_EXPERT_BIAS, Recorder, train
from tests.strategies.workers import moe_worker


def gpt4_config(**config: object) -> GPTConfig:
    return GPTConfig.tiny(**{"vocab_size": AdditionDataModule.vocab_size, "max_seq_len": 12, "dim": 32, "n_layers": 4,
                             "bias": False, **config})


def gpt4(**config: object) -> LitGPT:
    return LitGPT(gpt4_config(**config), lr=3e-3, warmup_steps=2)


def moe_gpt4() -> LitGPT:
    return gpt4(moe=MoEConfig(num_experts=4, **WITHOUT_EXPERT_BIAS), moe_every=2)


MODELS = {"gpt4": gpt4, "moe": moe_gpt4, "gpt4-rotary": functools.partial(gpt4, positions="rotary"),
          "llama-gated": functools.partial(LitLlama, gated=True),
          "llama-outside": functools.partial(LitLlama, outside=True),
          "llama-head-dim": functools.partial(LitLlama, head_dim_only=True, layers=4),
          # a vocabulary tp=2 does not divide, the embedding tied to the head across the first and last stage
          "gpt4-tied-vocab61": functools.partial(gpt4, vocab_size=61, tie_embeddings=True),
          # a bias in every Linear and norm (GPTConfig's default), at the examples' learning rate
          "gpt4-bias": functools.partial(gpt4, bias=True),
          # GPT-tiny with 8 experts per block: each routing, dropless and with a capacity factor
          **{f"moe8-{routing}": moe_worker.factory(routing) for routing in moe_worker.ROUTINGS}}


class Counting(LitGPT):
    """LitGPT that also counts the validation sequences it sees with a SumMetric, and whose training loss is
    plain ``F.cross_entropy``, as users write it: under loss parallelism a DTensor, logged and returned as is."""

    def __init__(self) -> None:
        super().__init__(gpt4_config())
        self.sequences = torchmetrics.SumMetric()

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = F.cross_entropy(self(inputs).flatten(0, -2).float(), targets.flatten())
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        self.sequences(torch.tensor(float(len(batch[0]))))
        self.log("val/sequences", self.sequences)


def validation_metrics() -> list[dict[str, object]]:
    """Per rank, under dp=1 × pp=2 × tp=2: the validation metrics logged for 32 sequences (a count and the answer
    accuracy), the torchmetrics warnings seen and the training losses of two steps."""
    pl.seed_everything(0, verbose=False)
    data = AdditionDataModule(3, batch_size=8, train_size=16, val_size=32)
    trainer = ml.Trainer(strategy=ml.Hybrid3DStrategy(dp=1, pp=2, tp=2, microbatches=2), devices=4,
                         accelerator="cpu", max_steps=2, val_check_interval=2, check_val_every_n_epoch=None,
                         num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    recorder = Recorder()
    trainer.callbacks.append(recorder)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(Counting(), data)
    result = {name: float(trainer.callback_metrics[name]) for name in ("val/sequences", "val/answer_accuracy")}
    result["warnings"] = [str(w.message) for w in seen if "torchmetrics" in w.filename]
    result["train_losses"] = recorder.losses
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    return gathered


def runs(world: int) -> list[tuple[int, int, int, Optional[int], Optional[int], str, str]]:
    """(dp, pp, tp, ep, zero, schedule, model) for this world size; None: the planner's choice."""
    # each layout with ZeRO-1 and ZeRO-3, and under 1F1B and Interleaved1F1B, in two runs; on 8 (a run there costs
    # about 2.5 on 4) they are the GPT with biases' (ZeRO-1, interleaved) and the MoE GPT's split over tp (ZeRO-3,
    # 1F1B: its attention and embeddings sharded as a dense model's are)
    gpt4_runs = {4: [(1, 2, 2, 1, "1f1b"), (1, 2, 2, 3, "interleaved1f1b"), (2, 2, 1, 1, "interleaved1f1b"),
                     (2, 2, 1, 3, "1f1b")], 8: []}
    grid = [(dp, pp, tp, 1, zero, schedule, "gpt4") for dp, pp, tp, zero, schedule in gpt4_runs[world]]
    if world == 8:
        grid.append((2, 2, 2, 1, 1, "interleaved1f1b", "gpt4-bias"))
        # dp=2 × pp=2 × tp=2 × ep=2, every routing once: experts split over tp (ep over the data ranks), and folded
        # (ep over the tp ranks)
        grid += [(2, 2, 2, 2, 1, "1f1b", "moe8-top2", "split"), (2, 2, 2, 2, 3, "1f1b", "moe8-top1-capacity", "split"),
                 (2, 2, 2, 2, 0, "1f1b", "moe8-top1", "fold"), (2, 2, 2, 2, 1, "1f1b", "moe8-top2-capacity", "fold")]
    if world == 4:
        # ep left to the planner, which then reads the model's heads
        grid += [(1, 2, 2, None, 3, "1f1b", "llama-head-dim"), (2, 2, 1, 2, 1, "1f1b", "moe"),
                 (1, 2, 2, 1, 1, "interleaved1f1b", "gpt4-rotary"),
                 (1, 2, 2, 1, 1, "1f1b", "llama-gated"), (1, 2, 2, 1, 3, "1f1b", "llama-outside"),
                 (1, 2, 2, 1, 1, "1f1b", "gpt4-tied-vocab61")]
    return grid


if __name__ == "__main__":
    out, world = sys.argv[1], int(sys.argv[2])
    results = {}
    for run in runs(world):
        dp, pp, tp, ep, zero, schedule, model, *experts = run
        # Two microbatches (one per stage) halve the run time against four; the schedules themselves are tested
        # with 4 and 8 in test_pipeline.py.
        # ZeRO-1 runs leave keeping the projections' gathered inputs to the planner (they fit: kept); the others
        # gather them again in backward
        strategy = ml.Hybrid3DStrategy(dp=dp, pp=pp, tp=tp, ep=ep, zero=zero, schedule=schedule, microbatches=2,
                                       keep_gathered_inputs="auto" if zero == 1 else False,
                                       experts=experts[0] if experts else "auto")
        result = train("adamw", strategy, devices=world, data_parallel=dp, model=MODELS[model])
        result.pop("module")
        results[run] = {**result, "keep_gathered_inputs": strategy.keep_gathered_inputs}
    if world == 4:  # no sizes: the planner chooses (and must keep 4 sequences per data replica)
        strategy = ml.Hybrid3DStrategy()
        result = train("adamw", strategy, devices=world, model=gpt4)
        result.pop("module")
        results["planned"] = {**result, "layout": strategy.layout.describe(), "plan": strategy.plan[0].describe()}
        results["metrics"] = validation_metrics()
    if dist.get_rank() == 0:
        torch.save(results, out)
