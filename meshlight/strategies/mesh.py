"""MeshStrategy: the Lightning strategy every meshlight strategy is a preset of.

It owns one :class:`~meshlight.parallel.ParallelLayout` and the device mesh built from it, starts the process group
under Lightning's launcher, ``torchrun`` or SLURM, parallelizes the model (:mod:`.parallel_model`), runs its steps
through one engine chosen at setup (:mod:`.step_engines`), shards the data by data-parallel rank, clips gradients by
the global norm and saves reshardable checkpoints (:mod:`.checkpointing`). The mechanics live in
:mod:`meshlight.parallel`; this file wires them into Lightning's hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.overrides.distributed import prepare_for_backward
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel
from torch.optim import Optimizer
from typing_extensions import override

from meshlight.nn.moe import attach_moe_updates
from meshlight.parallel.clip import clip_grad_norm_
from meshlight.parallel.compression import GradientCompression
from meshlight.parallel.context import ATTENTION_METHODS, ContextParallel
from meshlight.parallel.data_parallel import ddp_engine
from meshlight.parallel.expert import listed_expert_parameters
from meshlight.parallel.layout import ParallelLayout, Size, seed_by_mesh_position
from meshlight.parallel.nvme import OptimizerStateOnDisk, put_on_disk
from meshlight.parallel.offload import apart_from_host, prepare_host_steps
from meshlight.parallel.optimizers import adapt_optimizer
from meshlight.parallel.pipeline import SplitSpec, check_split, validate_schedule
from meshlight.parallel.tensor import explaining_tensor_parallel_errors
from meshlight.parallel.transforms import TensorParallelOptions, Transforms
from meshlight.strategies import lightning_internals as lightning
from meshlight.strategies.checkpointing import ShardedCheckpointing
from meshlight.strategies.collectives import DataParallelCollectives
from meshlight.strategies.environment import MeshEnvironment
from meshlight.strategies.loop_hooks import TrainingLoopHooks
from meshlight.strategies.metrics import count_metric_samples_once
from meshlight.strategies.parallel_model import MeshForwardRedirection, ParallelModel, parallel_model
from meshlight.strategies.pipeline_steps import PipelineOptions, PipelineSteps
from meshlight.strategies.precision import adapt_precision_plugin
from meshlight.strategies.step_engines import ContextParallelSteps, PipelineEngine, SpmdEngine, StepEngine

__all__ = ["MeshStrategy"]


class MeshStrategy(lightning.StrategyInternals, MeshEnvironment, TrainingLoopHooks, DataParallelCollectives,
                   ShardedCheckpointing):
    """Train on a mesh of ``dp_replicate × dp_shard × pp × cp × tp`` processes (one ``"auto"`` size fills the world).

    Args:
        dp_replicate, dp_shard, pp, tp, ep, zero, cp: the :class:`~meshlight.parallel.ParallelLayout`.
        experts: under tensor parallelism, where MoE layers' experts sit: ``"split"`` (each expert's hidden width
            split over the tp ranks; any ``ep``) or ``"fold"`` (whole experts; expert parallelism spans the tp ranks,
            ``ep`` a multiple of ``tp``); ``"auto"``: folded where ``ep`` is a multiple of ``tp``, else split. See
            :mod:`meshlight.parallel.expert_tensor`.
        cp_attention: under context parallelism (``cp > 1``), how attention sees the whole sequence:
            ``"allgather"`` (K/V all-gathered; any device) or ``"ring"`` (torch's ring attention; CUDA). See
            :mod:`meshlight.parallel.context`.
        tp_plan, sequence_parallel, loss_parallel: tensor parallelism (see :mod:`meshlight.parallel.tensor`):
            a dict of module-name patterns to roles replacing the automatic plan; sequence parallelism of
            norms and dropout between blocks; vocabulary-sharded logits for the loss while training.
        keep_gathered_inputs: under sequence parallelism, backward keeps the sequence-gathered inputs of the
            q/k/v and first MLP projections whole instead of this rank's share, gathered again (Megatron-LM's
            way, the default): 2·h more values per token and block at tp > 1, one all-gather fewer per group.
        schedule, microbatches, virtual_stages, split: pipeline parallelism (see
            :class:`~meshlight.strategies.PipelineStrategy`).
        ddp_kwargs: extra arguments for PyTorch DDP when ``zero=0`` (e.g. ``find_unused_parameters=True``).
        grad_compression: how gradients travel in the data-parallel reductions: ``"bf16"`` or ``"fp16"`` (half
            the bytes; every layout), ``"powersgd"`` or a :class:`~meshlight.parallel.GradientCompression` with its
            rank and warm-up (plain DDP only), or a torch DDP communication hook. See
            :mod:`meshlight.parallel.compression`.
        process_group_backend: ``"gloo"`` on CPU and ``"nccl"`` on CUDA unless given.
        timeout: collective timeout.
        gc_every_n_steps: while training, Python's automatic garbage collection is off and a young-generation
            collection runs every this many batches instead (and at the end), as torchtitan does:
            automatic collections triggered by the many small objects of DTensor dispatch and Lightning's loop
            cost several percent of a step (``benchmarks/overhead.py``). None keeps Python's automatic GC.

    The LightningModule can read the mesh as ``self.device_mesh`` (axes ``pp``, ``dp_replicate``,
    ``dp_shard``, ``cp``, ``tp`` and the flattened ``dp``) in ``configure_model``; if it applies data parallelism
    itself there, the strategy applies none. Callbacks that ask for transforms (recomputation, mixed precision,
    offload, compilation) are collected at setup (:class:`~meshlight.parallel.transforms.Transforms`).
    """

    strategy_name = "mesh"

    def __init__(
        self,
        *,
        dp_replicate: Size = "auto",
        dp_shard: Size = 1,
        pp: int = 1,
        tp: int = 1,
        ep: int = 1,
        zero: int = 0,
        cp: int = 1,
        experts: str = "auto",
        cp_attention: str = "allgather",
        tp_plan: Optional[Mapping[str, Union[str, ParallelStyle]]] = None,
        sequence_parallel: bool = True,
        loss_parallel: bool = True,
        keep_gathered_inputs: bool = False,
        schedule: str = "1f1b",
        microbatches: Optional[int] = None,
        virtual_stages: int = 1,
        split: SplitSpec = None,
        ddp_kwargs: Optional[dict[str, Any]] = None,
        grad_compression: Union[None, str, GradientCompression, Callable[..., Any]] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        gc_every_n_steps: Optional[int] = 50,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._sizes: dict[str, Any] = dict(dp_replicate=dp_replicate, dp_shard=dp_shard, pp=pp, tp=tp, ep=ep, zero=zero,
                                           cp=cp, experts=experts)
        if cp_attention not in ATTENTION_METHODS:
            raise ValueError(f"cp_attention={cp_attention!r}: choose one of {list(ATTENTION_METHODS)}.")
        self.cp_attention = cp_attention
        self._ddp_kwargs = ddp_kwargs or {}
        self.grad_compression = GradientCompression.of(grad_compression)
        _check_compression(self.grad_compression, zero, tp, pp)
        self.tensor_parallel = TensorParallelOptions(tp_plan, sequence_parallel, loss_parallel, keep_gathered_inputs)
        validate_schedule(schedule, pp if isinstance(pp, int) else 1, virtual_stages, microbatches or 1)
        self._pipeline_options = PipelineOptions(schedule, microbatches, virtual_stages, split)
        #: the transforms asked for by callbacks (and, for Hybrid3DStrategy, the planner), collected at setup
        self.transforms = Transforms()
        self._contexts = ExitStack()  # held from setup to teardown (loss parallelism)
        self._parallel: Optional[ParallelModel] = None
        self._engine: Optional[StepEngine] = None
        self._base_seed: Optional[int] = None
        self._process_group_backend = process_group_backend
        self.collect_garbage_every(gc_every_n_steps)
        self._timeout = timeout
        self._layout: Optional[ParallelLayout] = None
        self._state_on_disk: list[OptimizerStateOnDisk] = []  # Offload(optimizer="nvme")
        self._device_mesh: Optional[DeviceMesh] = None
        self.set_forward_redirection(MeshForwardRedirection())
        self.num_nodes = 1

    # ---------------------------------------------------------------- layout, mesh, ranks

    def _resolve_layout(self) -> Optional[ParallelLayout]:
        layout = super()._resolve_layout()
        if layout is not None:  # before any process starts: a split the pipeline cannot have
            options = self._pipeline_options
            check_split(options.split, layout.pp, options.virtual_stages)
        return layout

    @property
    def keep_gathered_inputs(self) -> bool:
        """Whether backward keeps the projections' sequence-gathered inputs whole (``Hybrid3DStrategy``'s
        ``"auto"`` is settled at fit start)."""
        return self.tensor_parallel.keep_gathered_inputs

    @property
    def pipeline(self) -> Optional[PipelineSteps]:
        """The steps runner on this rank's pipeline stages (None without pipeline parallelism, or before setup)."""
        return self._parallel.pipeline if self._parallel is not None else None

    # ---------------------------------------------------------------- model and optimizers

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.install_signals(trainer)
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.transforms = self.collect_transforms(trainer)
        self.model = self._parallelize().root
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        adapt_precision_plugin(self.precision_plugin, self.root_device.type, self.clip_grad_by_norm)
        if fitting and not (self.transforms.offload and self.transforms.offload.optimizer):
            lightning.optimizers_to_device(self.optimizers, self.root_device)
        if self.layout.tp > 1 and self.tensor_parallel.loss_parallel:
            # Cross-entropy on vocabulary-sharded logits, forward and backward (torch requires both inside).
            self._contexts.enter_context(loss_parallel())
        if self._base_seed is None:
            self._base_seed = torch.initial_seed()
        # Sequence parallelism over the blocks only leaves replicated activations outside them (dropout there must
        # match on every tp rank): the tp ranks share a stream then, and each block runs on one of its rank's own.
        region = self._parallel.sequence_region if self._parallel is not None else None
        separate = self.layout.tp > 1 and self.tensor_parallel.sequence_parallel and region is None
        seed_by_mesh_position(self.device_mesh, self._base_seed, separate_tensor_ranks=separate)
        count_metric_samples_once(self.lightning_module, self.device_mesh, self.pipeline)

    def collect_transforms(self, trainer: Trainer) -> Transforms:
        """The transforms the Trainer's callbacks ask for (a preset may add its own)."""
        return Transforms.collect(trainer.callbacks)

    def _parallelize(self) -> ParallelModel:
        """The LightningModule's parallelized model for this layout (built once) and the engine that runs its steps."""
        module = self.lightning_module
        assert module is not None
        self._parallel = parallel_model(module, self.layout, self.device_mesh, self.root_device, self.tensor_parallel,
                                        self.transforms, self._pipeline_options, self._ddp_kwargs,
                                        self.grad_compression)
        self._state_names = self._parallel.state_names
        partial = self.layout.tp > 1
        self._engine = (SpmdEngine(self, partial, self._parallel.root, self.layout.zero)
                        if self._parallel.pipeline is None else PipelineEngine(self, partial, self._parallel.pipeline))
        if self.layout.cp > 1:
            self._engine = ContextParallelSteps(self._engine, self._context_parallel(), module)
        return self._parallel

    def _context_parallel(self) -> ContextParallel:
        """The model's context-parallel hooks (made once per parallelized model)."""
        assert self._parallel is not None
        if self._parallel.context is None:
            context = ContextParallel(self.device_mesh["cp"], self.lightning_module, attention=self.cp_attention,
                                      device=self.root_device)
            for stage in self._parallel.pipeline.stage_modules if self._parallel.pipeline is not None else ():
                context.add_model(stage)
            self._parallel.context = context
        return self._parallel.context

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        self.reset_optimizers()  # those made for a previous setup (fit, then test) hold that setup's parameters
        super().setup_optimizers(trainer)
        self.optimizers = [adapt_optimizer(optimizer) for optimizer in self.optimizers]
        for optimizer in self.optimizers:  # MoE loads and expert biases, finished after each step of its optimizer
            attach_moe_updates(optimizer, self.model)
        offload = self.transforms.offload
        if offload and offload.optimizer and apart_from_host(self.root_device):  # the host steps them
            for note in prepare_host_steps(self.optimizers, self.num_processes):
                rank_zero_info(note)
        self._close_state_on_disk()  # a previous setup's (fit, then fit again)
        if offload and offload.nvme is not None:
            self._state_on_disk = put_on_disk(self.optimizers, offload.nvme, self.global_rank, self.num_processes,
                                              offload.nvme_chunk_bytes)

    def _close_state_on_disk(self) -> None:
        for state in self._state_on_disk:
            state.close()
        self._state_on_disk = []

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not any(p.is_meta for p in self.model.parameters()):  # meta: materialized stage by stage
            self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """With pipeline parallelism, modules built in ``configure_model`` land on the meta device: each rank
        materializes only the stages it owns."""
        if self.layout.pp == 1:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this for micro-batches that only accumulate gradients."""
        assert self._engine is not None
        with self._engine.accumulating():
            yield

    # ---------------------------------------------------------------- training loop: steps, signals, GC

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._explaining_errors():
            return self._engine.training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        with self._explaining_errors():
            return self._engine.backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("validation", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("predict", *args, **kwargs)

    def _evaluation_step(self, kind: str, *args: Any, **kwargs: Any) -> Any:
        self.agree_on_signals_in_evaluation()
        return self._engine.evaluation_step(kind, *args, **kwargs)

    def _explaining_errors(self) -> AbstractContextManager[None]:
        """Notes on what to change added to PyTorch's errors that tensor parallelism can cause."""
        return explaining_tensor_parallel_errors(self.layout.tp, self.tensor_parallel.loss_parallel)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        # Manual optimization runs backward inside the step, i.e. inside DDP's forward: prepare its reducer
        # here, as Lightning's own DDPStrategy does.
        ddp = ddp_engine(self.model) if self.model is not None else None
        if ddp is not None and not self.lightning_module.automatic_optimization:
            prepare_for_backward(ddp, closure_loss)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None,
                       **kwargs: Any) -> Any:
        return super().optimizer_step(optimizer, self._engine.optimizer_closure(closure, optimizer), model, **kwargs)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> Tensor:
        """Clip the optimizer's gradients by their norm over the whole model, however it is sharded."""
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        pipeline_group = self.device_mesh["pp"].get_group() if self.layout.pp > 1 else None
        uncounted = self.pipeline.tied_weights.last_stage_copies() if self.pipeline is not None else []
        held_alone = listed_expert_parameters(self.model) if self.layout.ep > 1 else []
        return clip_grad_norm_(parameters, clip_val, pipeline_group=pipeline_group, uncounted=uncounted,
                               expert_group=self.device_mesh["ep"].get_group() if held_alone else None,
                               held_alone=held_alone)

    @override
    def teardown(self) -> None:
        # Unlike Strategy.teardown, leave the parallelized module where it is (as Lightning's ModelParallelStrategy
        # does): its parameters are managed by DDP / FSDP2, and a later `trainer.test` reuses them.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.wait_for_checkpoint()  # a checkpoint still being written is finished and committed
        self._close_state_on_disk()
        self.stop_collecting_garbage()  # also after a failed fit
        self._contexts.close()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


def _check_compression(compression: Optional[GradientCompression], zero: Any, tp: Any, pp: Any) -> None:
    """A DDP communication hook asked for where the layout's given sizes put data parallelism on FSDP2 is refused
    at once (what callbacks add, mixed precision or offload, is checked when the model is parallelized)."""
    if compression is None or not compression.ddp_only:
        return
    on_fsdp = [f"{name}={value}" for name, value in (("zero", zero), ("tp", tp), ("pp", pp))
               if isinstance(value, int) and value > (0 if name == "zero" else 1)]
    if on_fsdp:
        raise ValueError(
            f"grad_compression={compression.kind!r} is a DDP communication hook, and {', '.join(on_fsdp)} reduces"
            " gradients with FSDP2: use grad_compression='bf16' (or 'fp16') there, or strategy='ddp' for PowerSGD."
        )
