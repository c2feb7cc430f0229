"""The ``meshlight`` command line.

    meshlight plan --model llama3-70b --gpus 1024 --gpu h100 --seq 8192     # layouts for a cluster you plan
    meshlight consolidate runs/ckpt/step=000001000 model.safetensors         # one full state dict, for inference
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Optional

from meshlight.parallel.planner import (
    HARDWARE,
    MODELS,
    PlanError,
    best_per_layout,
    format_plan,
    more_devices_hint,
    plan,
)

__all__ = ["main"]

TOKENS_PER_STEP = 4 * 2**20  # default global batch: about 4M tokens, as large pretraining runs use


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="meshlight", description="meshlight command line")
    commands = parser.add_subparsers(dest="command", required=True)
    planner = commands.add_parser(
        "plan", help="rank parallel layouts for a model on a cluster (no devices needed)",
        description="Estimate per-device memory and step time of every valid (dp, pp, tp, ep, zero, microbatches,"
                    " virtual stages, recomputation) and print the best layouts.")
    planner.add_argument("--model", required=True, choices=sorted(MODELS), help="model preset")
    planner.add_argument("--gpus", type=int, required=True, help="number of devices")
    planner.add_argument("--gpu", default="h100", choices=sorted(HARDWARE), help="device preset (default h100)")
    planner.add_argument("--gpus-per-node", type=int, help="devices per node (default: the preset's)")
    planner.add_argument("--seq", type=int, help="sequence length (default: the model preset's)")
    planner.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: ~4M tokens)")
    for size in ("dp", "pp", "tp", "ep", "zero"):
        planner.add_argument(f"--{size}", type=int, help=f"fix {size} instead of planning it")
    planner.add_argument("--top", type=int, default=5, help="layouts to show (default 5)")
    planner.add_argument("--json", action="store_true", help="print the best layouts as JSON")
    merge = commands.add_parser(
        "consolidate", help="write a sharded checkpoint's model weights as one file",
        description="Gather the model weights of a sharded meshlight checkpoint (any layout) into one full state"
                    " dict: OUT ending in .safetensors is written as safetensors, anything else with torch.save.")
    merge.add_argument("checkpoint", help="checkpoint folder or URL")
    merge.add_argument("out", help="output file (.safetensors or .pt)")
    merge.add_argument("--strip-prefix", default="", help='remove this prefix from names, e.g. "model."')
    args = parser.parse_args(argv)
    if args.command == "consolidate":
        return _consolidate(args)
    model = MODELS[args.model].replace(**({"seq_len": args.seq} if args.seq else {}))
    hardware = HARDWARE[args.gpu].replace(**({"devices_per_node": args.gpus_per_node} if args.gpus_per_node else {}))
    global_batch = args.global_batch or max(TOKENS_PER_STEP // model.seq_len, 1)
    try:
        candidates = plan(model, hardware, args.gpus, global_batch, dp=args.dp, pp=args.pp, tp=args.tp, ep=args.ep,
                          zero=args.zero)
    except PlanError as error:
        print(f"meshlight plan: {error}", file=sys.stderr)
        return 2
    if args.json:
        rows = [{"layout": c.describe(), **c.strategy_arguments(), "recompute": c.recompute,
                 "memory_bytes": c.memory_bytes, "fits": c.fits, "step_seconds": c.step_time,
                 "tokens_per_second_per_device": c.tokens_per_second_per_device, "mfu": c.mfu, "times": c.times}
                for c in best_per_layout(candidates)[: args.top]]
        print(json.dumps(rows, indent=1))
    else:
        print(f"{model.name} (seq {model.seq_len}, global batch {global_batch}) on {args.gpus} × {hardware.name},"
              f" {hardware.devices_per_node} per node:")
        print(format_plan(candidates, top=args.top))
        if not candidates[0].fits:
            print(more_devices_hint(model, hardware, args.gpus, global_batch))
    return 0


def _consolidate(args: argparse.Namespace) -> int:
    from meshlight.parallel.checkpoint import CheckpointError, consolidate

    try:
        state = consolidate(args.checkpoint, args.out, strip_prefix=args.strip_prefix)
    except (CheckpointError, ImportError) as error:
        print(f"meshlight consolidate: {error}", file=sys.stderr)
        return 2
    count = sum(t.numel() for t in state.values())
    print(f"Wrote {len(state)} tensors ({count:,} values) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
