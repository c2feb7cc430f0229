"""Hybrid 3-D (4-D with experts) parallelism ("3d"): pipeline × tensor × expert × data parallel on one mesh,
with the sizes left open chosen by the layout planner."""

from __future__ import annotations

import functools
import math
from typing import Any, Literal, Optional, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.utils.data import DataLoader

from meshlight.parallel.activation_compression import ActivationCompressionPolicy
from meshlight.parallel.blocks import BlockSelection, repeated_blocks
from meshlight.parallel.cost_model import _schedule_of
from meshlight.parallel.dtensors import has_dtensor_parameters
from meshlight.parallel.expert import has_experts, is_stacked_experts, listed_experts, stacked_experts
from meshlight.parallel.expert_tensor import stacked_split_placements
from meshlight.parallel.layout import ParallelLayout, _check_size, _check_zero, _fix_hint, data_sizes
from meshlight.parallel.offload import OffloadPolicy, apart_from_host
from meshlight.parallel.parameter_adapters import parameter_adapters
from meshlight.parallel.pipeline import (
    PipelineError,
    SplitSpec,
    check_split,
    default_virtual_stages,
    find_pipelined_module,
    named_stages,
    stage_blocks_of,
)
from meshlight.parallel.planner import (
    Candidate,
    Hardware,
    ModelSpec,
    PlanError,
    detect_hardware,
    estimate,
    explain,
    format_plan,
    model_spec_of,
    more_devices_hint,
    nearest_fitting,
    plan,
    precision_bytes,
    same_devices_hint,
)
from meshlight.parallel.recompute import RecomputePolicy
from meshlight.parallel.tensor_plan import TensorParallelError, model_plan, whole_mixers
from meshlight.parallel.transforms import Transforms
from meshlight.strategies import lightning_internals as lightning
from meshlight.strategies.mesh import MeshStrategy
from meshlight.strategies.pipeline_steps import PipelineOptions, stage_plan

__all__ = ["Hybrid3DStrategy"]


class Hybrid3DStrategy(MeshStrategy):
    """Pipeline stages over ``pp`` ranks, each stage's matmuls split over ``tp`` ranks (with sequence
    parallelism), MoE experts over ``ep`` ranks, and data parallelism with ZeRO over the rest — one device mesh
    ``pp × dp × tp`` (tp innermost: the fastest links). On every stage (virtual stages included) the transforms
    run in the order pipeline split → tensor/sequence parallel → expert parallel → data parallel/ZeRO.

    Sizes left as ``None`` are chosen at fit start by the layout planner (:mod:`meshlight.parallel.planner`)
    from the model, the world size, the devices per node and the device's memory and peak throughput; it
    prints a table of the best candidates and why the winner won. ``Hybrid3DStrategy()`` (``strategy="3d"``)
    plans everything; ``Hybrid3DStrategy(tp=2)`` plans the rest around tp=2.

    Args:
        dp: data-parallel size; ``"auto"``: what the world leaves after ``pp × cp × tp`` (or the planner's choice).
        pp: pipeline stages; tp: tensor-parallel size; ep: expert-parallel size (borrowed from dp).
        experts: under tp, where MoE layers' experts sit: ``"split"`` over the tp ranks or ``"fold"``-ed into ep
            (see :class:`MeshStrategy`); ``None`` or ``"auto"``: the planner's choice (with every size given: folded
            where ``ep`` is a multiple of ``tp``).
        cp: context-parallel size: each sequence split over that many ranks (see
            :class:`~meshlight.strategies.ContextParallelStrategy`). Default 1: not split; ``None``: the planner's
            choice, which splits only sequences longer than 8,192 tokens.
        zero: ZeRO stage over the data-parallel ranks (0 = DDP); ``None``, like any size left out, is the
            planner's choice — so ``Hybrid3DStrategy(dp=2, pp=2, tp=2)`` still plans ``ep``, ``zero`` and,
            unless given, the schedule and the microbatches; give ``ep=1, zero=1`` as well to fix them.
        schedule, microbatches, virtual_stages: the pipeline schedule (see
            :class:`~meshlight.strategies.PipelineStrategy`); ``virtual_stages`` default: 1 for gpipe and
            1f1b, 2 for the interleaved and V schedules. Those given are what the planner estimates with.
        recompute: whether every block recomputes its activations in backward (what
            :class:`~meshlight.callbacks.ActivationCheckpointing` does); ``"auto"``: as the planner chose for
            the layout (it recomputes only where that is the fastest way to fit), or as an
            ``ActivationCheckpointing`` callback asks when the Trainer has one.
        sequence_parallel: tensor parallelism also splits norms and dropout along the sequence.
        keep_gathered_inputs: whether backward keeps the sequence-gathered inputs of the q/k/v and first MLP
            projections whole (see :class:`MeshStrategy`) or this rank's share, gathered again; ``"auto"``:
            kept when the planner estimates the layout still fits with them (one all-gather fewer per group),
            else gathered again; gathered again when the planner cannot read the model.
        hardware: the :class:`~meshlight.parallel.planner.Hardware` the planner assumes (default: detected); its
            bytes per parameter, activation value and value of state are the run's precision (Lightning's
            ``precision`` flag, or a :class:`~meshlight.callbacks.MixedPrecision` callback), and what an
            :class:`~meshlight.callbacks.Offload` callback moves to host memory is left out (on GPUs).
        seq_len: sequence length the planner assumes (default: the model config's).
        **kwargs: passed to :class:`MeshStrategy` (``tp_plan``, ``loss_parallel``, ``split``, …). ``split`` left out
            where the planner chooses the layout: it plans a pipeline's stages balanced by parameters (the default)
            and by block count, and runs the faster.

    ``Hybrid3DStrategy(dp=2, pp=2, tp=2)`` needs 8 processes: 2 replicas of a 2-stage pipeline whose stages
    are each split over 2 ranks.
    """

    strategy_name = "3d"

    def __init__(
        self,
        dp: Union[int, Literal["auto"], None] = "auto",
        pp: Optional[int] = None,
        tp: Optional[int] = None,
        ep: Optional[int] = None,
        zero: Optional[int] = None,
        *,
        cp: int = 1,
        experts: Optional[str] = None,
        schedule: Optional[str] = None,
        microbatches: Optional[int] = None,
        virtual_stages: Optional[int] = None,
        sequence_parallel: bool = True,
        keep_gathered_inputs: Union[bool, Literal["auto"]] = "auto",
        recompute: Union[bool, Literal["auto"]] = "auto",
        hardware: Optional[Hardware] = None,
        seq_len: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        self._requested = dict(dp=None if dp == "auto" else dp, pp=pp, tp=tp, ep=ep, zero=zero, cp=cp)
        for name, value in self._requested.items():
            if value is not None:
                _check_zero(value) if name == "zero" else _check_size(name, value)
        self._planning = any(v is None for k, v in self._requested.items() if k != "dp")
        self._experts_given = None if experts == "auto" else experts  # "auto": the planner's choice too
        self._hardware, self._seq_len = hardware, seq_len
        # a split naming the blocks where stages begin fixes pp × virtual stages; with pp given, a rank's stages follow
        split = kwargs.get("split")
        check_split(split, pp, virtual_stages)
        self._stages = named_stages(split)
        if self._stages is not None and pp is not None and virtual_stages is None:
            virtual_stages = self._stages // pp
        self._schedule_given, self._virtual_given = schedule, virtual_stages
        self._keep_gathered = keep_gathered_inputs
        if recompute not in (True, False, "auto"):
            raise ValueError(f"recompute={recompute!r}: give True, False or 'auto' (the planner's choice).")
        self._recompute = recompute
        self.plan: Optional[list[Candidate]] = None  # the planner's ranking, once it ran
        self.hardware: Optional[Hardware] = None  # the device it assumed, with the run's precision
        schedule = schedule or _schedule_of(virtual_stages or 1)
        zero = 1 if zero is None else zero
        sizes = data_sizes(dp, zero)  # by name: LightningCLI reads the keywords a subclass passes on
        super().__init__(dp_replicate=sizes["dp_replicate"], dp_shard=sizes["dp_shard"],
                         pp=pp or 1, tp=tp or 1, ep=ep or 1, zero=zero, cp=cp or 1,
                         experts=experts or "auto", schedule=schedule, microbatches=microbatches,
                         virtual_stages=_virtual_stages(schedule, pp or 1, virtual_stages),
                         sequence_parallel=sequence_parallel, keep_gathered_inputs=keep_gathered_inputs is True,
                         **kwargs)
        self._planned_recompute = recompute is True  # every block recomputes (True, or as the planner chose)

    def _resolve_layout(self) -> Optional[ParallelLayout]:
        if not self._planning:
            layout = super()._resolve_layout()
            if self.lightning_module is not None and self.plan is None:
                self._check_memory(layout)
            return layout
        if self.lightning_module is None:  # at Trainer construction: the planner waits for the model (fit start)
            self._check_given_sizes()
            return None
        if self.plan is None:
            self._choose_layout()
        return super()._resolve_layout()

    def _check_given_sizes(self) -> None:
        """Sizes given that cannot fill the world fail at once, before any process starts."""
        given = {k: v for k, v in self._requested.items() if k in ("dp", "pp", "cp", "tp") and v is not None}
        used = math.prod(given.values())
        sizes = " × ".join(f"{k}={v}" for k, v in given.items() if k != "cp" or v > 1)
        if len(given) == 4 and used != self.world_size:
            raise ValueError(f"{sizes} uses {used} processes but the world has {self.world_size}."
                             f" {_fix_hint(self.world_size, given['pp'], given['tp'], given['cp'])}")
        if given and self.world_size % used:
            raise ValueError(f"{sizes} does not divide the {self.world_size} processes of the world: give sizes whose"
                             f" product divides {self.world_size}, or run on a multiple of {used} processes.")

    def _check_memory(self, layout: ParallelLayout) -> None:
        """Sizes all given: refuse, before training, a layout the planner estimates will not fit in memory,
        naming the nearest layouts that do. Models or sizes the planner cannot read are left to the engines'
        own checks (they name the valid sizes)."""
        hardware = self._run_hardware()
        options = self._run_options(layout)
        batch = _replica_batch(self.lightning_module)
        if batch is None:  # a lower bound: refuse only what cannot fit even with the least batch
            batch = _least_batch(layout.pp, options["schedule"], options["virtual_stages"], options["microbatches"])
            rank_zero_info(_unknown_batch_notice(batch))
        self._asked_recompute()  # refuse conflicting requests even where the planner cannot read the model
        try:
            model = self._model_spec()
            self.plan = plan(model, hardware, self.world_size, local_batch=batch, dp=layout.dp, pp=layout.pp,
                             tp=layout.tp, ep=layout.ep, cp=layout.cp, zero=layout.zero, experts=layout.experts,
                             **{**self._pricing(), **options})
        except PlanError:
            return
        if not self.plan[0].fits:
            nearest = nearest_fitting(model, hardware, self.world_size, local_batch=batch,
                                      given={"dp": layout.dp, "pp": layout.pp, "tp": layout.tp, "cp": layout.cp})
            fixed = dict(dp=layout.dp, pp=layout.pp, tp=layout.tp, ep=layout.ep, cp=layout.cp, zero=layout.zero,
                         **options)
            if nearest:  # and what would fit as given
                remedy = " ".join(filter(None, ["Nearest layouts that fit: " + "; ".join(
                    c.describe() for c in nearest) + ".", self._what_would_fit(model, hardware, batch, fixed,
                                                                                elsewhere=False)]))
            else:
                remedy = "No layout of this world fits. " + self._what_would_fit(model, hardware, batch, fixed)
            raise PlanError(f"{layout.describe()} is not expected to fit {model.name} in {hardware.name} memory"
                            f" ({self.world_size} processes, batch {batch} per replica): {explain(self.plan)} {remedy}")
        self._settle(model, hardware, self.plan[0])

    def _what_would_fit(self, model: ModelSpec, hardware: Hardware, batch: int, fixed: dict[str, Any],
                        elsewhere: bool = True) -> str:
        """For a layout that does not fit: the changes that would make it fit on these devices — keeping the
        sizes and options the user ``fixed`` where one does, else in any layout — and, ``elsewhere``, how many
        devices it fits on as it is."""
        trainer = lightning.attached_trainer(self.lightning_module)
        hint = functools.partial(same_devices_hint, model, hardware, self.world_size, local_batch=batch,
                                 accumulating=getattr(trainer, "accumulate_grad_batches", 1),
                                 offload=apart_from_host(self.root_device))
        here = hint(fixed=fixed) if fixed else ""
        if not elsewhere:
            return here
        more = more_devices_hint(model, hardware, self.world_size, local_batch=batch)
        return " ".join(filter(None, (here or hint(), more)))

    def _run_hardware(self) -> Hardware:
        """The device the planner assumes (given, else detected), with the bytes this run's precision keeps per
        parameter, activation value and value of state, and what an ``Offload`` callback moves to host memory."""
        hardware = self._hardware or detect_hardware(self.root_device, self.num_processes)
        if hardware.host_threads is None:  # detected, or given without: the threads this run's host steps with
            hardware = hardware.replace(host_threads=torch.get_num_threads())
        asked = self._asked_transforms()
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        self.hardware = hardware.replace(
            **precision_bytes(precision, asked.precision.param_dtype if asked.precision else None),
            **_offloaded(asked.offload, self.lightning_module, self.root_device),
            **_compressed(asked.activation_compression, self.lightning_module),
            gradient_compression=self.grad_compression.ratio() if self.grad_compression else 1.0)
        return self.hardware

    def _asked_transforms(self) -> Transforms:
        """What the Trainer's callbacks ask for: the plan is made at fit start, before the strategy's setup."""
        trainer = lightning.attached_trainer(self.lightning_module)
        return Transforms.collect(trainer.callbacks if trainer is not None else ())

    def collect_transforms(self, trainer: Any) -> Transforms:
        transforms = super().collect_transforms(trainer)
        return transforms.replace(recompute=RecomputePolicy()) if self._planned_recompute else transforms

    def _model_spec(self) -> ModelSpec:
        model = model_spec_of(self.lightning_module, self._seq_len)
        return model.replace(keep_gathered_inputs=self._keep_gathered is True)

    def _run_options(self, layout: Optional[ParallelLayout] = None) -> dict[str, Any]:
        """What the planner takes as given instead of choosing: the pipeline schedule, virtual stages and
        microbatches given (for a ``layout`` given whole, those the strategy runs) and the recomputation asked for
        (a partial ``ActivationCheckpointing`` policy counts as full: the memory check refuses only what cannot
        fit)."""
        options = self._pipeline_options
        if layout is None:
            pipeline = dict(schedule=self._schedule_given, virtual_stages=self._virtual_given,
                            microbatches=options.microbatches)
        else:
            pipeline = dict(schedule=options.schedule, virtual_stages=options.virtual_stages,
                            microbatches=options.microbatches or layout.pp * options.virtual_stages)
        # a split naming where stages begin: its stages' blocks (which fix the stages in all)
        named = {"stage_blocks": self._stage_blocks(self._stages)} if self._stages is not None else {}
        return {**pipeline, **named, "recompute": self._asked_recompute()[0]}

    def _stage_blocks(self, stages: int) -> tuple[int, ...]:
        """The blocks of each of ``stages`` pipeline stages as this run's split gives them."""
        plan = stage_plan(self.lightning_module, stages, self._pipeline_options.split, probe=False)[2]
        return tuple(len(b) for b in plan.blocks)

    def _pricing(self, split: SplitSpec = None) -> dict[str, Any]:
        """What the planner prices each pipeline rank by, unless the options fix it (a named split): the blocks of
        its stages as a balanced ``split`` (default: this run's; by parameters where none is given, or a named split
        is left to the planner) gives them for each count of stages."""
        split = split or (None if self._stages is not None else self._pipeline_options.split) or "parameters"
        # (more stages than this model has blocks for: priced as even)
        return {"stage_blocks": stage_blocks_of(self.lightning_module, split)}

    def _asked_recompute(self) -> tuple[Optional[bool], bool]:
        """Whether recomputation was asked for (None: the planner chooses), by this strategy's ``recompute`` or an
        ``ActivationCheckpointing`` callback, and whether of every block."""
        asked = self._asked_transforms().recompute
        if asked and self._recompute != "auto":
            raise ValueError(f"Hybrid3DStrategy(recompute={self._recompute}) and an ActivationCheckpointing callback"
                             " both choose what to recompute: keep one of them.")
        if asked:
            return True, asked.every_n_blocks == 1 and not asked.module_types
        return None if self._recompute == "auto" else self._recompute, True

    def _settle(self, model: ModelSpec, hardware: Hardware, best: Candidate) -> None:
        """Apply what the planner chose for ``best`` beyond the sizes: recomputation, and whether the projections'
        gathered inputs are kept."""
        asked, every_block = self._asked_recompute()
        if asked is None and best.recompute:
            self._planned_recompute = True
            rank_zero_info("Every block recomputes its activations in backward, as planned for this layout"
                           " (recompute=False, or an ActivationCheckpointing callback, to choose otherwise).")
        # a callback recomputing some blocks keeps more than full recomputation: judge the gathered inputs without
        self._settle_gathered_inputs(model, hardware, best, best.recompute and every_block)

    def _settle_gathered_inputs(self, model: ModelSpec, hardware: Hardware, best: Candidate,
                                recompute: bool) -> None:
        """``keep_gathered_inputs="auto"``: keep the projections' gathered inputs when ``best`` (with
        ``recompute``) still fits with them — planned, like every layout, with them gathered again."""
        if self._keep_gathered != "auto" or best.tp == 1 or not self.tensor_parallel.sequence_parallel:
            return
        kept = estimate(model.replace(keep_gathered_inputs=True), hardware, self.world_size,
                        best.tokens_per_step // model.seq_len, best.dp, best.pp, best.tp, best.ep, best.zero,
                        best.microbatches, best.virtual_stages, recompute, best.schedule, best.cp, best.experts,
                        best.stage_blocks)
        self.tensor_parallel = self.tensor_parallel.replace(keep_gathered_inputs=kept.fits)
        rank_zero_info("Sequence-parallel projection inputs: "
                       + ("kept whole for backward (the layout fits with them)." if kept.fits else
                          f"gathered again in backward (kept whole: {kept.memory_bytes / 2**30:.1f} GiB of"
                          f" {kept.memory_limit / 2**30:.1f} GiB usable)."))

    def _unsplittable(self) -> dict[str, Any]:
        """Sizes the engines cannot give this model, fixed at 1 for the planner where not requested: tp where no
        tensor-parallel plan splits its blocks (fused projections), ep where it has no experts expert parallelism
        splits (experts its config counts, in modules it cannot split); and a model's own stacked experts in a
        layout that cannot be split over tp, and experts held as a list (litgpt's): tp=1 unless requested, and under
        a requested tp ``experts="fold"`` (or ep=1); sequence mixers every tp rank runs whole
        (:data:`~meshlight.parallel.model_shape.WHOLE_MIXERS`), which the cost model does not price: tp=1 unless
        requested; tp and ep where PEFT's LoRA adapts parameters in place other than stacked experts' (which the
        adapters follow as they are split: :func:`~meshlight.parallel.parameter_adapters.parameter_adapters`), which
        they would split but not the adapters; and pp where pipelining refuses the model's structure
        (:func:`~meshlight.parallel.pipeline.find_pipelined_module`: no container of blocks)."""
        fixed = {}
        if self._requested["pp"] is None:
            try:
                find_pipelined_module(self.lightning_module)
            except PipelineError as error:
                fixed["pp"] = 1
                rank_zero_info(f"Planning with pp=1: pipelining cannot split this model ({error})")
        if self._requested["tp"] is None and not has_dtensor_parameters(self.lightning_module):
            try:
                model_plan(self.lightning_module, self.tensor_parallel.plan)
            except TensorParallelError as error:
                fixed["tp"] = 1
                rank_zero_info(f"Planning with tp=1: tensor parallelism cannot split this model ({error})")
        if self._requested["ep"] is None and not has_experts(self.lightning_module):
            fixed["ep"] = 1
        adapted = [wrapper.get_base_layer() for _, wrapper in parameter_adapters(self.lightning_module)]
        if not all(map(is_stacked_experts, adapted)):  # tp and ep would split such parameters, not their adapters
            fixed.update({axis: 1 for axis in ("tp", "ep") if self._requested[axis] is None})
        if self._requested["tp"] is None and whole_mixers(self.lightning_module):
            # sequence mixers every tp rank runs whole (Qwen3.5's linear attention): not priced
            fixed["tp"] = 1
        if listed_experts(self.lightning_module) or any(stacked_split_placements(m) is None
                                                         for m in stacked_experts(self.lightning_module)):
            # experts split over tp only in a layout meshlight knows (not a list's); others are kept whole: on every
            # tp rank (ep=1), which the cost model does not price, or spread over the tp ranks by ep folded over them
            if self._requested["tp"] is None:
                fixed["tp"] = 1
            elif self._requested["tp"] > 1 and self._requested["ep"] != 1 and self._experts_given is None:
                fixed["experts"] = "fold"
        return fixed

    def _choose_layout(self) -> None:
        hardware = self._run_hardware()
        requested = {k: v for k, v in self._requested.items() if v is not None}
        try:
            model = self._model_spec()
        except PlanError as error:
            sizes = {"dp": "auto", "pp": 1, "tp": 1, "ep": 1, "zero": 1, **requested}
            example = ", ".join(f"{k}={v!r}" for k, v in sizes.items() if k != "cp" or v != 1)
            raise PlanError(f"{error} For example: Hybrid3DStrategy({example}).") from None
        requested.update(self._unsplittable())
        experts = requested.pop("experts", self._experts_given)
        fixed = {k: v for k, v in self._run_options().items() if v is not None}
        batch = _replica_batch(self.lightning_module)
        unknown = batch is None
        if unknown:
            batch = _least_batch(requested.get("pp"), fixed.get("schedule"), fixed.get("virtual_stages"),
                                 fixed.get("microbatches"))
        # no split given: a pipeline's blocks balanced by parameters (the default) or by count, whichever is faster
        choices = ("parameters", "layers") if self._pipeline_options.split is None and requested.get("pp") != 1 else (
            None,)
        plans = [(split, plan(model, hardware, self.world_size, local_batch=batch,
                              **{**self._pricing(split), **requested, **fixed}, experts=experts)) for split in choices]
        split, self.plan = min(plans, key=lambda option: (not option[1][0].fits,
                                                          -option[1][0].tokens_per_second_per_device))
        pricing = self._pricing(split)
        rank_zero_info(f"meshlight layout planner, {self.world_size} × {hardware.name}, {model.name}:\n"
                       + format_plan(self.plan) + (f"\n{_unknown_batch_notice(batch)}" if unknown else ""))
        best = self.plan[0]
        by_layers = split == "layers" and best.pp > 1
        if by_layers:
            other = plans[0][1][0]
            rank_zero_info(f"Pipeline stages split by block count (split=\"layers\"): {best.describe()} runs"
                           f" {best.tokens_per_second_per_device / other.tokens_per_second_per_device:.2f}× the"
                           f" tokens/s of the default split by parameters (best there: {other.describe()}).")
        if not best.fits:
            free = (plan(model, hardware, self.world_size, local_batch=batch, **pricing, **requested)[0] if fixed
                    else best)
            named = ", ".join("split" if option == "stage_blocks" else option for option in fixed)
            more = (f"It fits as {free.describe()}: leave {named} to the planner." if free.fits else
                    self._what_would_fit(model, hardware, batch, {**pricing, **requested, **fixed}))
            raise PlanError(f"No layout of {self.world_size} processes fits {model.name} in {hardware.name} memory. "
                            f"{explain(self.plan)} {more}")
        self._settle(model, hardware, best)
        self._sizes.update(data_sizes(best.dp, best.zero), pp=best.pp, tp=best.tp, ep=best.ep, zero=best.zero,
                           cp=best.cp, experts=best.strategy_arguments()["experts"])
        options = self._pipeline_options
        schedule = self._schedule_given or best.schedule
        self._pipeline_options = PipelineOptions(
            schedule, options.microbatches or (best.microbatches if best.pp > 1 else None),
            _virtual_stages(schedule, best.pp, self._virtual_given or best.virtual_stages),
            "layers" if by_layers else options.split)


def _offloaded(policy: Optional[OffloadPolicy], module: nn.Module, device: torch.device) -> dict[str, Any]:
    """:class:`Hardware`'s ``offload_optimizer`` and ``offload_activations`` for what ``policy`` moves out of
    ``device``'s memory: nothing where that is host memory (a CPU's); the share of ``module``'s repeated blocks
    whose activations it offloads."""
    if policy is None or not apart_from_host(device):
        return {}
    share = _block_share(policy.activations, module) if policy.activations is not None else 0.0
    return {"offload_optimizer": policy.optimizer, "offload_activations": share}


def _compressed(policy: Optional[ActivationCompressionPolicy], module: nn.Module) -> dict[str, Any]:
    """:class:`Hardware`'s ``compressed_activations`` and ``compressed_activation_bytes`` for ``policy``."""
    if policy is None:
        return {}
    return {"compressed_activations": _block_share(policy.blocks, module),
            "compressed_activation_bytes": policy.torch_dtype.itemsize}


def _block_share(selection: BlockSelection, module: nn.Module) -> float:
    """The share of ``module``'s repeated blocks that ``selection`` chooses."""
    chosen = {id(m) for m in selection.select(module)}
    blocks = repeated_blocks(module)
    return sum(id(block) in chosen for block in blocks) / len(blocks) if blocks else 0.0


def _virtual_stages(schedule: str, pp: int, given: Optional[int]) -> int:
    return given or (1 if pp == 1 else default_virtual_stages(schedule))


def _replica_batch(module: Any) -> Optional[int]:
    """Sequences per data replica per step, as the trainer's DataLoader will give them: a DataLoader passed to
    ``fit``, or a ``batch_size`` attribute or saved hyper-parameter of the DataModule or the LightningModule.
    None when none says: the layout is planned before the DataModule's ``setup`` and before any loader is made."""
    trainer = lightning.attached_trainer(module)
    source = lightning.fit_dataloader(trainer)
    datamodule = getattr(trainer, "datamodule", None)
    for holder in (source if isinstance(source, DataLoader) else None, datamodule,
                   getattr(datamodule, "hparams", None), module, getattr(module, "hparams", None)):
        size = getattr(holder, "batch_size", None)
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    return None


def _least_batch(pp: Optional[int], schedule: Optional[str], virtual_stages: Optional[int],
                 microbatches: Optional[int]) -> int:
    """The smallest batch per replica a layout with these pipeline settings runs: one sequence per microbatch."""
    if not pp or pp == 1:
        return 1
    return microbatches or pp * (virtual_stages or (default_virtual_stages(schedule) if schedule else 1))


def _unknown_batch_notice(batch: int) -> str:
    return (f"The batch per data replica is not known before the data is set up: planned with {batch} (the least"
            " the layout runs). Set `batch_size` on your DataModule or LightningModule (an attribute or a saved"
            " hyper-parameter), or pass a DataLoader to fit, to plan with yours.")
