"""torchrun worker: expert-parallel parity runs (ep = 2 and 4; ZeRO 0, 1, 3; top-1 and top-2; dropless and with a
capacity factor; expert bias; the aux loss over the data-parallel batch; accumulation and clipping; a Llama-shaped
module with meshlight.nn.MoE), MoE under tensor parallelism (tp=2 on 2 processes; tp=2 × ep=2 on 4, experts split
over tp and folded), a checkpoint saved under ep=2 × ZeRO-3 and loaded under ep=4, and bad input that must fail on
every rank."""

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

import meshlight as ml
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig
from meshlight.nn import MoE, MoEConfig
from meshlight.parallel.layout import data_sizes
from tests.strategies.llama import LitLlama
from tests.strategies.parity import WITHOUT_EXPERT_BIAS, full_weights, make_data, train

EXPERTS = 8
MODELS: dict[str, dict[str, Any]] = {  # MoE options of GPT-tiny's two MoE blocks (over WITHOUT_EXPERT_BIAS)
    "top2": {},
    "top1": {"top_k": 1},
    "top2-capacity": {"capacity_factor": 1.0, "min_capacity": 1},
    "top1-capacity": {"top_k": 1, "capacity_factor": 1.0, "min_capacity": 1},
    "bias": {"aux_loss_coeff": 0.0, "expert_bias_rate": 1e-2},  # the expert bias alone, moved proportionally
    "sigmoid-zloss": {"score": "sigmoid", "z_loss_coeff": 1e-3},
    "top2-global": {"balance": "global"},  # the aux loss from the counts of every data-parallel rank's micro-batch
}


def factory(model: str, **moe: Any):  # noqa: ANN201 - a model factory for `train` (``moe``: more MoE options)
    if model == "llama":
        # lr 3e-3: at 1e-2 this model's routers collapse onto a few experts within 20 steps; the router rows of
        # experts that get no tokens then see only the aux loss's ~1e-9 gradients, which Adam turns into full
        # steps, amplifying the rounding of another summation order to ~2e-4 (all other rows stay ~1e-6).
        return lambda: LitLlama(lr=3e-3, experts=EXPERTS)
    config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=32, n_layers=2, bias=False,
                            moe=MoEConfig(num_experts=EXPERTS, **{**WITHOUT_EXPERT_BIAS, **MODELS[model], **moe}))
    return lambda: LitGPT(config, lr=1e-2, warmup_steps=2)


def runs(world: int) -> list[tuple[int, int, str, str]]:
    """(ep, zero, model, trainer variant) for this world size; dp = world."""
    if world == 2:
        grid = [(2, 1, model, "adamw") for model in (*MODELS, "llama")]
        grid += [(2, 3, model, "adamw") for model in ("top2", "top2-capacity")]
        grid += [(2, 0, "top2", "adamw"), (2, 1, "top2", "accumulate"), (2, 1, "top2", "clip")]
        return grid
    # ep=2 here leaves two replicas of each expert (dp=4): the routings that 2 processes did not run under ZeRO-1
    grid = [(4, 1, model, "adamw") for model in ("top2", "top2-capacity", "llama")]
    grid += [(2, 1, model, "adamw") for model in ("top1", "top2-capacity")]
    grid += [(2, 3, model, "adamw") for model in ("top2-capacity", "bias")]
    grid += [(2, 0, "top2", "adamw"), (4, 3, "top2", "adamw")]
    grid += [(4, 1, "top2-global", "accumulate")]
    return grid


ROUTINGS = ("top2", "top1", "top2-capacity", "top1-capacity")


def tensor_runs(world: int) -> list[tuple[str, int, int, str, int, str]]:
    """MoE under tensor parallelism: (strategy, tp, ep, experts, zero, model) for this world size; dp = world / tp.
    On 2: TensorParallelStrategy(tp=2) (sequence parallel, and once without); on 4: tp=2 × ep=2, each expert split
    over tp, and folded (ep spanning the tp ranks), under DDP, ZeRO-1 and ZeRO-3."""
    if world == 2:
        return [("tp", 2, 1, "split", 1, model) for model in ROUTINGS] + [("tp-no-sp", 2, 1, "split", 1, "top2")]
    # every routing once, each layout with top-1 and top-2, dropless and with a capacity factor
    return [("mesh", 2, 2, "split", 0, "top2"), ("mesh", 2, 2, "split", 3, "top1-capacity"),
            ("mesh", 2, 2, "fold", 1, "top1"), ("mesh", 2, 2, "fold", 3, "top2-capacity")]


def tensor_strategy(run: tuple[str, int, int, str, int, str]) -> ml.MeshStrategy:
    kind, tp, ep, experts, zero, _ = run
    if kind.startswith("tp"):
        return ml.TensorParallelStrategy(tp=tp, zero=zero, sequence_parallel=kind == "tp")
    return ml.MeshStrategy(**data_sizes("auto", zero), tp=tp, ep=ep, zero=zero, experts=experts)


CHECKPOINTED = (2, 3, "bias", "adamw")  # on 4 processes: saved, then loaded under ep=4 × ZeRO-1


def expert_loads(module: torch.nn.Module) -> dict[str, list[float]]:
    """Each MoE layer's statistics of the last step: tokens per expert, dropped fraction, aux and z loss."""
    return {name: [*m.last_step.tokens.tolist(), m.last_step.dropped_fraction, m.last_step.aux_loss, m.last_step.z_loss]
            for name, m in module.named_modules() if isinstance(m, MoE)}


def load_elsewhere(checkpoint: Path, world: int) -> dict[str, torch.Tensor]:
    """Weights after loading ``checkpoint`` into a fresh model under ep = world, ZeRO-1."""
    pl.seed_everything(1, verbose=False)  # other initial weights: what matches comes from the checkpoint
    module = factory(CHECKPOINTED[2])()
    trainer = ml.Trainer(strategy=ml.MoEStrategy(ep=world, zero=1), devices=world, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1)
    trainer.validate(module, make_data(4), ckpt_path=checkpoint, verbose=False)
    return full_weights(module)


BAD_INPUT = {  # name -> (strategy arguments, model) on 4 processes
    "experts not divisible by ep": (dict(ep=4), lambda: LitGPT(GPTConfig.tiny(moe=MoEConfig(num_experts=6)))),
    "ep not dividing the data-parallel size": (dict(ep=3), lambda: LitGPT(GPTConfig.tiny(moe=MoEConfig()))),
    "no MoE layers": (dict(ep=2), lambda: LitGPT(GPTConfig.tiny())),
    "expert hidden size not divisible by tp": (
        dict(ep=1, tp=2), lambda: LitGPT(GPTConfig.tiny(moe=MoEConfig(num_experts=4, hidden_dim=33)))),
    "a layout that cannot fold": (dict(ep=3, tp=2, experts="fold"), lambda: LitGPT(GPTConfig.tiny(moe=MoEConfig()))),
    "folded experts not divisible by ep": (
        dict(ep=4, tp=2, experts="fold"), lambda: LitGPT(GPTConfig.tiny(moe=MoEConfig(num_experts=6)))),
}


def bad_input(world: int) -> dict[str, str]:
    errors = {}
    for name, (options, make) in BAD_INPUT.items():
        try:
            trainer = ml.Trainer(strategy=ml.MoEStrategy(**options), devices=world, accelerator="cpu", max_steps=1,
                                 logger=False, enable_progress_bar=False, enable_checkpointing=False)
            trainer.fit(make(), make_data(4))
            errors[name] = "no error"
        except ValueError as error:
            errors[name] = str(error)
    return errors


if __name__ == "__main__":
    out, world = Path(sys.argv[1]), int(sys.argv[2])
    results: dict[Any, Any] = {}
    for run in runs(world):
        ep, zero, model, variant = run
        checkpoint = out / "moe.ckpt" if world == 4 and run == CHECKPOINTED else None
        result = train(variant, ml.MoEStrategy(ep=ep, zero=zero), devices=world, model=factory(model),
                       save_to=checkpoint)
        result["loads"] = expert_loads(result.pop("module"))
        results[run] = result
    for run in tensor_runs(world):
        result = train("adamw", tensor_strategy(run), devices=world, data_parallel=world // run[1],
                       model=factory(run[5]))
        result["loads"] = expert_loads(result.pop("module"))
        results[run] = result
    if world == 4:
        results["loaded"] = load_elsewhere(out / "moe.ckpt", world)
        results["bad input"] = {dist.get_rank(): bad_input(world)}
        gathered = [None] * world
        dist.all_gather_object(gathered, results["bad input"])
        results["bad input"] = {rank: errors for part in gathered for rank, errors in part.items()}
    if dist.get_rank() == 0:
        torch.save(results, out / f"{world}.pt")
