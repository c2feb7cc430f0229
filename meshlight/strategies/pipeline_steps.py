"""Run a LightningModule's steps through a pipeline schedule, inside Lightning's stock loop.

Training step, on every rank:

1. *Capture*: run the user's ``training_step`` with the model root's ``forward`` patched to raise (the root:
   :func:`~meshlight.parallel.pipeline.model_root`): its arguments are stage 0's input (e.g. the token ids),
   whatever preprocessing the step does first.
2. *Schedule*: ``torch.distributed.pipelining`` runs forward and backward over the microbatches; on the last
   stage the loss function is the user's ``training_step`` on that microbatch, with ``forward`` patched to
   return what the last stage's root forward returned. Its ``self.log`` calls are recorded, not forwarded.
3. *Gradients* now sit in ``.grad``; those of a weight tied across the first and last stage are summed between
   them. Lightning will call ``zero_grad`` before its ``backward``, so they are stashed and handed back in
   :meth:`PipelineSteps.restore_gradients` (added to those of earlier batches of an accumulation window, which
   the schedule must not see: it rescales all of ``.grad``).
4. *Logging*: the last stage combines each logged value over microbatches as its ``reduce_fx`` says (mean,
   sum, max, min) and broadcasts the list over the pipeline group; every rank replays it through the real
   ``self.log``, so ``sync_dist``, ``prog_bar``, callbacks, checkpoints and rank 0's loggers see the values a
   non-pipelined run sees.

Stage 0 takes the forward's first input (by position, or by keyword as ``input_ids=``); its other arguments (a
padding mask, labels) go to every stage.

Validation, test and predict run the schedule forward only (with the training gradients set aside: the
schedule rescales ``.grad`` even then) and call the user's step once on the full batch of last-stage outputs;
its return value (predictions) is broadcast to every rank of the pipeline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import move_data_to_device
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.utils._pytree import tree_flatten, tree_unflatten

from meshlight.parallel.layout import ParallelLayout
from meshlight.parallel.pipeline import (
    ZERO_BUBBLE,
    ModelRoot,
    PipelineError,
    SplitSpec,
    StagePlan,
    build_schedule,
    module_stage_plan,
    rank_holding,
    stages_of_rank,
)
from meshlight.parallel.pipeline_stages import (
    TOKEN_IDS,
    Stage,
    check_chain,
    first_positional,
    materialize,
    root_stages,
    run_after_blocks,
    tied_parameters,
)
from meshlight.parallel.tied_weights import TiedWeights
from meshlight.strategies.pipeline_logging import LogRecorder, detached_whole, logged_layout

__all__ = ["PipelineOptions", "PipelineSteps", "setup_pipeline", "stage_plan"]


@dataclass(frozen=True)
class PipelineOptions:
    schedule: str = "1f1b"
    microbatches: Optional[int] = None  # None: one per stage
    virtual_stages: int = 1
    split: SplitSpec = None


def setup_pipeline(
    lightning_module: LightningModule,
    layout: ParallelLayout,
    mesh: DeviceMesh,
    options: PipelineOptions,
    device: torch.device,
    parallelize_stage: Callable[[nn.Module, int], nn.Module],
) -> tuple[PipelineSteps, nn.Module]:
    """Split ``lightning_module``'s pipelined module into ``pp × virtual_stages`` stages, keep this rank's
    (materializing them from the meta device if needed), parallelize each stage (``parallelize_stage(module,
    index)``), and return the steps runner and a module holding the stages (the strategy's model)."""
    num_stages = layout.pp * options.virtual_stages
    place, root, plan = stage_plan(lightning_module, num_stages, options.split)
    tied = tied_parameters(root, place, plan)
    indices = stages_of_rank(mesh["pp"].get_local_rank(), layout.pp, options.virtual_stages, options.schedule)
    tied_weights = TiedWeights(root, tied, mesh, indices, num_stages, options.schedule)
    stage_modules = root_stages(root, place, plan, indices)
    materialize(root, device)
    tied_weights.broadcast()
    stage_modules = [parallelize_stage(module, index) for module, index in zip(stage_modules, indices)]
    microbatches = options.microbatches or num_stages
    if options.schedule in ZERO_BUBBLE and layout.dp > 1 and microbatches < num_stages:
        # torch 2.13 reduces FSDP gradients before these schedules' last deferred weight-gradient passes when
        # there are fewer microbatches than stages: gradients come out wrong (61% off in our check), silently.
        raise PipelineError(
            f"{options.schedule!r} with data parallelism needs at least as many microbatches as stages: use"
            f" microbatches >= {num_stages} (got {microbatches}); with fewer, PyTorch 2.13 loses weight gradients."
        )
    steps = PipelineSteps(lightning_module, root, place, plan, stage_modules, indices, mesh["pp"].get_group(),
                          options.schedule, microbatches, device, tied_weights)
    return steps, _Stages(stage_modules)


def stage_plan(lightning_module: LightningModule, num_stages: int, split: SplitSpec,
               probe: bool = True) -> tuple[ModelRoot, nn.Module, StagePlan]:
    """Where ``lightning_module``'s blocks are, the model holding them, and how ``num_stages`` stages split them under
    ``split``; with ``probe``, the pieces registered before the blocks that run after them go to the last stage (a
    forward on the model's example inputs finds them: :func:`run_after_blocks`), as :func:`setup_pipeline` runs it."""
    place, root, plan = module_stage_plan(lightning_module, num_stages, split)
    run_after = run_after_blocks(root, plan, place) if probe else ()
    if run_after:
        plan = module_stage_plan(lightning_module, num_stages, split, run_after)[2]
    return place, root, plan


class _Stages(nn.Module):
    """This rank's stage modules: the strategy's model under pipelining."""

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)


class _Captured(Exception):
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


class PipelineSteps:
    """The training/evaluation steps of ``lightning_module`` on this rank's pipeline stages."""

    def __init__(
        self,
        lightning_module: LightningModule,
        root: nn.Module,
        place: ModelRoot,
        plan: StagePlan,
        stage_modules: Sequence[Stage],
        stage_indices: Sequence[int],
        group: dist.ProcessGroup,
        schedule: str,
        microbatches: int,
        device: torch.device,
        tied_weights: TiedWeights,
    ) -> None:
        self.lightning_module = lightning_module
        self.root = root
        self.place = place
        self.plan = plan
        self.stage_modules = list(stage_modules)
        self.stage_indices = list(stage_indices)
        self.group = group
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.device = device
        self.tied_weights = tied_weights
        self.has_first = 0 in self.stage_indices
        self.has_last = plan.num_stages - 1 in self.stage_indices
        self._last_stage = next((stage for stage in self.stage_modules if stage.last), None)
        last_rank = rank_holding(plan.num_stages - 1, dist.get_world_size(group), schedule)
        self.last_stage_rank = dist.get_global_rank(group, last_rank)
        self._schedules: dict[Any, Any] = {}
        self._stash: list[tuple[Tensor, Tensor]] = []
        self._chained: set[Any] = set()  # input signatures whose chain was checked
        self._microbatch_steps: list[Any] = []
        self._recorder = LogRecorder()
        # Per microbatch index: on its first step torch's shape inference calls the loss function once more
        # for microbatch 0 (on a warm-up output); the real call then overwrites that entry.
        self._losses: dict[int, Tensor] = {}
        self._accumulate = 1
        self._scaler: Optional[torch.amp.GradScaler] = None
        self._logged_layout: Optional[list[Any]] = None  # what the last stage's step logged, values left out
        self._logged_dtypes: list[torch.dtype] = []  # the loss's and the logged numbers' dtypes
        #: ``(loss, microbatch) → loss`` applied to each microbatch's loss (context parallelism weighs it by tokens)
        self.weigh_loss: Optional[Callable[[Tensor, Any], Tensor]] = None
        self._chunks: list[Any] = []
        #: while a list: each stage compute call is appended as (kind "F"/"B"/"W", stage, start, end) in
        #: ``time.perf_counter`` seconds (TrainingMonitor's pipeline timeline)
        self.timeline: Optional[list[tuple[str, int, Optional[int], float, float]]] = None
        # Built now so that a microbatch count the schedule cannot run fails before training.
        self._schedule(training=True, signature=None)

    # ------------------------------------------------------------------------------------------ training

    def training_step(
        self, batch: Any, batch_idx: int, clear_gradients: bool, accumulate: int = 1,
        scaler: Optional[torch.amp.GradScaler] = None,
    ) -> Tensor:
        """``clear_gradients``: this batch starts an accumulation window; ``accumulate``: its length, by
        which Lightning divides the loss it backpropagates (the schedule's backward must do the same);
        ``scaler``: fp16 loss scaling, which the schedule's backward applies in place of Lightning's."""
        module = self.lightning_module
        if not module.automatic_optimization:
            raise PipelineError(
                "Pipeline parallelism runs forward and backward inside the schedule; manual optimization "
                "(automatic_optimization=False) cannot call backward itself. Use automatic optimization."
            )
        # The schedule starts from empty gradients (torchtitan#1733); those carried from earlier batches of an
        # accumulation window are added back afterwards.
        carried = _take_gradients(module.parameters())
        if clear_gradients:
            carried = {}
        self._sync_training_mode(training=True)
        args, kwargs = self._capture(module.training_step, batch, batch_idx)
        self._check_inputs(args, kwargs)
        chunks = self._split(batch)
        self._microbatch_steps = [lambda chunk=chunk: module.training_step(chunk, batch_idx) for chunk in chunks]
        self._chunks = chunks
        self._losses = {}
        self._accumulate = accumulate
        self._scaler = scaler
        self._recorder.clear()
        schedule = self._schedule(training=True, signature=_signature(args))
        target = torch.arange(self.microbatches, device=self.device) if self.has_last else None
        # Positional arguments feed stage 0 only; keyword arguments (a padding mask) go to every stage, whose
        # pieces of the forward read them too. Each rank's schedule cuts them into microbatches.
        schedule.step(*(args if self.has_first else ()), target=target, **kwargs)
        self.tied_weights.reduce_gradients()
        self._stash = []
        for param in module.parameters():
            grads = [g for g in (carried.get(param), param.grad) if g is not None]
            if grads:
                self._stash.append((param, sum(grads[1:], grads[0])))
            param.grad = None
        loss = torch.stack(list(self._losses.values())).mean() if self._losses else None
        loss, logged = self._step_results(loss, self._recorder.reduced(module))
        self._recorder.replay(module, logged)
        return loss.to(self.device)

    def restore_gradients(self) -> None:
        """Hand the step's gradients back after Lightning's ``zero_grad`` (accumulating across batches)."""
        for param, grad in self._stash:
            param.grad = grad if param.grad is None else param.grad + grad
        self._stash = []

    def _loss(self, output: Any, index: Tensor) -> Tensor:
        """The schedule's loss function on the last stage: the user's ``training_step`` on microbatch ``index``."""
        microbatch = int(index.reshape(-1)[0])
        output = self._last_stage.rebuild(output)
        with self._forward_returns(output), self._recorder.capture(self.lightning_module, microbatch):
            result = self._microbatch_steps[microbatch]()
        loss = result["loss"] if isinstance(result, Mapping) else result
        if not isinstance(loss, Tensor):
            raise PipelineError("Under pipelining, training_step must return the loss (a tensor or {'loss': …}).")
        if self.weigh_loss is not None:
            loss = self.weigh_loss(loss, self._chunks[microbatch])
        self._losses[microbatch] = detached_whole(loss)
        loss = loss / self._accumulate
        return self._scaler.scale(loss) if self._scaler is not None else loss

    # ------------------------------------------------------------------------------------------ evaluation

    def evaluation_step(self, step: Callable[..., Any], batch: Any, batch_idx: int, *args: Any) -> Any:
        module = self.lightning_module
        self._sync_training_mode(training=False)
        captured_args, kwargs = self._capture(step, batch, batch_idx, *args)
        self._check_inputs(captured_args, kwargs)
        schedule = self._schedule(training=False, signature=_signature(captured_args))
        self._recorder.clear()
        with torch.no_grad(), _gradients_set_aside(module.parameters()):
            output = schedule.eval(*(captured_args if self.has_first else ()), **kwargs)
        result = None
        if self.has_last:
            with self._forward_returns(self._last_stage.rebuild(output)), self._recorder.capture(module):
                result = step(batch, batch_idx, *args)
            result = _detached_cpu(result)
        result, logged = self._from_last_stage((result, self._recorder.reduced(module)))
        self._recorder.replay(module, logged)
        return move_data_to_device(result, self.device)

    # ------------------------------------------------------------------------------------------ machinery

    def _capture(self, step: Callable[..., Any], *step_args: Any) -> tuple[tuple, dict]:
        """Stage 0's inputs: the arguments the step passes to the model root's forward, its first input positional
        (passed as ``model(input_ids=…)``, say), as the stages after the first receive theirs."""

        def capture(*args: Any, **kwargs: Any) -> Any:
            raise _Captured(args, kwargs)

        self.root.forward = capture
        try:
            with self._recorder.discard(self.lightning_module):
                step(*step_args)
        except _Captured as captured:
            args, kwargs = first_positional(self.root, captured.args, captured.kwargs)
            if args and isinstance(args[0], Tensor) and not args[0].is_floating_point():  # token ids, for later stages
                kwargs = {**kwargs, TOKEN_IDS: args[0]}
            return args, kwargs
        finally:
            del self.root.forward
        raise PipelineError(
            f"{getattr(step, '__name__', 'The step')} never called {type(self.root).__name__}, the module holding the"
            " model's parameters: pipeline parallelism feeds its forward into the stages. Call the model through it."
        )

    @contextmanager
    def _forward_returns(self, output: Any) -> Iterator[None]:
        self.root.forward = lambda *args, **kwargs: output
        try:
            yield
        finally:
            del self.root.forward

    def _schedule(self, training: bool, signature: Any) -> Any:
        key = (training, signature)
        if key not in self._schedules:
            stages = [PipelineStage(module, index, self.plan.num_stages, self.device, group=self.group)
                      for module, index in zip(self.stage_modules, self.stage_indices)]
            for stage in stages:
                self._time_compute(stage)
            loss_fn = self._loss if training else None
            # A schedule made before the first batch (signature None) serves the first training signature.
            reuse = self._schedules.pop((True, None), None) if training and signature is not None else None
            self._schedules[key] = reuse or build_schedule(stages, self.schedule_name, self.microbatches, loss_fn)
        return self._schedules[key]

    def _time_compute(self, stage: PipelineStage) -> None:
        """Record ``stage``'s compute calls in :attr:`timeline` while it is a list: kind, stage, microbatch (the
        chunk id torch's stage methods take first), start and end."""
        chunk_ids = {"F": "fwd_chunk_id", "B": "bwd_chunk_id", "W": "bwd_chunk_id"}
        for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk"), ("W", "backward_weight_one_chunk")):
            method = getattr(stage, name)

            def timed(*args: Any, _method: Callable[..., Any] = method, _kind: str = kind, **kwargs: Any) -> Any:
                if self.timeline is None:
                    return _method(*args, **kwargs)
                microbatch = args[0] if args else kwargs.get(chunk_ids[_kind])
                start = time.perf_counter()
                try:
                    return _method(*args, **kwargs)
                finally:
                    self.timeline.append((_kind, stage.stage_index, microbatch, start, time.perf_counter()))

            setattr(stage, name, timed)

    def _check_inputs(self, args: tuple, kwargs: dict) -> None:
        """Before anything is sent: the batch divides into microbatches, no keyword argument of the forward
        takes the name of one of the schedule's own, and (once per input shape) the model's forward is a chain.
        All are decided identically on every rank, so none waits in a send."""
        taken = sorted(_SCHEDULE_KEYWORDS & kwargs.keys())
        if taken:
            raise PipelineError(
                f"{type(self.root).__name__}.forward is called with the keyword argument(s) {taken}, which"
                " torch's pipeline schedule takes for itself (it would never pass them to the model): rename them"
                " in the forward's signature."
            )
        for arg in tree_flatten((args, kwargs))[0]:
            if isinstance(arg, Tensor) and arg.dim() > 0:
                _check_divisible(arg.shape[0], self.microbatches)
        for pixels, grid in _FLATTENED_PATCHES:
            _check_patches(kwargs.get(pixels), kwargs.get(grid), pixels, self.microbatches)
        signature = _signature(args)
        if signature not in self._chained:
            tuples = check_chain(self.root, self.plan, args, kwargs, self.place)
            for stage in self.stage_modules:  # (one BlockOutput, shared with the stand-ins of their blocks)
                stage.block_output.tuples = tuples
            self._chained.add(signature)

    def _split(self, batch: Any) -> list[Any]:
        """The batch cut into ``microbatches`` equal slices along dimension 0 (every tensor in it)."""
        leaves, spec = tree_flatten(batch)
        tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor) and leaf.dim() > 0]
        if tensors:
            _check_divisible(tensors[0].shape[0], self.microbatches)
        pieces = [leaf.tensor_split(self.microbatches) if isinstance(leaf, Tensor) and leaf.dim() > 0 else None
                  for leaf in leaves]
        return [tree_unflatten([p[i] if p is not None else leaf for p, leaf in zip(pieces, leaves)], spec)
                for i in range(self.microbatches)]

    def _sync_training_mode(self, training: bool) -> None:
        """Make the stages and the LightningModule agree on every module's mode. Lightning switches evaluation on
        the strategy's model (``trainer.model.eval()``), which holds the stages: for an evaluation step the
        LightningModule (with the pieces of other stages it holds) follows them. Afterwards Lightning restores the
        modes of the LightningModule's own modules, by name, and not those of the stages' shallow copies (a
        stage's root, its block list) or wrappers: for a training step these take their modes from the
        LightningModule, so that training after a validation keeps dropout and vocabulary-sharded logits."""
        if not training:
            self.lightning_module.train(self.stage_modules[0].training)
            return
        shared = {id(module) for module in self.lightning_module.modules()}
        modes = {name: module.training for name, module in self.root.named_modules()}
        for stage in self.stage_modules:
            stage.training = self.root.training
            for name, module in stage.root.named_modules():
                if id(module) not in shared:
                    module.training = modes.get(name, self.root.training)

    def _from_last_stage(self, payload: Any) -> Any:
        box = [_detached_cpu(payload) if self.has_last else None]
        dist.broadcast_object_list(box, src=self.last_stage_rank, group=self.group)
        return box[0]

    def _step_results(self, loss: Optional[Tensor], logged: list[tuple[str, Any, dict]]) -> tuple[Tensor, list]:
        """The last stage's loss and logged values, on every rank of the pipeline. While the step logs what the
        one before logged (names, options), a single tensor broadcast carries the values; otherwise the objects
        are broadcast (pickled: two collectives) and their layout is remembered."""
        if self._logged_layout is not None:
            flat = torch.zeros(2 + sum(metric is None for _, metric, _ in self._logged_layout), dtype=torch.float64)
            if self.has_last and logged_layout(logged) == self._logged_layout and (
                    _dtypes(loss, logged) == self._logged_dtypes):
                values = [loss] + [value for _, value, _ in logged if not isinstance(value, tuple)]
                flat[0] = 1.0
                flat[1:] = torch.stack([v.detach().to(torch.float64).cpu().reshape(()) for v in values])
            flat = flat.to(self.device)
            dist.broadcast(flat, src=self.last_stage_rank, group=self.group)
            if flat[0].item() == 1.0:  # each value back in its dtype: a float64 model's losses keep their digits
                numbers = (value.to(dtype) for value, dtype in zip(flat[1:].cpu(), self._logged_dtypes))
                loss = next(numbers)
                return loss, [(name, metric if metric is not None else next(numbers), kwargs)
                              for name, metric, kwargs in self._logged_layout]
        loss, logged = self._from_last_stage((loss, logged))
        self._logged_layout, self._logged_dtypes = logged_layout(logged), _dtypes(loss, logged)
        return loss, logged


def _dtypes(loss: Any, logged: list[tuple[str, Any, dict]]) -> list[torch.dtype]:
    """The dtypes of the loss and of the numbers logged (not metrics), in the order a step's results carry them."""
    values = [loss] + [value for _, value, _ in logged if not isinstance(value, tuple)]
    return [value.dtype if isinstance(value, Tensor) else torch.float32 for value in values]


#: a multimodal model's images as patches flattened over the batch beside each image's grid (Qwen-VL's keywords)
_FLATTENED_PATCHES = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))


def _check_patches(pixels: Any, grid: Any, name: str, microbatches: int) -> None:
    """Images given as patches flattened over the batch (``[patches, values]``, each image's ``[t, h, w]`` in
    ``grid``) are cut, as every argument is, into equal microbatches along dimension 0: each microbatch's patches
    must be its images' own."""
    if not (isinstance(pixels, Tensor) and pixels.dim() == 2 and isinstance(grid, Tensor) and grid.dim() == 2):
        return
    per_image = grid.prod(-1).tolist()
    images, patches = len(per_image) // microbatches, pixels.shape[0] // microbatches
    held = [sum(per_image[i * images:(i + 1) * images]) for i in range(microbatches)]
    if any(count != patches for count in held):
        raise PipelineError(
            f"{name} holds the images' patches flattened over the batch ({pixels.shape[0]} patches of"
            f" {len(per_image)} images), which the pipeline schedule cuts into {microbatches} equal microbatches"
            f" along dimension 0: each would get {patches} patches, but their images hold {held}. Give every"
            " microbatch images of as many patches (images of one size per microbatch), or train with pp=1."
        )


#: keyword arguments of ``schedule.step``/``eval`` that the schedule keeps instead of passing to the stages
_SCHEDULE_KEYWORDS = frozenset({"target", "losses", "return_outputs", "loss_kwargs"})


def _take_gradients(parameters: Iterator[nn.Parameter]) -> dict[nn.Parameter, Tensor]:
    """The parameters' gradients, each ``.grad`` left empty. torch's schedules end every step, forward-only ones
    too, with the gradient reduction, which divides all of ``.grad`` by the number of microbatches: gradients
    carried from earlier batches of an accumulation window must not be in ``.grad`` then."""
    taken = {param: param.grad for param in parameters if param.grad is not None}
    for param in taken:
        param.grad = None
    return taken


@contextmanager
def _gradients_set_aside(parameters: Iterator[nn.Parameter]) -> Iterator[None]:
    """The gradients taken (:func:`_take_gradients`) and given back afterwards: an evaluation in the middle of an
    accumulation window (``val_check_interval``) leaves the window's gradients so far as they were. (The
    reduction's FSDP post-backward, which reshards the parameters, still runs.)"""
    taken = _take_gradients(parameters)
    try:
        yield
    finally:
        for param, grad in taken.items():
            param.grad = grad


def _signature(args: tuple) -> tuple:
    return tuple(tuple(a.shape) if isinstance(a, Tensor) else type(a).__name__ for a in args)


def _check_divisible(size: int, microbatches: int) -> None:
    if size % microbatches:
        raise PipelineError(
            f"A batch of {size} does not divide into {microbatches} microbatches: use a batch size that is a"
            f" multiple of {microbatches} (and drop_last=True for the last batch), or change microbatches."
        )


def _detached_cpu(value: Any) -> Any:
    leaves, spec = tree_flatten(value)
    return tree_unflatten([detached_whole(leaf).cpu() if isinstance(leaf, Tensor) else leaf for leaf in leaves], spec)
