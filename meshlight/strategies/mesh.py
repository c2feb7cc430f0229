"""MeshStrategy: the Lightning strategy every meshlight strategy is a preset of.

It owns one :class:`~meshlight.parallel.ParallelLayout` and the device mesh built from it, starts the
process group under Lightning's launcher, ``torchrun`` or SLURM, applies the parallel transforms, shards
the data by data-parallel rank, clips gradients by the global norm and saves reshardable checkpoints.
The mechanics live in :mod:`meshlight.parallel`; this file wires them into Lightning's hooks.
"""

from __future__ import annotations

import atexit
import warnings
from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states, reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.overrides.distributed import prepare_for_backward
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler
from torchmetrics import Metric
from typing_extensions import override

from meshlight.parallel.blocks import BlockSelection
from meshlight.parallel.checkpoint import (
    OPTIMIZER_STATE,
    AsyncCheckpointWriter,
    load_checkpoint,
    load_rng_state,
    save_checkpoint,
)
from meshlight.parallel.clip import clip_grad_norm_
from meshlight.parallel.compile import CompilePolicy
from meshlight.parallel.data_parallel import ddp_engine, gradient_accumulation
from meshlight.parallel.layout import ParallelLayout, Size, axis, build_device_mesh, seed_by_mesh_position
from meshlight.parallel.offload import OffloadPolicy, apart_from_host, prepare_host_steps
from meshlight.parallel.optimizers import adapt_optimizer
from meshlight.parallel.parallelize import parallelize
from meshlight.parallel.pipeline import SplitSpec, find_pipelined_module, validate_schedule
from meshlight.parallel.precision import MeshGradScaler, PrecisionPolicy
from meshlight.parallel.sampling import ResumableSampler
from meshlight.parallel.tensor import explaining_tensor_parallel_errors, reduce_partial_gradients
from meshlight.parallel.tensor_plan import model_plan, sequence_region, stage_plan
from meshlight.strategies.garbage_collection import TrainingGarbageCollection
from meshlight.strategies.launcher import ForkingScriptLauncher
from meshlight.strategies.pipeline_steps import PipelineOptions, PipelineSteps, setup_pipeline
from meshlight.strategies.preemption import AgreedSignals, newest_whole_hpc_checkpoint
from meshlight.strategies.process_group import all_reduce_in_place, connect, let_collective_threads_finish
from meshlight.strategies.step_runner import RUNNERS, MeshForwardRedirection, StepRunner

__all__ = ["MeshStrategy"]


class MeshStrategy(ParallelStrategy):
    """Train on a mesh of ``dp_replicate × dp_shard × pp × tp`` processes (one ``"auto"`` size fills the world).

    Args:
        dp_replicate, dp_shard, pp, tp, ep, zero: the :class:`~meshlight.parallel.ParallelLayout`.
        tp_plan, sequence_parallel, loss_parallel: tensor parallelism (see :mod:`meshlight.parallel.tensor`):
            a dict of module-name patterns to roles replacing the automatic plan; sequence parallelism of
            norms and dropout between blocks; vocabulary-sharded logits for the loss while training.
        keep_gathered_inputs: under sequence parallelism, backward keeps the sequence-gathered inputs of the
            q/k/v and first MLP projections whole instead of this rank's share, gathered again (Megatron-LM's
            way, the default): 2·h more values per token and block at tp > 1, one all-gather fewer per group.
        schedule, microbatches, virtual_stages, split: pipeline parallelism (see
            :class:`~meshlight.strategies.PipelineStrategy`).
        ddp_kwargs: extra arguments for PyTorch DDP when ``zero=0`` (e.g. ``find_unused_parameters=True``).
        process_group_backend: ``"gloo"`` on CPU and ``"nccl"`` on CUDA unless given.
        timeout: collective timeout.
        gc_every_n_steps: while training, Python's automatic garbage collection is off and a young-generation
            collection runs every this many batches instead (and at the end), as torchtitan does:
            automatic collections triggered by the many small objects of DTensor dispatch and Lightning's loop
            cost several percent of a step (``benchmarks/overhead.py``). None keeps Python's automatic GC.

    The LightningModule can read the mesh as ``self.device_mesh`` (axes ``pp``, ``dp_replicate``,
    ``dp_shard``, ``tp`` and the flattened ``dp``) in ``configure_model``; if it applies data parallelism
    itself there, the strategy applies none.
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
        tp_plan: Optional[Mapping[str, Union[str, ParallelStyle]]] = None,
        sequence_parallel: bool = True,
        loss_parallel: bool = True,
        keep_gathered_inputs: bool = False,
        schedule: str = "1f1b",
        microbatches: Optional[int] = None,
        virtual_stages: int = 1,
        split: SplitSpec = None,
        ddp_kwargs: Optional[dict[str, Any]] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        gc_every_n_steps: Optional[int] = 50,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._sizes: dict[str, Any] = dict(dp_replicate=dp_replicate, dp_shard=dp_shard, pp=pp, tp=tp, ep=ep, zero=zero)
        self._ddp_kwargs = ddp_kwargs or {}
        self._tensor_parallel = dict(tp_plan=tp_plan, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                                     keep_gathered_inputs=keep_gathered_inputs)
        self._contexts = ExitStack()  # held from setup to teardown (loss parallelism)
        validate_schedule(schedule, pp if isinstance(pp, int) else 1, virtual_stages, microbatches or 1)
        self._pipeline_options = PipelineOptions(schedule, microbatches, virtual_stages, split)
        self._pipeline: Optional[PipelineSteps] = None
        self._metric_group: Optional[dist.ProcessGroup] = None
        self._base_seed: Optional[int] = None
        self._process_group_backend = process_group_backend
        self._gc = TrainingGarbageCollection(gc_every_n_steps)
        self._timeout = timeout
        self._layout: Optional[ParallelLayout] = None
        self._device_mesh: Optional[DeviceMesh] = None
        self._forward_redirection = MeshForwardRedirection()
        self._checkpoint_writer: Optional[AsyncCheckpointWriter] = None
        self._signals: Optional[AgreedSignals] = None  # SIGTERM, SLURM's requeue: every rank at the same step
        #: blocks to recompute in backward, set by the ActivationCheckpointing callback before the model is
        #: parallelized (applied after tensor/expert parallelism, before data parallelism, on every stage)
        self.recompute: Optional[BlockSelection] = None
        #: low-precision parameters and compute, set by the MixedPrecision callback before parallelizing
        self.mixed_precision: Optional[PrecisionPolicy] = None
        #: optimizer state and chosen activations in host memory, set by the Offload callback
        self.offload: Optional[OffloadPolicy] = None
        #: blocks to compile with torch.compile, set by the Compile callback
        self.compile: Optional[CompilePolicy] = None
        self.num_nodes = 1

    # ---------------------------------------------------------------- layout, mesh, ranks

    @property
    def layout(self) -> ParallelLayout:
        if self._layout is None:
            raise RuntimeError("The layout is known once the Trainer knows the world size: create the Trainer first.")
        return self._layout

    @property
    def keep_gathered_inputs(self) -> bool:
        """Whether backward keeps the projections' sequence-gathered inputs whole (``Hybrid3DStrategy``'s
        ``"auto"`` is settled at fit start)."""
        return self._tensor_parallel["keep_gathered_inputs"]

    @property
    def pipeline(self) -> Optional[PipelineSteps]:
        """The steps runner on this rank's pipeline stages (None without pipeline parallelism, or before setup)."""
        return self._pipeline

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists once processes have started (from `setup_environment` on).")
        return self._device_mesh

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # Read by Lightning's connector: makes Lightning insert a DistributedSampler.
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Data is split by data-parallel rank: all ranks of one tensor/pipeline group read the same batch.
        dp_mesh = axis(self.device_mesh, "dp")
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # sharded states load into the parallelized model

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # optimizer states are restored with the model, resharded, in `load_checkpoint`

    def set_world_ranks(self) -> None:
        """Called by the Trainer at construction, before any process is launched: resolves the layout."""
        self._set_ranks()
        self._layout = self._resolve_layout()

    def _set_ranks(self) -> None:
        """This process's ranks, from its cluster environment (again in a rank the launcher forked)."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _resolve_layout(self) -> Optional[ParallelLayout]:
        """The layout for this world (None while it cannot be known yet: a planner waiting for the model)."""
        return ParallelLayout.for_world(self.world_size, **self._sizes)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = ForkingScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes, self.root_device, self._set_ranks
            )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        device_id = self.root_device if self.root_device.type != "cpu" else None
        assert self.cluster_environment is not None
        connect(self.cluster_environment, backend, self._timeout, device_id)
        atexit.register(let_collective_threads_finish)  # registering twice is harmless: one short sleep
        if self._device_mesh is None:  # once: `fit` then `test` reuse the mesh the model was parallelized on
            self._device_mesh = build_device_mesh(self.layout, self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        rank_zero_info(f"meshlight {type(self).__name__}: {self.layout.describe()} on {self.world_size} processes")

    # ---------------------------------------------------------------- model and optimizers

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self._signals = AgreedSignals.install(trainer)
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.model = self._setup_model(self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        scaler = getattr(self.precision_plugin, "scaler", None)
        if isinstance(scaler, torch.amp.GradScaler) and not isinstance(scaler, MeshGradScaler):
            # fp16 ("16-mixed"): every rank must see an overflow in any rank's gradient shard and skip that step.
            self.precision_plugin.scaler = MeshGradScaler.like(scaler, self.root_device.type)
        if trainer.state.fn == TrainerFn.FITTING and not (self.offload and self.offload.optimizer):
            _optimizers_to_device(self.optimizers, self.root_device)
        # Lightning clips through the precision plugin; route clipping by norm to the mesh-aware version.
        self.precision_plugin.clip_grad_by_norm = self.clip_grad_by_norm  # type: ignore[method-assign]
        if self.layout.tp > 1 and self._tensor_parallel["loss_parallel"]:
            # Cross-entropy on vocabulary-sharded logits, forward and backward (torch requires both inside).
            self._contexts.enter_context(loss_parallel())
        if self._base_seed is None:
            self._base_seed = torch.initial_seed()
        # Sequence parallelism over the blocks only leaves replicated activations outside them (dropout there must
        # match on every tp rank): the tp ranks share a stream then, and each block runs on one of its rank's own.
        region = getattr(self.model, "sequence_region", None)
        separate = self.layout.tp > 1 and self._tensor_parallel["sequence_parallel"] and region is None
        seed_by_mesh_position(self.device_mesh, self._base_seed, separate_tensor_ranks=separate)
        self._count_metric_samples_once()

    def _count_metric_samples_once(self) -> None:
        """torchmetrics reduce their states over every rank by default; the tensor-parallel ranks of a replica
        update theirs with the same batch, so counts (``SumMetric``, ``CatMetric``, …) would come out tp times
        too large. Metrics without their own ``process_group`` reduce over the ranks with this rank's
        tensor-parallel index instead: each sample once. Under pipelining only the last stage updates metrics
        (the other stages' empty states add nothing), so their torchmetrics warning that ``compute`` ran
        before ``update`` is expected there and silenced."""
        metrics = [m for m in self.lightning_module.modules() if isinstance(m, Metric) and m.process_group is None]
        if self._pipeline is not None and not self._pipeline.has_last:
            warnings.filterwarnings("ignore", message=r"The ``compute`` method of metric", category=UserWarning)
        if self.layout.tp == 1 or not metrics:
            return
        if self._metric_group is None:
            names = [name for name in self.device_mesh.mesh_dim_names if name != "tp"]
            self._metric_group = self.device_mesh[tuple(names)]._flatten("metrics").get_group()
        for metric in metrics:
            metric.process_group = self._metric_group

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Wrap the LightningModule in the root that carries the parallel hooks, parallelizing it once."""
        lightning_module = self.lightning_module
        assert lightning_module is not None
        runner = RUNNERS.get(lightning_module)
        if runner is None and self.layout.pp > 1:
            self._state_names = set(lightning_module.state_dict())  # before the split: the whole model's names
            # Tensor-parallel roles are planned on the whole model, before the split frees other stages' pieces.
            plan, region = self._tensor_plan(find_pipelined_module(lightning_module)[1])

            def parallelize_stage(stage: nn.Module, index: int) -> nn.Module:
                options = {**self._tensor_parallel, "tp_plan": stage_plan(plan, stage) if plan is not None else None}
                return parallelize(stage, self.layout, self.device_mesh, **options, **self._callback_transforms,
                                   later_stage=index > 0, sequence_region=region)

            self._pipeline, stages = setup_pipeline(
                lightning_module, self.layout, self.device_mesh, self._pipeline_options, self.root_device,
                parallelize_stage,
            )
            runner = StepRunner(stages, self.layout, self._pipeline, self._pipeline_options, region)
            RUNNERS[lightning_module] = runner
        elif runner is None:
            runner = StepRunner(lightning_module, self.layout)
            plan, runner.sequence_region = self._tensor_plan(runner)
            options = {**self._tensor_parallel, "tp_plan": plan or self._tensor_parallel["tp_plan"]}
            parallelize(runner, self.layout, self.device_mesh, ddp_kwargs=self._ddp_kwargs, **options,
                        **self._callback_transforms, sequence_region=runner.sequence_region)
            RUNNERS[lightning_module] = runner
        elif runner.layout != self.layout:
            raise RuntimeError(
                f"This {type(lightning_module).__name__} is already parallelized as {runner.layout.describe()}; it"
                f" cannot also run as {self.layout.describe()}. Create a new instance for this Trainer (to continue"
                " from its weights, save a checkpoint and pass it as `ckpt_path`)."
            )
        elif runner.pipeline is not None:  # a second Trainer: the stages and their schedules are already built
            if runner.pipeline_options != self._pipeline_options:
                raise RuntimeError(
                    f"This {type(lightning_module).__name__} is already split into pipeline stages with"
                    f" {runner.pipeline_options}; it cannot also run with {self._pipeline_options}. Give this"
                    " Trainer's strategy the same pipeline options, or create a new instance (to continue from its"
                    " weights, save a checkpoint and pass it as `ckpt_path`)."
                )
            self._pipeline = runner.pipeline
        return runner

    def _tensor_plan(self, model: nn.Module) -> tuple[Optional[dict[str, Any]], Optional[tuple[str, str]]]:
        """The tensor-parallel plan of the whole ``model`` and, with sequence parallelism, where the sequence is
        held in shares (:func:`~meshlight.parallel.tensor_plan.sequence_region`); ``(None, None)`` without tensor
        parallelism or when ``configure_model`` applied it."""
        if self.layout.tp == 1 or any(isinstance(p, DTensor) for p in model.parameters()):
            return None, None
        plan = model_plan(model, self._tensor_parallel["tp_plan"])
        return plan, sequence_region(model, plan) if self._tensor_parallel["sequence_parallel"] else None

    @property
    def _callback_transforms(self) -> dict[str, Any]:
        """The transforms callbacks asked for (recomputation, precision, offload, compilation), for parallelize."""
        return {"recompute": self.recompute, "precision": self.mixed_precision, "offload": self.offload,
                "compile": self.compile}

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        # Optimizers made for a previous setup (fit, then test) hold the parameters of that setup.
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        self.optimizers = [adapt_optimizer(optimizer) for optimizer in self.optimizers]
        if self.offload and self.offload.optimizer and apart_from_host(self.root_device):  # the host steps them
            for note in prepare_host_steps(self.optimizers, self.num_processes):
                rank_zero_info(note)

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
        """Lightning enters this for micro-batches that only accumulate gradients. A pipeline schedule
        manages its stages' gradient reduction itself."""
        assert self.model is not None
        if self._pipeline is not None:
            yield
            return
        with gradient_accumulation(self.model, self.layout.zero):
            yield

    # ---------------------------------------------------------------- training loop: preemption signals, GC

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._gc.start()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._signals is not None:
            self._signals.at_train_batch_start(self)
        self._gc.at_batch()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._gc.stop()

    # ---------------------------------------------------------------- steps under pipelining

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            with self._explaining_errors():
                return super().training_step(*args, **kwargs)
        batch, batch_idx = args[0], args[1]
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        with self.precision_plugin.train_step_context(), self._explaining_errors():
            return self._pipeline.training_step(batch, batch_idx, clear_gradients=batch_idx % accumulate == 0,
                                                accumulate=accumulate,
                                                scaler=getattr(self.precision_plugin, "scaler", None))

    def _explaining_errors(self) -> AbstractContextManager[None]:
        """Notes on what to change added to PyTorch's errors that tensor parallelism can cause."""
        return explaining_tensor_parallel_errors(self.layout.tp, self._tensor_parallel["loss_parallel"])

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is None:
            with self._explaining_errors():
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The schedule already ran backward inside training_step; hand its gradients back, with the hooks.
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._pipeline.restore_gradients()
        return self.precision_plugin.post_backward(closure_loss, module)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._agree_on_sigterm_in_evaluation()
        if self._pipeline is None:
            return super().validation_step(*args, **kwargs)
        with self.precision_plugin.val_step_context():
            return self._pipeline.evaluation_step(self.lightning_module.validation_step, *args)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._agree_on_sigterm_in_evaluation()
        if self._pipeline is None:
            return super().test_step(*args, **kwargs)
        with self.precision_plugin.test_step_context():
            return self._pipeline.evaluation_step(self.lightning_module.test_step, *args)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._agree_on_sigterm_in_evaluation()
        if self._pipeline is None:
            return super().predict_step(*args, **kwargs)
        with self.precision_plugin.predict_step_context():
            return self._pipeline.evaluation_step(self.lightning_module.predict_step, *args)

    def _agree_on_sigterm_in_evaluation(self) -> None:
        if self._signals is not None:
            self._signals.at_evaluation_step(self)

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
        if self.layout.tp == 1:  # partial-sum gradients come from tensor parallelism
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_reduce() -> Any:
            result = closure()
            reduce_partial_gradients(p for group in optimizer.param_groups for p in group["params"])
            return result

        # Inside the closure, so Lightning's clipping and on_before_optimizer_step see reduced gradients (under
        # manual optimization, what the user does before opt.step() still sees partial sums: correct, slower).
        return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> Tensor:
        """Clip the optimizer's gradients by their norm over the whole model, however it is sharded."""
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        return clip_grad_norm_(parameters, clip_val, pipeline_group=self._pipeline_group())

    def _pipeline_group(self) -> Optional[torch.distributed.ProcessGroup]:
        return self.device_mesh["pp"].get_group() if self.layout.pp > 1 else None

    @override
    def teardown(self) -> None:
        # Unlike Strategy.teardown, leave the parallelized module where it is (as Lightning's
        # ModelParallelStrategy does): its parameters are managed by DDP / FSDP2, and a later
        # `trainer.test` reuses them.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.wait_for_checkpoint()  # a checkpoint still being written is finished and committed
        self._gc.stop()  # also after a failed fit
        self._contexts.close()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # ---------------------------------------------------------------- collectives

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(
        self,
        tensor: Union[Tensor, Any],
        group: Optional[Any] = None,
        reduce_op: Optional[Union[ReduceOp, str]] = "mean",
    ) -> Union[Tensor, Any]:
        """Reduce over the data-parallel replicas by default, in place like Lightning's (see
        :func:`~meshlight.strategies.process_group.all_reduce_in_place`). This is what ``self.log(...,
        sync_dist=True)`` asks for: the ranks of one tensor/pipeline group hold one replica's values, so a
        ``reduce_fx="sum"`` over every rank would count each of them tp·pp times."""
        if group is None and self._device_mesh is not None:
            group = axis(self._device_mesh, "dp").get_group()
        return all_reduce_in_place(tensor, group, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Every rank's own decision (to stop, to save), combined over the whole world."""
        votes = all_reduce_in_place(torch.tensor(int(decision), device=self.root_device), _group.WORLD, "sum")
        return bool(votes == self.world_size) if all else bool(votes)

    # ---------------------------------------------------------------- checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The sharded model state (DTensors stay sharded; nothing is gathered)."""
        assert self.lightning_module is not None
        return get_model_state_dict(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The sharded optimizer state, keyed by parameter name so it reshards on load."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.lightning_module is not None
        return get_optimizer_state_dict(self.lightning_module, optimizer, options=OPTIMIZER_STATE)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None, *,
        asynchronous: bool = False,
    ) -> None:
        """Write a sharded checkpoint folder, committed atomically (see :func:`meshlight.parallel.save_checkpoint`);
        ``asynchronous``: stage it in memory and write it in the background (:meth:`wait_for_checkpoint`)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} writes sharded checkpoints itself: drop `storage_options`.")
        path = self.broadcast(filepath)
        if asynchronous and self._checkpoint_writer is None:
            self._checkpoint_writer = AsyncCheckpointWriter()
        rng = {"world_size": self.world_size, **_collect_rng_states(include_cuda=self.root_device.type == "cuda")}
        save_checkpoint(path, checkpoint, write_metadata=self.is_global_zero, rng_state=rng,
                        writer=self._checkpoint_writer if asynchronous else None)

    def wait_for_checkpoint(self) -> None:
        """Block until a checkpoint being written in the background is written and committed."""
        if self._checkpoint_writer is not None:
            self._checkpoint_writer.wait()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = self.broadcast(newest_whole_hpc_checkpoint(str(checkpoint_path)) if self.is_global_zero
                              else checkpoint_path)
        module = self.lightning_module
        assert module is not None
        checkpoint = load_checkpoint(path, module, self.optimizers, strict=module.strict_loading,
                                     weights_only=weights_only, expected_names=getattr(self, "_state_names", None))
        rng = load_rng_state(path)
        if rng is not None and rng.pop("world_size", None) == self.world_size:
            _set_rng_states(rng)  # same ranks, same streams: dropout continues as if never interrupted
        return checkpoint

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Training loaders resume mid-epoch exactly: their sampler skips what the interrupted epoch consumed."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        sampler = getattr(dataloader, "sampler", None)
        if (trainer is None or not trainer.training or not isinstance(dataloader, DataLoader)
                or not isinstance(sampler, DistributedSampler) or dataloader.batch_size is None):
            return dataloader
        # Lightning warns that a plain DataLoader cannot resume mid-epoch: under meshlight it does.
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        return _update_dataloader(dataloader, ResumableSampler(sampler, dataloader.batch_size,
                                                               lambda: progress.processed))

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded, resharded, in `load_checkpoint`

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded, resharded, in `load_checkpoint`


