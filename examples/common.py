"""What the GPT examples share: their run and model flags, and the Trainer they build from them."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import meshlight as ml


def add_run_arguments(parser: argparse.ArgumentParser, *, out: str, dim: int, max_steps: int, batch_size: int,
                      devices_help: str) -> None:
    """``--devices``, ``--num-nodes``, ``--accelerator``, the model's size, the schedule of the run and its log
    folder, with this example's defaults."""
    parser.add_argument("--devices", type=int, help=f"processes (CPU) or GPUs per node (default: {devices_help})")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--accelerator", default="auto", help="cpu, gpu or auto (default)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default: 2)")
    parser.add_argument("--dim", type=int, default=dim, help=f"hidden size (default: {dim})")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default: 4)")
    parser.add_argument("--max-steps", type=int, default=max_steps)
    parser.add_argument("--batch-size", type=int, default=batch_size,
                        help=f"sequences per data-parallel rank (default: {batch_size})")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-every", type=int, default=100, help="validate every N training steps")
    parser.add_argument("--out", type=Path, default=Path(out), help=f"logs and checkpoints (default: {out})")
    parser.add_argument("--seed", type=int, default=0)


def make_trainer(args: argparse.Namespace, strategy: Any, devices: int, **options: Any) -> ml.Trainer:
    """``meshlight.Trainer`` for ``--max-steps`` optimizer steps, validating every ``--val-every``, logging to
    TensorBoard under ``--out``."""
    return ml.Trainer(
        strategy=strategy,
        devices=devices,
        num_nodes=args.num_nodes,
        accelerator=args.accelerator,
        max_steps=args.max_steps,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        log_every_n_steps=10,
        default_root_dir=args.out,
        **options,
    )
