"""torchrun worker: the parity experiment under MixedPrecision — on 2 processes for each kind of layout, plus fp16
overflow handling; on 4 under pp=2 × tp=2 — rank 0 writes {run: result} to OUT (losses, full weights, the dtypes
seen in forward, loss scales and which steps changed the weights).
"""

import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision
from torch import nn
from torch.distributed.tensor import DTensor

import meshlight as ml
from meshlight.callbacks import MixedPrecision
from meshlight.nn.experts import Router
from meshlight.parallel.precision import is_norm
from tests.strategies.parity import train
from tests.strategies.workers.hybrid_worker import moe_gpt4


class Probe(Callback):
    """On the first batch: the (input dtype, weight dtype) each Linear, norm and router sees in forward, and the
    whole gradients the optimizer is given (after the loss scale is divided out); after every step: the loss scale,
    whether the weights changed, whether every rank's weights are finite, and the dtypes of the stored weights and
    gradients."""

    def __init__(self, inject_inf_at: int = -1) -> None:
        self.seen: dict[str, set[tuple[str, str]]] = {}
        self.scales: list[float] = []
        self.changed: list[bool] = []
        self.stored: set[str] = set()
        self.finite: list[bool] = []  # after each step, on every rank
        self.gradients: dict[str, torch.Tensor] = {}  # at the first step, whole, from every rank (on rank 0)
        self.inject_inf_at = inject_inf_at
        self._handles: list[Any] = []
        self._forwards: dict[type, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        for sub in module.modules():
            if isinstance(sub, nn.Linear):
                self._handles.append(sub.register_forward_pre_hook(lambda sub, args: self._record("linear", sub, args)))
            elif (isinstance(sub, Router) or is_norm(sub)) and type(sub) not in self._forwards:
                # what the class's forward computes with: mixed precision casts fp32 modules' inputs inside
                # their forward (meshlight.parallel.precision.keep_fp32), after any pre-hook
                kind, cls = "router" if isinstance(sub, Router) else "norm", type(sub)
                self._forwards[cls] = original = cls.forward

                def forward(sub: nn.Module, *args: Any, kind: str = kind, original: Any = original,
                            **kwargs: Any) -> Any:
                    self._record(kind, sub, args)
                    return original(sub, *args, **kwargs)

                cls.forward = forward

    def _record(self, kind: str, sub: nn.Module, args: tuple) -> None:
        weight = next(sub.parameters())
        self.seen.setdefault(kind, set()).add((str(args[0].dtype), str(weight.dtype)))

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self._before = [_local(p).clone() for p in module.parameters()]

    def on_after_backward(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.global_step == self.inject_inf_at and dist.get_rank() == 1:  # one rank's shard overflows
            grad = next(p.grad for p in module.parameters() if p.grad is not None)
            _local(grad).view(-1)[0] = float("inf")

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step != 0 or self.gradients:
            return
        local = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().float().cpu()
                 for name, p in module.named_parameters() if p.grad is not None}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)  # pipeline stages hold different parameters
        self.gradients = {name: grad for part in gathered for name, grad in part.items()}

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        for handle in self._handles:
            handle.remove()
        for cls, original in self._forwards.items():
            cls.forward = original
        self._handles, self._forwards = [], {}
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scales.append(scaler.get_scale() if scaler is not None else 0.0)
        self.changed.append(any(not torch.equal(_local(p), b) for p, b in zip(module.parameters(), self._before)))
        finite = torch.tensor(float(all(torch.isfinite(_local(p)).all() for p in module.parameters())))
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # every rank's shards and stages
        self.finite.append(bool(finite))
        self.stored |= {f"{_local(p).dtype}/{_local(p.grad).dtype if p.grad is not None else None}"
                        for p in module.parameters()}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def run(strategy: Any, precision: Any, probe: Probe = None, **options: Any) -> dict[str, Any]:
    probe = probe or Probe()
    callbacks = [probe] + ([MixedPrecision(**precision)] if isinstance(precision, dict) else [])
    # Lightning's own flags; its fp16 plugin is passed as the plugin itself ("16-mixed" becomes bf16 on CPU)
    trainer_args = ({"plugins": [LightningMixedPrecision("16-mixed", "cpu")]} if precision == "16-mixed"
                    else {"precision": precision} if isinstance(precision, str) else {})
    result = train("adamw-3e-3", strategy, callbacks=callbacks, **{"devices": 2, **options, **trainer_args})
    result.pop("module")
    finite = len(probe.finite) == 20 and all(probe.finite)
    return {**result, "finite": finite, "seen": probe.seen, "scales": probe.scales, "changed": probe.changed,
            "stored": probe.stored, "gradients": probe.gradients}


def runs(world: int) -> dict[str, Any]:
    """{run: result} for this world size: 2 processes, each kind of layout; 4, pp=2 × tp=2."""
    if world == 4:
        def layout() -> ml.Hybrid3DStrategy:
            return ml.Hybrid3DStrategy(dp=1, pp=2, tp=2, ep=1, zero=1, microbatches=4)

        return {"fp32 3d": run(layout(), None, data_parallel=1, devices=4),
                "bf16 3d": run(layout(), {"dtype": "bf16"}, data_parallel=1, devices=4),
                "bf16-mixed 3d": run(layout(), "bf16-mixed", data_parallel=1, devices=4)}
    tp = ml.TensorParallelStrategy(tp=2)
    pipeline = ml.PipelineStrategy(pp=2, schedule="1f1b", microbatches=4)
    return {
        "fp32": run("zero2", None),
        "bf16 zero2": run("zero2", {"dtype": "bf16"}),
        "bf16 ddp": run("ddp", {"dtype": "bf16"}),
        "bf16 tp": run(tp, {"dtype": "bf16"}, data_parallel=1),
        "fp16 pipeline": run(pipeline, {"dtype": "fp16"}, data_parallel=1),
        # 2^24 overflows fp16 gradients: the first steps are skipped and the scale backs off
        "fp16 zero3 overflow": run("zero3", {"dtype": "fp16", "init_scale": 2.0**24}),
        # Lightning's own fp16 plugin (autocast); at step 3 only rank 1's gradient shard overflows
        "16-mixed zero2 inf": run("zero2", "16-mixed", Probe(inject_inf_at=3)),
        "moe fp32": run(ml.MoEStrategy(ep=2, zero=1), None, model=moe_gpt4),
        "moe bf16": run(ml.MoEStrategy(ep=2, zero=1), {"dtype": "bf16"}, model=moe_gpt4),
        # Lightning's flags: autocast over fp32 weights; bf16 weights
        "bf16-mixed tp": run(ml.TensorParallelStrategy(tp=2), "bf16-mixed", data_parallel=1),
        "bf16-mixed pipeline": run(ml.PipelineStrategy(pp=2, schedule="1f1b", microbatches=4), "bf16-mixed",
                                   data_parallel=1),
        "bf16-mixed moe": run(ml.MoEStrategy(ep=2, zero=1), "bf16-mixed", model=moe_gpt4),
        "bf16-true zero3": run("zero3", "bf16-true"),
    }


if __name__ == "__main__":
    results = runs(int(os.environ["WORLD_SIZE"]))
    if dist.get_rank() == 0:
        torch.save(results, sys.argv[1])
