"""Train a small GPT to add numbers, with any meshlight strategy, and watch it learn in TensorBoard.

    python examples/train_gpt.py                                    # "3d": dp=2 × pp=2 × tp=2 on 8 CPU processes
    python examples/train_gpt.py --accelerator gpu                  # "3d" on every GPU: the planner's layout
    python examples/train_gpt.py --strategy zero3 --devices 4
    python examples/train_gpt.py --strategy moe --experts 8         # mixture of experts, split over 2 ranks
    python examples/train_gpt.py --digits 3 --max-steps 1500 --strategy zero1   # a harder sum, longer
    python examples/train_gpt.py --strategy ddp --grad-compression powersgd     # compressed gradients
    python examples/train_gpt.py --compress-activations bf16        # saved activations in bf16
    python examples/train_gpt.py --profile-steps 50 52              # + a profiler trace of steps 50-52 per rank
    torchrun --nproc-per-node 8 examples/train_gpt.py --devices 8   # processes started by torchrun

The model sees ``12+34=`` and must write the sum; the answer accuracy (exact match of all digits) is logged
as ``val/answer_accuracy`` next to the losses. The defaults (2-digit sums, 500 steps of 64 sequences per data
replica) reach 94–100% (by the CPU's rounding) in two to five minutes on 8 processes sharing 2 CPU cores (with the
machine's load).
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import meshlight as ml
from meshlight.callbacks import ActivationCompression, ProfileSteps, TrainingMonitor
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig
from meshlight.nn import MoEConfig
from meshlight.strategies import resolve_strategy

from common import add_run_arguments, make_trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="3d",
                        help="ddp, zero1, zero2, zero3/fsdp, tp, pipeline, moe, 3d (default: 3d)")
    parser.add_argument("--dp", type=int, help="3d sizes; default on CPU dp=2, pp=2, tp=2, on GPUs the planner's")
    parser.add_argument("--pp", type=int)
    parser.add_argument("--tp", type=int)
    add_run_arguments(parser, out="runs/train_gpt", dim=128, max_steps=500, batch_size=64,
                      devices_help="dp·pp·tp for 3d on CPU, else 2; all GPUs")
    parser.add_argument("--experts", type=int, default=0, help="mixture-of-experts feed-forwards (default: 0, dense)")
    parser.add_argument("--digits", type=int, default=2, help="digits per operand (default: 2)")
    parser.add_argument("--grad-compression", choices=("bf16", "fp16", "powersgd"),
                        help="gradients compressed in the data-parallel reductions (powersgd: --strategy ddp)")
    parser.add_argument("--compress-activations", choices=("bf16", "fp8_e4m3"),
                        help="keep every block's saved activations in this dtype")
    parser.add_argument("--profile-steps", type=int, nargs=2, metavar=("FIRST", "LAST"),
                        help="write a torch.profiler trace of these optimizer steps per rank to <log dir>/profile")
    return parser.parse_args(argv)


def make_strategy(args: argparse.Namespace) -> str | ml.MeshStrategy:
    """The strategy by name, or "3d" with the sizes given — on CPU dp=2, pp=2, tp=2 unless given; on GPUs the
    sizes not given are the planner's. Also fills in --devices."""
    gpu = args.accelerator in ("gpu", "cuda") or (args.accelerator == "auto" and torch.cuda.is_available())
    options = {"grad_compression": args.grad_compression} if args.grad_compression else {}
    if args.strategy != "3d":
        args.devices = args.devices or (torch.cuda.device_count() if gpu else 2)
        return resolve_strategy(args.strategy, **options)
    sizes = {"dp": args.dp, "pp": args.pp, "tp": args.tp}
    if not gpu and not any(sizes.values()):
        sizes = {"dp": 2, "pp": 2, "tp": 2}
        args.dp, args.pp, args.tp = sizes.values()
    if args.devices is None:
        known = all(sizes.values())
        args.devices = sizes["dp"] * sizes["pp"] * sizes["tp"] if known else torch.cuda.device_count() if gpu else 8
    return ml.Hybrid3DStrategy(dp=sizes["dp"] or "auto", pp=sizes["pp"], tp=sizes["tp"], **options)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    pl.seed_everything(args.seed, verbose=False)
    strategy = make_strategy(args)
    # One epoch of exactly --max-steps steps per data replica (at most one replica per process).
    train_size = args.max_steps * args.batch_size * args.devices * args.num_nodes
    # Sequence parallelism splits the sequence over the tensor-parallel ranks: pad it to a multiple of their number
    # (for a planned layout, of the largest tp the planner considers: a node's 8 devices).
    tp = {"tp": args.devices, "3d": args.tp or 8}.get(args.strategy, 1)
    data = AdditionDataModule(args.digits, batch_size=args.batch_size, train_size=train_size, pad_to_multiple_of=tp)
    config = GPTConfig(vocab_size=data.vocab_size, max_seq_len=data.seq_len, n_layers=args.layers, dim=args.dim,
                       n_heads=args.heads, moe=MoEConfig(num_experts=args.experts) if args.experts else None)
    # foreach: AdamW's multi-tensor kernels — one DTensor dispatch per group and operation instead of one per
    # parameter (torch's default on CUDA; on CPU 3–15% of a 3d step here, in interleaved runs)
    model = LitGPT(config, lr=args.lr, weight_decay=0.0, warmup_steps=args.max_steps // 20, foreach=True)
    checkpoint = ModelCheckpoint(
        dirpath=args.out / "checkpoints", monitor="val/answer_accuracy", mode="max", save_last=True,
        filename="step={step}-accuracy={val/answer_accuracy:.3f}", auto_insert_metric_name=False,
    )
    first, last = args.profile_steps or (0, -1)
    profile = [ProfileSteps(steps=range(first, last + 1))] if args.profile_steps else []
    compressed = [ActivationCompression(args.compress_activations)] if args.compress_activations else []
    # TrainingMonitor: tokens/s, MFU, step time, memory, the layout
    trainer = make_trainer(args, strategy, args.devices,
                           callbacks=[checkpoint, TrainingMonitor(), *profile, *compressed])
    start = time.perf_counter()
    trainer.fit(model, data)
    if trainer.is_global_zero:
        metrics = trainer.callback_metrics
        scores = (f": val/loss {metrics['val/loss']:.3f}, answer accuracy {metrics['val/answer_accuracy']:.1%}"
                  if "val/loss" in metrics else " (no validation ran)")
        print(
            f"\nTrained {trainer.global_step} steps in {time.perf_counter() - start:.0f} s with strategy"
            f" {args.strategy!r} ({trainer.strategy.layout.describe()}){scores}."
            f"\nTensorBoard logs: {trainer.logger.log_dir}   (view: tensorboard --logdir {args.out})"
            f"\nBest checkpoint:  {checkpoint.best_model_path}"
            f"\nLast checkpoint:  {checkpoint.last_model_path}"
        )


if __name__ == "__main__":
    main()
