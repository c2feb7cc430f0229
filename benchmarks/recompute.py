"""Activation checkpointing on GPT-small (124M parameters, 12 blocks) on this CPU: activation bytes kept for
backward (distinct storages autograd holds when the forward ends, parameters excluded) and forward+backward
time, without and with recomputation of every block (``ActivationCheckpointing()``) and of every second block.

Interleaved rounds in one process, each running every variant ``--steps`` times in rotating order: the median
step of each variant, and its time ÷ no recomputation as the median over rounds of that ratio within a round (the
variants' mean steps, paired in time, so drift cancels), with the lowest and highest round's.

    python benchmarks/recompute.py [--seq 128] [--batch 1] [--rounds 3] [--steps 1]      # prints JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    import torch
    from torch.autograd.graph import saved_tensors_hooks

    from meshlight.models import GPT, GPTConfig
    from meshlight.parallel.blocks import BlockSelection
    from meshlight.parallel.recompute import apply_recompute

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1, help="steps of each variant per round (their mean counts)")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPTConfig.gpt2(max_seq_len=args.seq)
    variants = {"none": None, "every block": BlockSelection(1), "every 2nd block": BlockSelection(2)}
    model = GPT(config)
    models = {}
    for name, policy in variants.items():
        copy = GPT(config)
        copy.load_state_dict(model.state_dict())
        if policy is not None:
            apply_recompute(copy, policy)
        models[name] = copy
    inputs = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    targets = torch.randint(0, config.vocab_size, (args.batch, args.seq))

    def step(module: torch.nn.Module) -> tuple[float, int]:
        storages: dict[int, int] = {}
        weights = {p.untyped_storage().data_ptr() for p in module.parameters()}  # saved too, but not activations

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.untyped_storage().data_ptr() not in weights:
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        start = time.perf_counter()
        with saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = module.loss(module(inputs), targets)
        loss.backward()
        module.zero_grad(set_to_none=True)
        return time.perf_counter() - start, sum(storages.values())

    for module in models.values():
        step(module)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in models}
    saved: dict[str, int] = {}
    for round_ in range(args.rounds):
        order = list(models)[round_ % len(models):] + list(models)[: round_ % len(models)]
        for name in order:
            seconds = []
            for _ in range(args.steps):
                elapsed, saved[name] = step(models[name])
                seconds.append(elapsed)
            times[name].append(statistics.fmean(seconds))
    base_bytes = saved["none"]
    rows = []
    for name in models:
        ratios = [mine / base for mine, base in zip(times[name], times["none"])]  # round by round
        rows.append({"recompute": name, "activation_bytes": saved[name], "activation_ratio": saved[name] / base_bytes,
                     "step_seconds": statistics.median(times[name]), "time_ratio": statistics.median(ratios),
                     "time_ratio_range": [min(ratios), max(ratios)]})
    print(json.dumps({"model": "GPT-2 small (124M)", "seq": args.seq, "batch": args.batch, "steps": args.steps,
                      "threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
