"""TrainingMonitor and ProfileSteps: what users look for in TensorBoard besides the loss."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from torch.utils._pytree import tree_leaves

from meshlight.callbacks.figures import can_draw, figure_image, timeline_figure
from meshlight.callbacks.pipeline_timeline import pipeline_bubble, render_timeline
from meshlight.strategies.hybrid import Hybrid3DStrategy
from meshlight.strategies.mesh import MeshStrategy
from meshlight.strategies.pipeline_steps import PipelineSteps

__all__ = ["ProfileSteps", "TrainingMonitor"]


class TrainingMonitor(Callback):
    """Logs, every ``log_every_n_steps`` optimizer steps: ``perf/step_seconds`` (wall time of the last step),
    ``perf/tokens_per_second`` (all ranks), ``perf/tokens_per_second_per_device``, ``perf/mfu`` (model FLOPs per
    token × tokens/s per device ÷ the device's dense peak, torchtitan's convention), and
    ``memory/peak_bytes/rank<r>`` for every rank (CUDA: ``max_memory_allocated``; CPU: the process's peak
    resident memory). At the start it writes the layout (and the planner's estimates, when it chose
    or checked it) as text. Under pipeline parallelism it records optimizer step ``timeline_step``: the image
    ``pipeline/timeline`` shows, per rank (rows, rank 0 on top), when each stage ran forward (blue), backward
    (orange) and weight gradients (green) — grey is idle — and ``pipeline/bubble`` is the idle share of the step.

    Tokens are the elements of the first tensor of each batch, summed over micro-batches and data-parallel
    replicas; FLOPs per token come from the model's own ``flops_per_token()`` when it has one (meshlight's GPT),
    else from its shape (:mod:`meshlight.parallel.planner`), the peak from the device the strategy planned for
    (``Hybrid3DStrategy(hardware=...)``), else the detected one — or pass
    ``flops_per_token`` / ``peak_flops``.
    """

    def __init__(self, log_every_n_steps: Optional[int] = None, flops_per_token: Optional[float] = None,
                 peak_flops: Optional[float] = None, timeline_step: Optional[int] = 5) -> None:
        self.log_every_n_steps = log_every_n_steps
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.timeline_step = timeline_step
        self._timeline_started: Optional[float] = None
        self._tokens = 0
        self._step_started: Optional[float] = None
        self._last_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from meshlight.parallel.planner import PlanError, detect_hardware, format_plan, model_spec_of

        strategy = trainer.strategy
        if self.flops_per_token is None:  # the model's own count (meshlight's GPT has one), else the planner's
            own = next((m.flops_per_token for m in pl_module.modules() if callable(getattr(m, "flops_per_token",
                                                                                              None))), None)
            try:
                self.flops_per_token = float(own()) if own is not None else model_spec_of(pl_module).flops_per_token()
            except (PlanError, ValueError):
                self.flops_per_token = 0.0
        if self.peak_flops is None:  # the device the strategy planned for, else the one detected
            hardware = strategy.hardware if isinstance(strategy, Hybrid3DStrategy) else None
            hardware = hardware or detect_hardware(strategy.root_device,
                                                   max(getattr(strategy, "num_processes", 1), 1))
            self.peak_flops = hardware.peak_flops
        text = strategy.layout.describe() if isinstance(strategy, MeshStrategy) else type(strategy).__name__
        plan = strategy.plan if isinstance(strategy, Hybrid3DStrategy) else None
        if plan:
            text += "\n\n    " + format_plan(plan).replace("\n", "\n    ")  # indented: a code block in Markdown
        for logger in _tensorboards(trainer):
            logger.experiment.add_text("meshlight/layout", text, global_step=trainer.global_step)
        self._step_started, self._last_step = time.perf_counter(), trainer.global_step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        pipeline = _pipeline(trainer)
        if pipeline is not None and trainer.global_step == self.timeline_step and self._timeline_started is None:
            trainer.strategy.barrier()  # every rank's clock starts together
            self._timeline_started = time.perf_counter()
            pipeline.timeline = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        pipeline = _pipeline(trainer)
        if pipeline is not None and pipeline.timeline is not None:
            self._log_timeline(trainer, pipeline)
        tensors = [leaf for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor)]
        self._tokens += tensors[0].numel() if tensors else 0
        if trainer.global_step == self._last_step:
            return  # accumulating: the optimizer step is not done yet
        now = time.perf_counter()
        seconds, tokens = now - (self._step_started or now), self._tokens
        self._step_started, self._tokens, self._last_step = now, 0, trainer.global_step
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if trainer.global_step % every:
            return
        strategy = trainer.strategy
        replicas = getattr(strategy, "distributed_sampler_kwargs", {}).get("num_replicas", 1)
        world = trainer.world_size
        throughput = tokens * replicas / seconds if seconds > 0 else 0.0
        metrics = {"perf/step_seconds": seconds, "perf/tokens_per_second": throughput,
                   "perf/tokens_per_second_per_device": throughput / world}
        if self.flops_per_token and self.peak_flops:
            metrics["perf/mfu"] = throughput / world * self.flops_per_token / self.peak_flops
        for rank, peak in enumerate(_peak_memory_per_rank(strategy.root_device)):
            metrics[f"memory/peak_bytes/rank{rank}"] = peak
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _log_timeline(self, trainer: pl.Trainer, pipeline: Any) -> None:
        """The recorded batch's stage compute per rank, as an image and the bubble (collective)."""
        assert self._timeline_started is not None
        trainer.strategy.barrier()  # the step ends when the last rank is done
        seconds = time.perf_counter() - self._timeline_started
        start = self._timeline_started
        events = [(kind, stage, microbatch, begin - start, end - start)
                  for kind, stage, microbatch, begin, end in pipeline.timeline]
        pipeline.timeline = None
        ranks = [None] * trainer.world_size
        dist.all_gather_object(ranks, events)
        bubble = pipeline_bubble(ranks, seconds)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({"pipeline/bubble": bubble}, step=self.timeline_step)
        loggers = _tensorboards(trainer)
        if loggers:
            if can_draw():
                image = figure_image(timeline_figure(ranks, seconds, step=self.timeline_step, bubble=bubble,
                                                     schedule=pipeline.schedule_name))
            else:
                image = render_timeline(ranks, seconds)
                rank_zero_info("meshlight: pip install meshlight[plots] (matplotlib) labels the pipeline timeline.")
            for logger in loggers:
                logger.experiment.add_image("pipeline/timeline", image, self.timeline_step, dataformats="HWC")


class ProfileSteps(Callback):
    """Record a ``torch.profiler`` trace of the optimizer steps in ``steps`` (e.g. ``range(10, 13)``) into
    ``<log dir>/profile`` (or ``dirpath``), one file per rank, viewable in TensorBoard's profiler plugin
    (``pip install torch-tb-profiler``) or in Perfetto / chrome://tracing."""

    def __init__(self, steps: Iterable[int] = range(5, 8), dirpath: Optional[str] = None) -> None:
        self.steps = sorted(set(steps))
        if not self.steps or self.steps[0] < 0:
            raise ValueError(f"steps={steps!r}: give one or more optimizer steps >= 0.")
        self.dirpath = dirpath
        self.trace_dir: Optional[Path] = None
        self._profiler: Optional[torch.profiler.profile] = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._profiler is None and trainer.global_step == self.steps[0]:
            log_dir = trainer.log_dir or trainer.default_root_dir
            self.trace_dir = Path(self.dirpath or Path(log_dir) / "profile")
            activities = [torch.profiler.ProfilerActivity.CPU]
            if trainer.strategy.root_device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            worker = f"rank{trainer.global_rank}"
            self._profiler = torch.profiler.profile(
                activities=activities, record_shapes=True, profile_memory=True,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(str(self.trace_dir), worker_name=worker))
            self._profiler.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._profiler is not None and trainer.global_step > self.steps[-1]:
            self._stop()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler = None


def _pipeline(trainer: pl.Trainer) -> Optional[PipelineSteps]:
    """The pipeline steps of a meshlight strategy that pipelines (None otherwise)."""
    return trainer.strategy.pipeline if isinstance(trainer.strategy, MeshStrategy) else None


def _tensorboards(trainer: pl.Trainer) -> list[TensorBoardLogger]:
    if not trainer.is_global_zero:
        return []
    return [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]


def _peak_memory_per_rank(device: torch.device) -> list[float]:
    """Every rank's peak memory in bytes (a collective when distributed)."""
    if device.type == "cuda":
        peak = float(torch.cuda.max_memory_allocated(device))
    else:
        import resource

        peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # kilobytes on Linux
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [peak]
    local = torch.tensor([peak], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)  # all_gather_into_tensor is deprecated in torch 2.13, its successor new
    return torch.cat(gathered).tolist()
