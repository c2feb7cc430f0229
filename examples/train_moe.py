"""Train a mixture-of-experts GPT with expert parallelism, and watch its experts' load.

    python examples/train_moe.py                                     # 8 experts over ep=2 on 2 CPU processes
    python examples/train_moe.py --ep 2 --devices 4                  # dp=2 × ep=2
    python examples/train_moe.py --ep 2 --tp 2 --devices 4           # experts under tensor parallelism (folded)
    python examples/train_moe.py --ep 2 --tp 2 --experts-layout split --devices 4   # each expert split over tp
    python examples/train_moe.py --top-k 1 --capacity-factor 1.25    # Switch routing, tokens over capacity dropped
    python examples/train_moe.py --balance global                    # aux loss from counts over the global batch

Every feed-forward is a ``meshlight.nn.MoE`` layer: a router sends each token to its ``top_k`` experts, and
``ep`` ranks each hold ``experts / ep`` of them, exchanging tokens by all-to-all. Load balancing is on by default
(an auxiliary loss and a per-expert bias on the router's choice). ``ExpertLoadMonitor``, which
``meshlight.Trainer`` adds, logs every layer's imbalance (max / mean expert load; 1 is even), the dropped fraction
and a load heatmap to TensorBoard; the last line here prints the worst layer's imbalance.
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as pl

import meshlight as ml
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig
from meshlight.nn import MoEConfig

from common import add_run_arguments, make_trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, default=2, help="ranks the experts are split over (default: 2)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default: 1)")
    parser.add_argument("--experts-layout", choices=("auto", "split", "fold"), default="auto",
                        help="under tp: each expert split over tp, or whole experts with ep across the tp ranks")
    parser.add_argument("--zero", type=int, default=1, help="ZeRO stage for dense and expert weights (default: 1)")
    parser.add_argument("--experts", type=int, default=8, help="experts per MoE layer (default: 8)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default: 2)")
    parser.add_argument("--capacity-factor", type=float, help="drop assignments over this × the even share")
    parser.add_argument("--balance", choices=("sequence", "global"), default="sequence",
                        help="aux loss per sequence (default) or from counts over the global batch")
    parser.add_argument("--digits", type=int, default=2, help="digits per operand (default: 2)")
    add_run_arguments(parser, out="runs/train_moe", dim=64, max_steps=400, batch_size=64, devices_help="ep·tp")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    pl.seed_everything(args.seed, verbose=False)
    devices = args.devices or args.ep * args.tp
    replicas = devices * args.num_nodes // args.tp
    # sequence parallelism splits the sequence over the tp ranks: pad it to a multiple of tp
    data = AdditionDataModule(args.digits, batch_size=args.batch_size, pad_to_multiple_of=args.tp, seed=args.seed,
                              train_size=args.max_steps * args.batch_size * replicas)
    moe = MoEConfig(num_experts=args.experts, top_k=args.top_k, capacity_factor=args.capacity_factor,
                    balance=args.balance)
    config = GPTConfig(vocab_size=data.vocab_size, max_seq_len=data.seq_len, n_layers=args.layers, dim=args.dim,
                       n_heads=args.heads, moe=moe)
    model = LitGPT(config, lr=args.lr, weight_decay=0.0, warmup_steps=args.max_steps // 20, foreach=True)
    strategy = ml.MoEStrategy(ep=args.ep, zero=args.zero, tp=args.tp, experts=args.experts_layout)
    trainer = make_trainer(args, strategy, devices, enable_checkpointing=False)
    start = time.perf_counter()
    trainer.fit(model, data)
    if trainer.is_global_zero:
        metrics = trainer.callback_metrics
        imbalance = {name.split("/")[1]: float(value) for name, value in metrics.items()
                     if name.startswith("moe/") and name.endswith("/imbalance")}
        worst = max(imbalance, key=imbalance.get)
        print(
            f"\nTrained {trainer.global_step} steps in {time.perf_counter() - start:.0f} s"
            f" ({trainer.strategy.layout.describe()}): val/loss {metrics['val/loss']:.3f},"
            f" answer accuracy {metrics['val/answer_accuracy']:.1%}."
            f"\nExpert load at the last logged step, max/mean (1 is even): worst layer {worst} {imbalance[worst]:.2f}."
            f"\nTensorBoard logs: {trainer.logger.log_dir}   (moe/<layer>/imbalance, the load heatmaps under Images)"
        )


if __name__ == "__main__":
    main()
