"""Expert balance on the demo task: max / mean expert load after training, with MoE's defaults and without parts.

The example's model (``examples/train_gpt.py``: 2 blocks, dim 128) with every feed-forward a mixture of 8
top-2 experts trains on the addition task for ``--steps`` steps, one process, global batch 64. The load of
an expert is the number of token assignments routed to it over the last ``--window`` steps (all layers
reported; the figure is the worst layer's max / mean, 1.0 being perfect balance; the mean over the window's
steps of each step's own max / mean is reported beside it). Variants: MoE's defaults (the aux loss per sequence,
coefficient 1e-2, and the expert bias moved in proportion to the load's error at 1e-2), nothing, each part alone,
the aux loss over the batch (``balance="global"``), and DeepSeek-V3's rule (sign steps, sigmoid scores). Routing is
chaotic — one seed's figure moves with the machine's float rounding — so each variant trains with ``--seeds`` seeds:
the defaults must keep every seed within ``DEFAULT_TARGET``. The runs are independent: ``--jobs`` processes (one per
CPU core by default, each with its share of the cores' threads) train them side by side.

    python benchmarks/balance.py [--steps 500] [--window 20] [--seeds 3] [--jobs 2]  # prints JSON
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
from concurrent.futures import ProcessPoolExecutor
from typing import Any

OFF = {"aux_loss_coeff": 0.0, "expert_bias_rate": 0.0}
VARIANTS = {  # options over MoEConfig's defaults
    "defaults": {},  # the aux loss per sequence (1e-2) and the proportional expert bias (1e-2)
    "no balancing": OFF,
    "aux loss alone (per sequence)": {"expert_bias_rate": 0.0},
    "aux loss alone (global)": {"expert_bias_rate": 0.0, "balance": "global"},
    "expert bias alone": {"aux_loss_coeff": 0.0},
    "defaults, aux loss global": {"balance": "global"},
    "expert bias, sign rule, sigmoid scores": {"aux_loss_coeff": 0.0, "score": "sigmoid", "expert_bias_update": "sign"},
}
#: the defaults must keep every seed's worst layer within this max / mean
DEFAULT_TARGET = 1.2


def train(options: dict[str, Any], steps: int, window: int, seed: int = 0) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback

    import meshlight as ml
    from meshlight.demos import AdditionDataModule, LitGPT
    from meshlight.models import GPTConfig
    from meshlight.nn import MoE, MoEConfig

    class LoadWindow(Callback):
        def __init__(self) -> None:
            self.tokens: dict[str, torch.Tensor] = {}
            self.step_imbalance: list[float] = []

        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
            if trainer.global_step > steps - window:
                for name, layer in module.named_modules():
                    if isinstance(layer, MoE):
                        self.tokens[name] = self.tokens.get(name, 0) + layer.last_step.tokens
                        self.step_imbalance.append(layer.last_step.imbalance)

    pl.seed_everything(seed, verbose=False)
    batch = 64
    data = AdditionDataModule(3, batch_size=batch, train_size=steps * batch)
    config = GPTConfig(vocab_size=data.vocab_size, max_seq_len=data.seq_len, n_layers=2, dim=128, n_heads=4,
                       moe=MoEConfig(num_experts=8, top_k=2, **options))
    module = LitGPT(config, lr=3e-3, weight_decay=0.0, warmup_steps=steps // 20)
    window_loads = LoadWindow()
    trainer = ml.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[window_loads])
    trainer.fit(module, data)
    imbalance = {name: float(t.max() / t.mean()) for name, t in window_loads.tokens.items()}
    step_imbalance = window_loads.step_imbalance
    return {"imbalance": imbalance, "worst": max(imbalance.values()),
            "mean_step_imbalance": sum(step_imbalance) / len(step_imbalance),
            "loads": {name: t.tolist() for name, t in window_loads.tokens.items()},
            "final_loss": float(trainer.callback_metrics["train/loss"])}


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs trained side by side")
    args = parser.parse_args()
    options = {name: VARIANTS[name] for name in args.variants}
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    with ProcessPoolExecutor(args.jobs, multiprocessing.get_context("spawn"), _set_threads, (threads,)) as pool:
        pending = {name: [pool.submit(train, options[name], args.steps, args.window, seed)
                          for seed in range(args.seeds)] for name in args.variants}
        rows = []
        for name, futures in pending.items():
            runs = [future.result() for future in futures]
            rows.append({"variant": name, "options": options[name], "steps": args.steps, "window": args.window,
                         "runs": runs, "worst_seed": max(run["worst"] for run in runs),
                         **{key: statistics.median(run[key] for run in runs)
                            for key in ("worst", "mean_step_imbalance", "final_loss")}})
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
