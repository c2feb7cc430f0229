"""torchrun worker (2 processes): the parity experiment with and without Offload under zero2 (gradient clipping),
ddp (gradient accumulation) and a 2-stage pipeline, and with the optimizer state on disk (zero2, pipeline); saved
activations count as offloadable on CPU here, so the hooks run. "zero2 offload from an accelerator" runs as optimizer
offload from a GPU would: the host steps the optimizer, with torch's fused host kernel. Rank 0 writes {run: result}
to OUT (losses, full weights, whether FSDP offloads every unit, the activation bytes offloaded, the optimizer groups'
``fused`` flags, how many times each FSDP unit gathered its parameters, and what the state on disk read and wrote)."""

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

import meshlight as ml
import meshlight.parallel.offload as offload
import meshlight.strategies.mesh as mesh
from meshlight.callbacks import Offload
from tests.strategies.parity import train

offload._offloadable = lambda tensor: True  # no accelerator: exercise the hooks on host tensors


def run(variant: str, strategy: Any, callbacks: list, **options: Any) -> dict[str, Any]:
    gathers = Counter()  # FSDP unit (parameter group) -> times its sharded parameters were gathered
    to_unsharded = FSDPParamGroup._to_unsharded

    def counted(group: FSDPParamGroup) -> None:
        if not group.is_unsharded:
            gathers[id(group)] += 1
        to_unsharded(group)

    FSDPParamGroup._to_unsharded = counted
    try:
        result = train(variant, strategy, devices=2, callbacks=callbacks, **options)
    finally:
        FSDPParamGroup._to_unsharded = to_unsharded
    result["gathers"] = sorted(gathers.values())
    module = result.pop("module")
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    offloader = getattr(module.trainer.strategy.model, "_meshlight_offloader", None) or next(
        (m._meshlight_offloader for m in module.trainer.strategy.model.modules()
         if hasattr(m, "_meshlight_offloader")), None)
    result["offloaded_units"] = (len(units), sum(_offloads(m) for m in units))
    result["offloaded_bytes"] = offloader.offloaded_bytes if offloader else 0
    result["prefetches"] = offloader.prefetches if offloader else 0
    result["fused"] = [group["fused"] for optimizer in module.trainer.optimizers for group in optimizer.param_groups]
    return result


def run_from_accelerator(variant: str, strategy: Any, callbacks: list) -> dict[str, Any]:
    """``run`` as if the model's device were an accelerator whose optimizer offload leaves the step to the host."""
    mesh.apart_from_host = lambda device: True
    try:
        return run(variant, strategy, callbacks)
    finally:
        mesh.apart_from_host = offload.apart_from_host


class DiskTraffic(Callback):
    """The bytes the optimizer state on disk moved, and its files, at the end of training (before teardown)."""

    def __init__(self) -> None:
        self.read = self.written = 0
        self.files: list[str] = []

    def on_train_end(self, trainer: Any, *args: Any) -> None:
        states = trainer.strategy._state_on_disk
        for state in states:
            state.wait()  # the last step's chunks are written behind it
        self.read, self.written = sum(s.read_bytes for s in states), sum(s.written_bytes for s in states)
        self.files = sorted(str(f.relative_to(s.directory)) for s in states for f in s.directory.iterdir())


def on_disk(variant: str, strategy: Any, folder: Path, **options: Any) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    traffic = DiskTraffic()
    result = run(variant, strategy, [Offload("nvme", path=folder, nvme_chunk_mb=0.02), traffic], **options)
    result.update(disk_read=traffic.read, disk_written=traffic.written, files=traffic.files,
                  left_behind=sorted(str(f) for f in folder.rglob("*") if f.is_file()))
    return result


def _offloads(unit: FSDPModule) -> bool:
    group = unit._get_fsdp_state()._fsdp_param_group
    return group is not None and all(p.offload_to_cpu for p in group.fsdp_params)


if __name__ == "__main__":
    pipeline = ml.PipelineStrategy(pp=2, schedule="1f1b", microbatches=4)
    results = {
        "zero2": run("clip", "zero2", []),
        "zero2 offload": run("clip", "zero2", [Offload()]),
        "zero2 offload from an accelerator": run_from_accelerator("clip", "zero2", [Offload()]),
        "ddp": run("accumulate", "ddp", []),
        "ddp offload": run("accumulate", "ddp", [Offload(activations_every_n_blocks=1)]),
        "pipeline": run("adamw", pipeline, [], data_parallel=1),
        "pipeline offload": run("adamw", ml.PipelineStrategy(pp=2, schedule="1f1b", microbatches=4),
                                [Offload(activations_every_n_blocks=1)], data_parallel=1),
        # the optimizer state in files between steps, in chunks of 20 kB
        "zero2 offload nvme": on_disk("clip", "zero2", Path(sys.argv[1]).parent / "nvme-zero2"),
        "pipeline offload nvme": on_disk("adamw", ml.PipelineStrategy(pp=2, schedule="1f1b", microbatches=4),
                                         Path(sys.argv[1]).parent / "nvme-pipeline", data_parallel=1),
    }
    if dist.get_rank() == 0:
        torch.save(results, sys.argv[1])
