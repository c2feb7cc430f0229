"""Compression: the bytes of gradient reductions with and without ``grad_compression``, and whether the demo task
still learns with compressed gradients.

*traffic* — per optimizer step (after warm-up: DDP's bucket rebuild, FSDP's lazy initialization, PowerSGD's plain
all-reduces), the bytes each rank sends in gradient reductions (all-reduces and reduce-scatters) and in weight
all-gathers, counted by ``CollectiveTraffic`` on ``common.bench_config()`` (4 blocks, dim 128), for ddp, zero2 and
zero3 with 1 and 2 micro-batches per step, uncompressed and with bf16 gradients, and PowerSGD at rank 4 under ddp.
``reduction_ratio`` is the compressed run's reduction bytes over the uncompressed run's; ``gather_share`` the weight
all-gathers' share of the compressed step's bytes (they are not compressed).

*activations* — the bytes autograd keeps for backward in one forward of ``common.bench_config()``'s GPT (fp32, 4
sequences of 64 tokens), each distinct tensor once and parameters left out, uncompressed and with every block's saved
activations compressed by ``ActivationCompression`` (bf16, fp8 e4m3): the blocks' compressed bytes plus what is
saved outside them (embeddings, final norm, the logits for the loss).

*convergence* — the demo task (``examples/train_gpt.py``'s defaults: 2-digit sums, 2 blocks of dim 128, 64 sequences
per rank, learning rate 3e-3, 500 steps) under ddp on 2 processes, uncompressed, with bf16 gradients, with
PowerSGD (``GradientCompression("powersgd")``'s defaults: rank 4, after 50 plain steps) and with every block's saved
activations in bf16 (``ActivationCompression``), each with ``--seeds``: the training loss every 50 steps and the final
answer accuracy.

    python benchmarks/compression.py [--sections traffic activations convergence] [--variants ...] [--nprocs 2]
                                     [--powersgd-rank 4] [--powersgd-start 10]          # prints JSON
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from common import is_worker, launch, report

MEASURED_STEP = 3  # after PowerSGD's two plain steps (start_step=2 here) and DDP's bucket rebuild
BATCH, SEQ = 4, 64
STRATEGIES = ("ddp", "zero2", "zero3")
REDUCTIONS = ("all_reduce", "reduce_scatter")


def traffic_worker() -> list[dict[str, Any]]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    import meshlight as ml
    from meshlight.demos import LitGPT, RandomTokensDataModule
    from meshlight.parallel import CollectiveTraffic, GradientCompression

    from common import bench_config, measuring_trainer_options

    class StepTraffic(Callback):
        """Counts the collectives of optimizer step ``MEASURED_STEP``, all its micro-batches."""

        def __init__(self) -> None:
            self.traffic, self.active = CollectiveTraffic(), False

        def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_step == MEASURED_STEP and not self.active:
                self.traffic.__enter__()
                self.active = True

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_step == MEASURED_STEP + 1 and self.active:
                self.traffic.__exit__(None, None, None)
                self.active = False

    def step_bytes(strategy: str, accumulation: int, compression: Any) -> dict[str, float]:
        pl.seed_everything(0, verbose=False)
        probe = StepTraffic()
        strategy_object = (ml.DDPStrategy(grad_compression=compression) if strategy == "ddp"
                           else ml.ZeroStrategy(int(strategy[-1]), grad_compression=compression))
        trainer = ml.Trainer(strategy=strategy_object, accumulate_grad_batches=accumulation,
                             **measuring_trainer_options(world, MEASURED_STEP + 1, [probe]))
        data = RandomTokensDataModule(vocab_size=256, seq_len=SEQ, batch_size=BATCH,
                                      train_size=(MEASURED_STEP + 1) * accumulation * BATCH * world)
        trainer.fit(LitGPT(bench_config()), data)
        summary = probe.traffic.summary()
        reductions = sum(summary.get(kind, {}).get("bytes_sent", 0.0) for kind in REDUCTIONS)
        return {"reduction_bytes": reductions, "gather_bytes": summary.get("all_gather", {}).get("bytes_sent", 0.0)}

    world = int(os.environ["WORLD_SIZE"])
    rows = []
    variants = [(s, a, "bf16") for s in STRATEGIES for a in (1, 2)] + [("ddp", a, "powersgd") for a in (1, 2)]
    plain: dict[tuple[str, int], dict[str, float]] = {}
    for strategy, accumulation, kind in variants:
        if (strategy, accumulation) not in plain:
            plain[strategy, accumulation] = step_bytes(strategy, accumulation, None)
        compression = GradientCompression("powersgd", rank=4, start_step=2) if kind == "powersgd" else kind
        compressed = step_bytes(strategy, accumulation, compression)
        base = plain[strategy, accumulation]
        step = compressed["reduction_bytes"] + compressed["gather_bytes"]
        rows.append({
            "strategy": strategy, "world": world, "micro_batches": accumulation, "compression": kind,
            "reduction_bytes": compressed["reduction_bytes"], "uncompressed_reduction_bytes": base["reduction_bytes"],
            "reduction_ratio": compressed["reduction_bytes"] / base["reduction_bytes"],
            "gather_bytes": compressed["gather_bytes"], "uncompressed_gather_bytes": base["gather_bytes"],
            "gather_share": compressed["gather_bytes"] / step if step else 0.0,
        })
    return rows


# name -> (grad_compression, ActivationCompression dtype)
CONVERGENCE = {"uncompressed": (None, None), "bf16 gradients": ("bf16", None), "powersgd": ("powersgd", None),
               "bf16 activations": (None, "bf16")}
CONVERGENCE_STEPS, CURVE_EVERY = 500, 50


def convergence_worker(name: str, powersgd_rank: str, powersgd_start: str, seed: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    import meshlight as ml
    from meshlight.callbacks import ActivationCompression
    from meshlight.demos import AdditionDataModule, LitGPT
    from meshlight.models import GPTConfig

    class Curve(Callback):
        def __init__(self) -> None:
            self.losses: dict[int, float] = {}

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            if trainer.global_step % CURVE_EVERY == 0:
                self.losses[trainer.global_step] = round(float(trainer.callback_metrics["train/loss"]), 4)

    world = int(os.environ["WORLD_SIZE"])
    pl.seed_everything(int(seed), verbose=False)
    batch = 64  # per rank, as the example
    data = AdditionDataModule(2, batch_size=batch, train_size=CONVERGENCE_STEPS * batch * world, seed=int(seed))
    config = GPTConfig(vocab_size=data.vocab_size, max_seq_len=data.seq_len, n_layers=2, dim=128, n_heads=4)
    model = LitGPT(config, lr=3e-3, weight_decay=0.0, warmup_steps=CONVERGENCE_STEPS // 20, foreach=True)
    curve = Curve()
    grad_compression, activations = CONVERGENCE[name]
    if grad_compression == "powersgd":
        grad_compression = ml.GradientCompression("powersgd", rank=int(powersgd_rank), start_step=int(powersgd_start))
    compressed = [ActivationCompression(activations)] if activations else []
    trainer = ml.Trainer(strategy=ml.DDPStrategy(grad_compression=grad_compression), devices=world,
                         accelerator="cpu", max_steps=CONVERGENCE_STEPS, val_check_interval=CONVERGENCE_STEPS,
                         check_val_every_n_epoch=None, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[curve, *compressed])
    trainer.fit(model, data)
    powersgd = {"powersgd_rank": int(powersgd_rank), "powersgd_start": int(powersgd_start)}
    accuracy = round(float(trainer.callback_metrics["val/answer_accuracy"]), 4)
    return {"variant": name, "world": world, "seed": int(seed), **(powersgd if name == "powersgd" else {}),
            "steps": CONVERGENCE_STEPS, "loss_curve": curve.losses, "answer_accuracy": accuracy}


def activations() -> list[dict[str, Any]]:
    import torch
    from torch.autograd.graph import saved_tensors_hooks

    from meshlight.models import GPT
    from meshlight.parallel.activation_compression import ActivationCompressionPolicy, apply_activation_compression

    from common import bench_config

    def saved_bytes(dtype: Any) -> tuple[int, int]:
        """Bytes saved outside compressed blocks (the compressor's hooks see those inside), and inside: compressed."""
        torch.manual_seed(0)
        model = GPT(bench_config())
        if dtype is not None:
            apply_activation_compression(model, ActivationCompressionPolicy(dtype))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[tuple[Any, ...], torch.Tensor] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.untyped_storage().data_ptr() not in params:
                seen[(tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape,
                      tensor.stride())] = tensor
            return tensor

        tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
        with saved_tensors_hooks(pack, lambda tensor: tensor):
            model.loss(model(tokens[:, :-1]), tokens[:, 1:])
        outside = sum(t.numel() * t.element_size() for t in seen.values())
        compressor = getattr(model, "_meshlight_compressor", None)
        return outside, compressor.compressed_bytes if compressor is not None else 0

    plain = sum(saved_bytes(None))
    rows = []
    for dtype in ("bf16", "fp8_e4m3"):
        outside, inside = saved_bytes(dtype)
        rows.append({"dtype": dtype, "uncompressed_bytes": plain, "outside_blocks_bytes": outside,
                     "compressed_blocks_bytes": inside, "ratio": (outside + inside) / plain})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", default=["traffic", "activations", "convergence"],
                        choices=["traffic", "activations", "convergence"])
    parser.add_argument("--variants", nargs="+", default=list(CONVERGENCE), choices=list(CONVERGENCE),
                        help="convergence runs (default: all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--powersgd-start", type=int, default=50, help="PowerSGD's plain steps first")
    parser.add_argument("--nprocs", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    if "traffic" in args.sections:
        results["traffic"] = launch(__file__, args.nprocs, "traffic")
    if "activations" in args.sections:
        results["activations"] = activations()
    if "convergence" in args.sections:
        results["convergence"] = [launch(__file__, args.nprocs, "convergence", name, str(args.powersgd_rank),
                                         str(args.powersgd_start), str(seed), timeout=1800)
                                  for name in args.variants for seed in args.seeds]
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    if is_worker():
        import sys

        section, *rest = sys.argv[1:]
        report(traffic_worker() if section == "traffic" else convergence_worker(*rest))
    else:
        main()
