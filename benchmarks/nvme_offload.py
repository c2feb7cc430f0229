"""Optimizer state on disk: the process's peak resident memory and step time with ``Offload(optimizer="nvme")``
against ``Offload()`` (state in host memory), one process on CPU.

glibc's malloc keeps freed blocks of up to 32 MB in its heap by default, resident, which inflates both variants' peaks
by what the step frees and allocates again (see ``meshlight.parallel.nvme.return_large_blocks``): the first pair runs
both with large blocks mapped on their own, so that the fall is the state's; the second as users run them, the host
variant with glibc's defaults and the nvme variant with the setting the callback makes.

The model is ``--layers`` Linear layers of ``--width`` in a ModuleList (default 32 × 2048², 134M parameters: AdamW
keeps 1.07 GB of moments, 32 MB per layer: one chunk of the default 32 MB). Each variant trains ``--steps`` steps in a
fresh Python process; its peak resident set size (``ru_maxrss``) is read at the end, and the step time is the median
over the steps after the first. The files go to ``--path`` (default: a temporary folder). The fall in memory is what
the disk holds instead, page cache aside: the kernel's cache of the files is not the process's memory and is given
back under pressure.

    python benchmarks/nvme_offload.py [--path DIR] [--layers 32] [--width 2048] [--steps 5]    # prints JSON
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

VARIANTS = ("host", "nvme")
# Both variants with one glibc setting, so that the fall is the state's alone: large blocks mapped on their own (what
# Offload(optimizer="nvme") sets itself); and glibc's defaults for the host variant, as a run without it has them.
MALLOC = {"both with MALLOC_MMAP_THRESHOLD_=1 MiB": {"MALLOC_MMAP_THRESHOLD_": str(2**20)}, "glibc defaults": {}}


def worker(variant: str, path: str, layers: int, width: int, steps: int) -> dict[str, Any]:
    import resource
    import time

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import meshlight as ml
    from meshlight.callbacks import Offload

    class Wide(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            # blocks in a ModuleList: FSDP gathers one at a time, as for a transformer
            self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            (x,) = batch
            for layer in self.layers:
                x = layer(x)
            return x.square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class StepTimes(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.times.append(time.perf_counter() - self.start)

    torch.manual_seed(0)
    offload = Offload("nvme", path=path) if variant == "nvme" else Offload()
    times = StepTimes()
    trainer = ml.Trainer(strategy="ddp", devices=1, accelerator="cpu", max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[offload, times])
    module = Wide()
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(steps * 4, width)), batch_size=4))
    state = 2 * sum(p.numel() * 4 for p in module.parameters())
    return {"variant": variant, "parameters": sum(p.numel() for p in module.parameters()), "state_bytes": state,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "step_seconds": statistics.median(times.times[1:]), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", type=Path, help="folder for the state files (default: a temporary one)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(dir=args.path) as folder:
        for malloc, env in MALLOC.items():
            rows = []
            for variant in VARIANTS:
                done = subprocess.run([sys.executable, __file__, "--worker", variant, folder, str(args.layers),
                                       str(args.width), str(args.steps)], capture_output=True, text=True, check=True,
                                      env={**os.environ, **env})
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            host, nvme = rows
            fall = host["peak_rss_bytes"] - nvme["peak_rss_bytes"]
            results[malloc] = {"runs": rows, "rss_fall_bytes": fall, "rss_fall_over_state": fall / host["state_bytes"],
                               "step_time_nvme_over_host": nvme["step_seconds"] / host["step_seconds"]}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        variant, path, layers, width, steps = sys.argv[2:]
        print(json.dumps(worker(variant, path, int(layers), int(width), int(steps))))
    else:
        main()
