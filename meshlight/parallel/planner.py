"""Layout planner: the fastest (dp, pp, tp, cp, ep, zero, microbatches, virtual stages, recomputation) that fits.

:func:`plan` enumerates every valid candidate for a world of devices (tp within a node and dividing the heads and
the MLP, pp at most the layers, cp splitting a long sequence into ``2·cp·tp`` equal chunks, dp dividing the batch,
ep the experts, microbatches suiting the schedule), prices each with the analytic cost model
(:mod:`meshlight.parallel.cost_model`: per-rank memory and step time) and ranks them, those that fit before those
that do not. :func:`format_plan` prints the best ones and why the winner won;
when nothing fits, the hints name the nearest layouts, the fewest devices, or the change that would fit.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional, Union

import torch
from torch import nn

from meshlight.parallel.adapters import adapters_unwrapped
from meshlight.parallel.cost_model import (
    ACHIEVABLE_FRACTION,
    AUTOCAST_ACTIVATION_BYTES,
    Candidate,
    _schedule_of,
    estimate,
    precision_bytes,
)
from meshlight.parallel.layout import _check_size, _check_zero, _divisors
from meshlight.parallel.model_shape import ModelShapeError, model_shape
from meshlight.parallel.pipeline import (
    SCHEDULES,
    V_PLACEMENT,
    ZERO_BUBBLE,
    PipelineError,
    default_virtual_stages,
    validate_schedule,
)
from meshlight.parallel.presets import GB, HARDWARE, MODELS, Hardware, ModelSpec, detect_hardware, preset_named

__all__ = [
    "ACHIEVABLE_FRACTION", "AUTOCAST_ACTIVATION_BYTES", "CP_TP_REACH", "HARDWARE", "LONG_SEQUENCE", "MODELS",
    "Candidate", "Hardware", "ModelSpec",
    "PlanError", "best_per_layout", "detect_hardware", "estimate", "explain", "fewest_devices", "format_plan",
    "model_spec_of", "more_devices_hint", "nearest_fitting", "plan", "precision_bytes", "preset_named",
    "same_devices_hint", "shown_layouts",
]

#: How many times the devices at hand :func:`fewest_devices` looks up to, for a model that fits on none, and
#: the fewest devices it looks up to whatever the devices at hand
DEVICE_REACH, DEVICE_REACH_FLOOR = 64, 1024
#: Sequences longer than this are planned with context parallelism too (shorter ones only where cp is given): Llama 3
#: pretrained at 8K tokens without it and split its long-context stage (up to 128K) over CP 16 (the Llama 3 paper,
#: Table 4); torchtitan's context-parallel runs start at 64K
LONG_SEQUENCE = 8192
#: The most ranks the planner splits one sequence over, cp·tp, unless cp is given: torchtitan's longest published
#: runs split Llama 3.1 405B's 256K-token sequences over TP 8 × CP 8
CP_TP_REACH = 64


class PlanError(ValueError):
    """No candidate layout fits; the message names the closest ones and what to change."""


def model_spec_of(module: nn.Module, seq_len: Optional[int] = None) -> ModelSpec:
    """The planner's view of ``module``: from a GPT-style ``config`` (``n_layers``, ``dim``, ``n_heads``,
    ``vocab_size``) anywhere in it, else from its structure as tensor parallelism reads it
    (:func:`~meshlight.parallel.model_shape.model_shape`). ``seq_len`` default: the config's, else 2048. The share
    of its parameters that train is its own (``requires_grad``: a LoRA fine-tune's adapters alone)."""
    sizes = [(p.numel(), p.requires_grad) for p in module.parameters()]
    trainable = sum(n for n, grad in sizes if grad) / max(sum(n for n, _ in sizes), 1) if sizes else 1.0
    for child in module.modules():
        config = getattr(child, "config", None)
        if all(hasattr(config, a) for a in ("n_layers", "dim", "n_heads", "vocab_size", "ffn_dim")):
            return ModelSpec.from_gpt_config(config, seq_len).replace(trainable=trainable)
    try:
        with adapters_unwrapped(module):  # (a LoRA layer reads as the Linear it adapts)
            shape = model_shape(module)
    except ModelShapeError:
        raise PlanError(f"{type(module).__name__} has no repeated blocks (an nn.ModuleList of layers) to plan"
                        " a layout for: give every size (dp, pp, tp, ep and zero).") from None
    return ModelSpec.from_shape(shape, seq_len, type(module).__name__).replace(trainable=trainable)


def plan(
    model: ModelSpec,
    hardware: Hardware,
    world: int,
    global_batch: Optional[int] = None,
    *,
    local_batch: Optional[int] = None,
    dp: Optional[int] = None,
    pp: Optional[int] = None,
    tp: Optional[int] = None,
    ep: Optional[int] = None,
    zero: Optional[int] = None,
    cp: Optional[int] = None,
    recompute: Optional[bool] = None,
    schedule: Optional[str] = None,
    virtual_stages: Optional[int] = None,
    microbatches: Optional[int] = None,
    experts: Optional[str] = None,
    stage_blocks: Union[None, Sequence[int], Callable[[int], Optional[Sequence[int]]]] = None,
) -> list[Candidate]:
    """Every valid candidate for ``world`` devices, highest throughput first, those that fit in memory before
    those that do not. The batch is ``global_batch`` sequences per optimizer step, or ``local_batch`` per data
    replica (as a LightningModule's DataLoader gives it: the global batch then grows with dp). Sizes given are
    kept fixed, and so are, for pipelined candidates, the ``schedule``, ``virtual_stages`` and ``microbatches``
    given (otherwise 1F1B, or Interleaved1F1B with 2 virtual stages or any count that splits the layers evenly over the
    ranks, and the best microbatch count). ``cp`` not given is planned for sequences longer than
    :data:`LONG_SEQUENCE`, else 1. ``experts``: under tp, an MoE model's experts ``"split"`` over the tp ranks or
    ``"fold"``-ed into ep (None: both are planned). ``stage_blocks``: the blocks of each pipeline stage, each rank
    priced by the blocks of its stages — as a ``split`` naming the blocks where stages begin fixes them (only
    pipelines of that many stages in all, pp × virtual stages), or a function of the stages in all giving them (as
    a balanced split does; None from it, or not given: an even split)."""
    if (global_batch is None) == (local_batch is None):
        raise ValueError("Give exactly one of global_batch and local_batch.")
    _check_request(world, global_batch, local_batch, schedule, dp=dp, pp=pp, tp=tp, ep=ep, zero=zero, cp=cp,
                   virtual_stages=virtual_stages, microbatches=microbatches)
    named = None if stage_blocks is None or callable(stage_blocks) else stage_blocks
    _check_stage_blocks(model, named)
    pipelines = _pipeline_choices(schedule, virtual_stages, microbatches, len(named) if named is not None else None)
    blocks_of = functools.cache(stage_blocks) if callable(stage_blocks) else lambda _: named
    candidates = [
        estimate(model, hardware, world, global_batch or local_batch * layout[0], *layout,
                 stage_blocks=blocks_of(layout[1] * layout[6]) if layout[1] > 1 else None)
        for layout in _layouts(model, hardware, world, global_batch, local_batch, dp, pp, tp, ep, cp, zero, recompute,
                               pipelines, experts)
    ]
    if not candidates:
        message = _no_layout_message(model, hardware, world, global_batch, local_batch, pipelines, dp, pp, tp, ep, cp)
        nearest = nearest_fitting(model, hardware, world, global_batch, local_batch=local_batch,
                                  given={"dp": dp, "pp": pp, "tp": tp, "ep": ep, "cp": cp})
        if nearest:
            message += " Nearest layouts that work: " + "; ".join(c.describe() for c in nearest) + "."
        raise PlanError(message)
    return sorted(candidates, key=lambda c: (not c.fits, -c.tokens_per_second_per_device))


def nearest_fitting(
    model: ModelSpec, hardware: Hardware, world: int, global_batch: Optional[int] = None, *,
    local_batch: Optional[int] = None, given: dict[str, Optional[int]], count: int = 3,
) -> list[Candidate]:
    """The best candidates of the ``count`` layouts that fit, nearest (in factors of two) to the sizes
    ``given`` (``{"dp": 2, "pp": None, …}``); empty when nothing is given or nothing fits."""
    if all(v is None for v in given.values()):
        return []
    try:
        free = plan(model, hardware, world, global_batch, local_batch=local_batch)
    except PlanError:
        return []
    return sorted(best_per_layout(c for c in free if c.fits), key=lambda c: sum(
        abs(math.log2(getattr(c, k) / v)) for k, v in given.items() if v is not None))[:count]


def fewest_devices(
    model: ModelSpec, hardware: Hardware, world: int, global_batch: Optional[int] = None, *,
    local_batch: Optional[int] = None,
) -> Optional[Candidate]:
    """The best layout on the fewest devices, more than ``world`` and at most :func:`device_reach` of them, on
    which one fits in memory (device counts a quarter octave apart, whole nodes past one); None when none does."""
    node = hardware.devices_per_node
    reach = device_reach(world)
    counts = {n for k in range(1, 4 * math.ceil(math.log2(reach / world)) + 1)
              if (n := math.ceil(world * 2 ** (k / 4))) <= reach}
    devices = sorted({n if n <= node else -(-n // node) * node for n in counts})
    return next(filter(None, (_best_fitting(model, hardware, n, global_batch, local_batch) for n in devices)), None)


def _best_fitting(model: ModelSpec, hardware: Hardware, world: int, global_batch: Optional[int],
                  local_batch: Optional[int], **fixed: Any) -> Optional[Candidate]:
    """The planner's best layout of ``world`` devices (with the sizes and options ``fixed``, as :func:`plan` takes
    them) if it fits in memory, else None (also when none is valid)."""
    try:
        best = plan(model, hardware, world, global_batch, local_batch=local_batch, **fixed)[0]
    except PlanError:
        return None
    return best if best.fits else None


def device_reach(world: int) -> int:
    """How many devices :func:`fewest_devices` looks up to from ``world``."""
    return max(DEVICE_REACH * world, DEVICE_REACH_FLOOR)


def more_devices_hint(
    model: ModelSpec, hardware: Hardware, world: int, global_batch: Optional[int] = None, *,
    local_batch: Optional[int] = None,
) -> str:
    """A sentence for when nothing fits on ``world`` devices: how many would, with which layout."""
    best = fewest_devices(model, hardware, world, global_batch, local_batch=local_batch)
    if best is None:
        batch = "batch per replica" if local_batch is not None else "global batch"
        return (f"No layout fits on up to {device_reach(world):,} devices either: use a smaller {batch}, a shorter"
                f" sequence or devices with more memory.")
    return (f"{model.name} fits from {best.world:,} devices: {best.describe()}"
            f" ({_format_bytes(best.memory_bytes)} of {_format_bytes(best.memory_limit)} usable).")


def same_devices_hint(
    model: ModelSpec, hardware: Hardware, world: int, global_batch: Optional[int] = None, *,
    local_batch: Optional[int] = None, accumulating: int = 1, offload: bool = True, fixed: Optional[dict] = None,
) -> str:
    """A sentence for when nothing fits on ``world`` devices: what would make it fit on them, each change alone
    (the run's other settings kept) with the best layout it allows — 16-bit compute copies from fp32 masters
    (``MixedPrecision("bf16")``) for an fp32 run, a smaller batch per replica (``accumulating``: the gradient
    accumulation the run has, multiplied to keep the batch per step), and where ``offload`` (the device's memory
    is apart from the host's) the ``Offload`` callback's activation and optimizer offload — fastest first, each
    with its estimated tokens/s per device; each within the sizes and options ``fixed`` (``{"tp": 2, "schedule":
    "gpipe", …}``, as :func:`plan` takes them), if any. Empty when none does."""
    def fitting(changed: Hardware, batch: Optional[int] = local_batch) -> Optional[Candidate]:
        return _best_fitting(model, changed, world, global_batch, batch, **(fixed or {}))

    options: list[tuple[str, Optional[Candidate]]] = []
    if hardware.param_bytes == hardware.state_bytes == hardware.activation_bytes == 4:  # fp32, not autocast
        options.append(('MixedPrecision("bf16")', fitting(hardware.replace(**precision_bytes("32-true",
                                                                                             torch.bfloat16)))))
    if local_batch is not None:  # the largest that fits; accumulating gradients keeps the batch per step
        smaller = ((batch, fitting(hardware, batch)) for batch in sorted(_divisors(local_batch), reverse=True)[1:])
        batch, best = next(((batch, best) for batch, best in smaller if best), (None, None))
        if batch is not None:
            options.append((f"a batch of {batch} per replica and"
                            f" accumulate_grad_batches={local_batch // batch * accumulating}", best))
    if offload and hardware.offload_activations < 1:  # with the optimizer offloaded or not, as now
        options.append(("activations_every_n_blocks=1 in the Offload callback" if hardware.offload_optimizer else
                        "Offload(optimizer=False, activations_every_n_blocks=1)",
                        fitting(hardware.replace(offload_activations=1.0))))
    if offload and not hardware.offload_optimizer:  # beside the activations offloaded now, if any
        options.append(("optimizer=True in the Offload callback" if hardware.offload_activations else "Offload()",
                        fitting(hardware.replace(offload_optimizer=True))))
    found = sorted(((change, best) for change, best in options if best is not None),
                   key=lambda option: -option[1].tokens_per_second_per_device)
    if not found:
        return ""
    here = "this device" if world == 1 else f"these {world:,} devices"
    return f"On {here} it fits with " + "; or ".join(
        f"{change} as {best.describe()} ({_format_bytes(best.memory_bytes)} of {_format_bytes(best.memory_limit)}"
        f" usable, {_format_rate(best.tokens_per_second_per_device)} tokens/s per device)"
        for change, best in found) + "."


def best_per_layout(candidates: Iterable[Candidate]) -> list[Candidate]:
    """The best candidate of each (dp, pp, tp, ep, cp) and expert layout, in the order given."""
    seen: dict[tuple[int, ...], Candidate] = {}
    for candidate in candidates:
        seen.setdefault((*candidate.layout, candidate.folded), candidate)
    return list(seen.values())


def _layouts(
    model: ModelSpec, hw: Hardware, world: int, global_batch: Optional[int], local_batch: Optional[int],
    dp: Optional[int], pp: Optional[int], tp: Optional[int], ep: Optional[int], cp: Optional[int],
    zero: Optional[int], recompute: Optional[bool], pipelines: _Pipelines, experts: Optional[str] = None,
) -> Iterable[tuple[Any, ...]]:
    """(dp, pp, tp, ep, zero, microbatches, virtual stages, recompute, schedule, cp, experts) of every valid
    candidate."""
    for t, p, c in itertools.product(_divisors(world), repeat=3):
        d = world // (t * p * c) if world % (t * p * c) == 0 else 0
        fixed = all(given is None or given == size for given, size in ((tp, t), (pp, p), (dp, d), (cp, c)))
        if not (d and fixed and (p > 1 or pipelines.stages is None) and p <= model.layers and _tp_fits(model, hw, t)
                and _cp_fits(model, t, c, given=cp is not None)):
            continue
        if global_batch is not None and global_batch % d:
            continue
        replica_batch = local_batch if global_batch is None else global_batch // d
        for (e, x), z, (s, v), r in itertools.product(
            _expert_layouts(model, d, t, ep, experts), (0, 1, 2, 3) if zero is None else [zero],
            pipelines.stages_for(model.layers, p) if p > 1 else [("1f1b", 1)],
            (False, True) if recompute is None else [recompute],
        ):
            if p * v > (model.layers - model.first_stage_layers + 1 if p > 1 else model.layers):
                continue
            # without pipelining, microbatches are gradient accumulation: the trainer's when it gives the batch
            accumulate = p == 1 and local_batch is not None
            for m in [1] if accumulate else pipelines.microbatch_choices(replica_batch, p, v, s):
                yield d, p, t, e, z, m, v, r, s, c, x


def _expert_layouts(model: ModelSpec, dp: int, tp: int, ep: Optional[int],
                    experts: Optional[str]) -> list[tuple[int, str]]:
    """(ep, experts) of an MoE model's candidates on ``dp`` data ranks and ``tp`` tensor ranks: ep borrowed from the
    data ranks with each expert split over tp (``"split"``, which needs the expert width divisible by tp), or ep
    spanning the tp ranks too with whole experts (``"fold"``, ep = tp × a divisor of dp); ``ep`` and
    ``experts`` given are kept. A dense model: (1, "split")."""
    if not model.experts:
        return [(1, "split")] if ep in (None, 1) else []
    split = [(e, "split") for e in _divisors(dp) if tp == 1 or model.ffn_hidden % tp == 0]
    fold = [(tp * e, "fold") for e in _divisors(dp) if tp > 1]
    return [(e, x) for e, x in split + fold if model.experts % e == 0 and ep in (None, e) and experts in (None, x)]


@dataclasses.dataclass(frozen=True)
class _Pipelines:
    """What a pipelined candidate may run: (schedule, virtual stages) pairs, and a fixed microbatch count
    (None: any that suits the replica's batch)."""

    schedules: tuple[tuple[str, int], ...]
    microbatches: Optional[int] = None
    deeper: bool = False  # neither schedule nor virtual stages given: also interleave as deep as the layers allow
    stages: Optional[int] = None  # pp × virtual stages fixed (a split naming where stages begin)
    schedule: Optional[str] = None  # the schedule given
    virtual_stages: Optional[int] = None  # the virtual stages given

    def stages_for(self, layers: int, pp: int) -> tuple[tuple[str, int], ...]:
        """The (schedule, virtual stages) pairs of a ``pp``-stage pipeline over ``layers`` blocks: those given, or
        1F1B, Interleaved1F1B with 2 virtual stages, and with any more that split the layers evenly over the ranks
        (as Megatron-Core requires; NeMo's published runs interleave up to one layer per stage); with the stages in
        all fixed, the virtual stages that make them, under the schedule given or the one for that many."""
        if self.stages is not None:
            virtual = self.virtual_stages or self.stages // pp
            schedule = self.schedule or _schedule_of(virtual)
            try:
                validate_schedule(schedule, pp, virtual, 1)
            except PipelineError:
                return ()
            return ((schedule, virtual),) if pp * virtual == self.stages else ()
        if not self.deeper:
            return self.schedules
        deeper = [("interleaved1f1b", v) for v in range(3, layers // pp + 1) if layers % (pp * v) == 0]
        return (*self.schedules, *deeper)

    def microbatch_choices(self, replica_batch: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
        if pp > 1 and self.microbatches is not None:
            return [self.microbatches] if replica_batch % self.microbatches == 0 else []
        return _microbatch_choices(replica_batch, pp, virtual_stages, schedule)


def _pipeline_choices(schedule: Optional[str], virtual_stages: Optional[int], microbatches: Optional[int],
                      stages: Optional[int] = None) -> _Pipelines:
    """The schedules a pipelined candidate may run: the one given (virtual stages: those given, else 1 for
    single-stage schedules and 2 for the rest), else 1F1B and Interleaved1F1B with the virtual stages given, or with
    2 and deeper; with ``stages`` in all, those that make them (:meth:`_Pipelines.stages_for`)."""
    if schedule is not None:
        choices = [(schedule, virtual_stages or default_virtual_stages(schedule))]
    else:
        choices = [(_schedule_of(v), v) for v in ([1, 2] if virtual_stages is None else [virtual_stages])]
    return _Pipelines(tuple(choices), microbatches, deeper=schedule is None and virtual_stages is None,
                      stages=stages, schedule=schedule, virtual_stages=virtual_stages)


def _tp_fits(model: ModelSpec, hw: Hardware, tp: int) -> bool:
    """Whether ``tp`` splits the model's heads (and its dense MLPs) within a node: its query heads, and its key/value
    heads or — fewer than tp, a divisor of it — each rank one of them, as the engine holds them
    (:func:`~meshlight.parallel.tensor_plan.replicated_kv_heads`; the planner prices their projections as split:
    they are a sliver of the step). An MoE model's experts are split over tp or folded into ep
    (:func:`_expert_layouts`)."""
    if tp == 1:
        return True
    dense_mlps = model.moe_layers < model.layers
    kv_held = model.kv_heads % tp == 0 or (model.kv_heads < model.heads and tp % model.kv_heads == 0)
    return (hw.devices_per_node % tp == 0 and model.heads % tp == 0 and kv_held
            and not (dense_mlps and model.dense_width % tp))


def _cp_fits(model: ModelSpec, tp: int, cp: int, *, given: bool = False) -> bool:
    """Whether ``cp`` splits the sequence into ``2·cp`` equal chunks (an early and a late one per rank, balancing the
    causal work) that tensor parallelism's sequence split divides too; unless cp is given, only a sequence longer
    than :data:`LONG_SEQUENCE`, over ``cp·tp`` ranks within :data:`CP_TP_REACH`."""
    if cp == 1:
        return True
    planned = model.seq_len > LONG_SEQUENCE and cp * tp <= CP_TP_REACH
    return model.seq_len % (2 * cp * tp) == 0 and (given or planned)


def _microbatch_choices(replica_batch: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """Microbatch counts dividing the replica's batch; under pipelining at least one per rank — per stage for the V
    and zero-bubble schedules (DualPipeV needs as many as stages, the zero-bubble ones with data parallelism) — and
    for those with several stages a rank a multiple of pp, as torch's interleaved schedules run them in rounds of pp
    (Interleaved1F1B fewer than pp·v too)."""
    if pp == 1:
        return _divisors(replica_batch)
    least = pp * virtual_stages if schedule in (*V_PLACEMENT, *ZERO_BUBBLE) else pp
    return [m for m in _divisors(replica_batch) if m >= least and (virtual_stages == 1 or m % pp == 0)]


def _check_request(world: int, global_batch: Optional[int], local_batch: Optional[int], schedule: Optional[str],
                   *, virtual_stages: Optional[int], microbatches: Optional[int], **sizes: Optional[int]) -> None:
    """Refuse sizes no layout could have, naming the bad value."""
    if schedule is not None and schedule not in SCHEDULES:
        raise PlanError(f"Unknown pipeline schedule {schedule!r}; choose one of {list(SCHEDULES)}.")
    for name, value, units in (("world", world, "devices"), ("global_batch", global_batch, "sequences"),
                               ("local_batch", local_batch, "sequences"), ("virtual_stages", virtual_stages, "stages"),
                               ("microbatches", microbatches, "microbatches")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PlanError(f"{name}={value!r}: a layout needs a whole number of {units}, at least one.")
    try:
        for name, value in sizes.items():
            if value is not None:
                _check_zero(value) if name == "zero" else _check_size(name, value)
    except ValueError as error:
        raise PlanError(str(error)) from None


def _check_stage_blocks(model: ModelSpec, stage_blocks: Optional[Sequence[int]]) -> None:
    """Refuse stages that are not a pipeline of the model's blocks: two or more, each of one block or more, all of
    them in all."""
    if stage_blocks is None:
        return
    blocks = list(stage_blocks)
    whole = all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in blocks)
    if len(blocks) < 2 or not whole or sum(blocks) != model.layers:
        raise PlanError(f"stage_blocks={blocks}: a pipeline's stages are two or more, of one block or more each, and"
                        f" hold the model's {model.layers} blocks in all.")


def _no_layout_message(model: ModelSpec, hw: Hardware, world: int, global_batch: Optional[int],
                       local_batch: Optional[int], pipelines: _Pipelines, *sizes: Optional[int]) -> str:
    """Which constraints a world (and the sizes given) failed, and the nearest worlds and global batches that
    have a layout."""
    dp, pp, tp, ep, cp = sizes
    given = ", ".join(f"{n}={v}" for n, v in zip(("dp", "pp", "tp", "ep", "cp"), sizes) if v is not None)
    hints = [f"tp must divide heads={model.heads} and the MLP width"
             f" {model.dense_width if model.moe_layers < model.layers else model.ffn_hidden}, divide or be a"
             f" multiple of kv_heads={model.kv_heads}, and stay within a node", f"pp ≤ layers={model.layers}",
             f"2·cp·tp must divide the sequence length {model.seq_len}",
             f"dp must divide the global batch and the microbatches a replica's batch"
             f" ({global_batch or local_batch})"]
    if pipelines.microbatches is not None:
        hints.append(f"microbatches={pipelines.microbatches} must divide a pipelined replica's batch")
    if pipelines.stages is not None:
        hints.append(f"pp × virtual stages must make the split's {pipelines.stages} stages")
    if model.experts:
        hints.append(f"ep must divide experts={model.experts} and dp (folded over tp: ep = tp × a divisor of dp)")
    elif ep is not None and ep > 1:
        hints = [f"ep={ep} splits experts, and {model.name} has none: leave ep out (or 1)"]
    message = (f"No layout of {world} devices{' with ' + given if given else ''} suits {model.name}: "
               + "; ".join(hints) + ".")

    def valid(devices: int, batch: Optional[int]) -> bool:
        pipelined = dataclasses.replace(pipelines, schedules=pipelines.schedules[:1], deeper=False)
        layouts = _layouts(model, hw, devices, batch, local_batch, dp, pp, tp, ep, cp, None, False, pipelined)
        return next(iter(layouts), None) is not None

    worlds = _nearest(world, lambda w: valid(w, global_batch))
    if worlds:
        message += f" {' or '.join(f'{w:,}' for w in worlds)} devices would have one"
        message += " with this batch." if global_batch else "."
    if global_batch is not None:
        batches = _nearest(global_batch, lambda b: valid(world, b))
        if batches:
            message += f" A global batch of {' or '.join(f'{b:,}' for b in batches)} would on {world:,} devices."
    return message


def _nearest(n: int, works: Callable[[int], bool], reach: int = 4096) -> list[int]:
    """The nearest values below and above ``n`` (within a factor of two, and ``reach``) for which ``works``
    holds."""
    below = next((m for m in range(n - 1, max(n // 2, n - reach - 1), -1) if works(m)), None)
    above = next((m for m in range(n + 1, min(2 * n, n + reach) + 1) if works(m)), None)
    return [m for m in (below, above) if m is not None]


def explain(candidates: Sequence[Candidate]) -> str:
    """One sentence on why the first fitting candidate beats the next-best layout (or, where one layout fits,
    its next-best option)."""
    fitting = [c for c in best_per_layout(candidates) if c.fits]
    if not fitting:
        tightest = min(candidates, key=lambda c: c.memory_bytes)
        message = (f"Nothing fits: the smallest estimate, {tightest.describe()}, needs "
                   f"{_format_bytes(tightest.memory_bytes)} of {_format_bytes(tightest.memory_limit)} usable")
        if tightest.memory_bytes <= tightest.memory_limit:  # what it offloads does not fit the host's share
            message += (f", and {_format_bytes(tightest.host_bytes)} of host memory per device, of"
                        f" {_format_bytes(tightest.host_limit)} usable")
        return message + "."
    winner = fitting[0]
    rejected = len({c.layout for c in candidates if not c.fits} - {c.layout for c in candidates if c.fits})
    note = (" 1 other layout does not fit in memory." if rejected == 1 else
            f" {rejected} other layouts do not fit in memory." if rejected else "")
    if len(fitting) > 1:
        runner, lead, next_one = fitting[1], f"{winner.describe()} wins", "the next layout"
    else:  # one (dp, pp, tp, ep), e.g. all given: the best of its options (ZeRO stage, schedule, microbatches)
        options = [c for c in candidates if c.fits and c.describe() != winner.describe()]
        if not options:
            return f"{winner.describe()} is the only layout that fits.{note}"
        runner, next_one = options[0], "its next option"
        lead = f"{winner.describe()} wins among the {len(options) + 1} options that fit for {winner.sizes}"
    shares = {k: runner.times[k] / runner.step_time - winner.times[k] / winner.step_time for k in winner.times}
    cost = max(shares, key=shares.get)
    names = {"compute": "compute (recomputation)", "bubble": "the pipeline bubble", "tp": "tensor-parallel traffic",
             "cp": "context-parallel K/V exchange", "p2p": "pipeline sends", "dp": "exposed data-parallel traffic",
             "ep": "expert all_to_all", "host": "offload's host copies and host step"}
    speedup = winner.tokens_per_second_per_device / runner.tokens_per_second_per_device
    if speedup < 1.005:
        return f"{lead}, level with {next_one} ({runner.describe()}) to within 0.5%.{note}"
    return (f"{lead}: {speedup:.2f}× the tokens/s of {next_one} ({runner.describe()}),"
            f" which spends {runner.times[cost] / runner.step_time:.0%} of its step on {names[cost]}"
            f" (the winner {winner.times[cost] / winner.step_time:.0%}).{note}")


def shown_layouts(candidates: Sequence[Candidate], top: int = 5) -> list[Candidate]:
    """The layouts worth showing: the ``top`` fastest, or when none fits the ``top`` nearest misses."""
    if not any(c.fits for c in candidates):
        candidates = sorted(candidates, key=lambda c: c.memory_bytes)
    return best_per_layout(candidates)[:top]


def format_plan(candidates: Sequence[Candidate], top: int = 5) -> str:
    """A short table of the best layouts with their estimates, and why the winner won."""
    rows = shown_layouts(candidates, top)
    host = any(c.host_bytes for c in rows)  # offloading: what each device keeps in host memory too
    width = max([56, *(len(c.describe()) for c in rows)])
    lines = [f"{'layout':<{width}} {'memory/rank':>12}" + (f" {'host/rank':>12}" if host else "")
             + f" {'step':>10} {'tokens/s/dev':>13} {'MFU':>6}  {'fits':>4}"]
    for c in rows:
        lines.append(f"{c.describe():<{width}} {_format_bytes(c.memory_bytes):>12}"
                     + (f" {_format_bytes(c.host_bytes):>12}" if host else "")
                     + f" {c.step_time * 1e3:>8.1f}ms {c.tokens_per_second_per_device:>13,.0f} {c.mfu:>6.1%}"
                       f"  {'yes' if c.fits else 'no':>4}")
    lines.append(explain(candidates))
    return "\n".join(lines)


def _format_rate(rate: float) -> str:
    """At least three significant figures, thousands separated: 0.0123, 45.7, 7,890, 123,457."""
    return f"{rate:,.{max(0, 2 - math.floor(math.log10(rate)))}f}" if rate > 0 else "0"


def _format_bytes(n: float) -> str:
    return f"{n / GB:.1f} GB" if n >= GB else f"{n / 1e6:.1f} MB"
