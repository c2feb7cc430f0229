"""Train on long sequences with context parallelism: every sequence split over ``cp`` ranks.

    python examples/long_context.py                                  # cp=2 on 2 CPU processes, 128 tokens
    python examples/long_context.py --cp 4 --seq-len 4096            # 4 ranks, each holding 1024 tokens
    python examples/long_context.py --cp 2 --devices 4               # dp=2 × cp=2
    python examples/long_context.py --accelerator gpu --cp 8 --seq-len 131072 --attention ring   # torch's ring

The task is copying (``meshlight.demos.CopyDataModule``): a random sequence followed by itself, so every copied
token is predicted by attending half a sequence back — across the ranks, since rank i holds chunks i and
2·cp−1−i of each sequence. The answer accuracy is exact match of a whole copy. Attention exchanges K and V over the
cp ranks (``--attention allgather``, any device) or runs torch's ring attention (``ring``, CUDA only).

The defaults learn the copy on 2 CPU processes: the loss stays near ln(63) = 4.14 for about 500 steps, until the
model finds the induction head, then falls; the copy accuracy reaches 100% by step 800–1000 (2–5 minutes on 2
cores, with the machine's load). Longer sequences take more steps to find it.
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as pl

import meshlight as ml
from meshlight.callbacks import TrainingMonitor
from meshlight.demos import CopyDataModule, LitGPT
from meshlight.models import GPTConfig

from common import add_run_arguments, make_trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, default=2, help="ranks each sequence is split over (default: 2)")
    parser.add_argument("--attention", choices=("allgather", "ring"), default="allgather")
    parser.add_argument("--zero", type=int, default=1, help="ZeRO stage over the dp × cp ranks (default: 1)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence, a multiple of 2·cp")
    add_run_arguments(parser, out="runs/long_context", dim=64, max_steps=1000, batch_size=8, devices_help="cp")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    pl.seed_everything(args.seed, verbose=False)
    devices = args.devices or args.cp
    replicas = devices * args.num_nodes // args.cp
    data = CopyDataModule(args.seq_len, batch_size=args.batch_size, seed=args.seed,
                          train_size=args.max_steps * args.batch_size * replicas)
    config = GPTConfig(vocab_size=data.vocab_size, max_seq_len=args.seq_len, n_layers=args.layers, dim=args.dim,
                       n_heads=args.heads)
    model = LitGPT(config, lr=args.lr, weight_decay=0.0, warmup_steps=args.max_steps // 20, foreach=True)
    strategy = ml.ContextParallelStrategy(cp=args.cp, zero=args.zero, attention=args.attention)
    trainer = make_trainer(args, strategy, devices, enable_checkpointing=False, callbacks=[TrainingMonitor()])
    start = time.perf_counter()
    trainer.fit(model, data)
    if trainer.is_global_zero:
        metrics = trainer.callback_metrics
        print(
            f"\nTrained {trainer.global_step} steps of {args.seq_len}-token sequences in"
            f" {time.perf_counter() - start:.0f} s ({trainer.strategy.layout.describe()}, each rank holding"
            f" {args.seq_len // args.cp} tokens of a sequence): train/loss {metrics['train/loss']:.3f},"
            f" val/loss {metrics['val/loss']:.3f}, copy accuracy {metrics['val/answer_accuracy']:.1%}."
            f"\nTensorBoard logs: {trainer.logger.log_dir}"
        )


if __name__ == "__main__":
    main()
