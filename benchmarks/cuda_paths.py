"""The code paths that only run on CUDA, exercised on one GPU: fp16 loss scaling (``MixedPrecision("fp16")``: scaled
backward, unscaling, skipped steps on overflow) and ``Offload`` (optimizer state and fp32 shards in pinned host
memory, copied on their own CUDA streams; activations of every block offloaded and brought back in backward).

A GPT (4 blocks, 512 wide, sequence 512, batch 8) trains 30 steps on the addition data through ``meshlight.Trainer``
on one device (meshlight's ``"ddp"``, a mesh of one process), in fp32, under fp16 loss scaling, and with each
offload; reported per run: the losses at steps 1, 10 and 30 and their largest relative difference from the fp32
run's, the steps the scaler skipped, the peak GPU memory and the mean step time after 5 warm-up steps.

    python benchmarks/cuda_paths.py            # on a CUDA machine; prints JSON
    python benchmarks/cuda_paths.py --cpu      # the same code on CPU (128 wide and long), without the CUDA-only runs
"""

from __future__ import annotations

import argparse
import json
import time


def run(name: str, callbacks: list, device: str, steps: int) -> dict:
    import lightning.pytorch as pl
    import torch

    import meshlight as ml
    from meshlight.demos import AdditionDataModule, LitGPT
    from meshlight.models import GPTConfig

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.losses, self.starts, self.skipped = {}, [], 0

        def on_train_batch_start(self, *args: object) -> None:
            self.starts.append(time.perf_counter())

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            self.losses[trainer.global_step] = float(trainer.callback_metrics["train/loss"])

    pl.seed_everything(0, verbose=False)
    probe = Probe()
    # on CPU (the smoke test: the code, not its figures) a quarter as wide and as long
    width = 512 if device == "cuda" else 128
    config = GPTConfig(vocab_size=AdditionDataModule.vocab_size, max_seq_len=width, n_layers=4, dim=width, n_heads=8)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = ml.Trainer(strategy="ddp", accelerator=device, devices=1, max_steps=steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         limit_val_batches=0, callbacks=[probe, *callbacks])
    data = AdditionDataModule(3, batch_size=8, train_size=8 * steps, pad_to_multiple_of=width)
    trainer.fit(LitGPT(config, lr=3e-3, warmup_steps=2), data)
    times = [b - a for a, b in zip(probe.starts[5:], probe.starts[6:])]
    scaler = getattr(trainer.strategy.precision_plugin, "scaler", None)
    return {"run": name, "losses": probe.losses, "step_seconds": sum(times) / max(len(times), 1),
            "peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
            "fp16_scale": float(scaler.get_scale()) if scaler is not None else None,
            "steps_taken": trainer.global_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    import torch

    from meshlight.callbacks import MixedPrecision, Offload

    device = "cpu" if args.cpu else "cuda"
    runs = {"fp32": []}
    if device == "cuda":
        runs.update({"fp16": [MixedPrecision("fp16")], "offload optimizer": [Offload()],
                     "offload activations": [Offload(optimizer=False, activations_every_n_blocks=1)]})
    results = []
    for name, callbacks in runs.items():
        try:
            results.append(run(name, callbacks, device, args.steps))
        except Exception as error:  # noqa: BLE001 - what failed is the result
            results.append({"run": name, "error": f"{type(error).__name__}: {str(error)[:500]}"})
    reference = results[0].get("losses", {})
    for row in results:
        if "losses" in row and reference:
            row["max_relative_loss_difference"] = max(abs(row["losses"][s] - reference[s]) / reference[s]
                                                      for s in reference if s in row["losses"])
            row["losses"] = {s: row["losses"][s] for s in (1, 10, args.steps) if s in row["losses"]}
    print(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                      "torch": torch.__version__, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
