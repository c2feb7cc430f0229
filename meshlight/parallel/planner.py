"""Layout planner: the fastest (dp, pp, tp, ep, zero, microbatches, virtual stages, recomputation) that fits.

An analytic model, per rank, of what each candidate layout costs:

- **Memory**: parameters, gradients and optimizer state of the rank's share of the model (tensor, pipeline and
  expert splits, then ZeRO over the data ranks, as meshlight's FSDP2 ZeRO holds them: stages 1–2 keep the
  gathered parameters beside the shard, stage 3 a block gathered and the next one's gather in flight, stage 1
  whole gradients, stages 2–3 one block's whole gradients at a time; inside a pipeline schedule every
  stage peaks as stage 1 does, since PyTorch's schedules keep the parameters gathered and the gradients whole
  until the schedule's last backward; at the run's bytes per value — :func:`precision_bytes` — less what the
  ``Offload`` callback keeps in host memory), plus activations: per layer and
  micro-batch what autograd saves in meshlight's blocks (:meth:`ModelSpec.activation_values_per_token`,
  checked against saved-tensor hooks in the tests; about ``22·h/tp`` values per token for Llama shapes: the
  inputs of the column-parallel projections are kept split and gathered again in backward, as in
  Megatron-Core), the block's input (``h/tp``) with full recomputation plus one
  block's activations while it is recomputed; a 1F1B stage holds ``pp`` micro-batches
  in flight (interleaving multiplies that by ``1 + (pp−1)/(pp·v)``; GPipe and looped BFS hold all of them); the
  last stage also holds fp32 logits; blocks whose activations are offloaded keep two blocks' worth in transit.
  What the ``Offload`` callback moves out (optimizer state with the master shards and their gradients, the
  offloaded activations) must fit the device's share of host memory, as the rest must fit the device.
- **Step time**: compute at :data:`ACHIEVABLE_FRACTION` of the device's dense peak for the run's matmuls
  (:attr:`Hardware.compute_flops`: 16-bit, or fp32 as torch's float32 matmul precision runs it; recomputation
  adds a forward), stretched by the pipeline bubble ``(pp−1)/(m·v)``; tensor/sequence-parallel traffic (4 collectives
  of the activations per layer and micro-batch, 6 with recomputation) not overlapped; pipeline p2p; data
  parallel traffic (2·P, 3·P for ZeRO-3 less the root unit — embedding and head, kept gathered from forward to
  backward without pipelining — parameters gathered again for every micro-batch under ZeRO-3 and,
  without pipelining, gradients reduce-scattered per micro-batch under ZeRO-2) overlapped with backward compute
  except the last bucket (as Megatron-Core overlaps it; meshlight's pipeline schedules still reduce after the
  last microbatch);
  expert all_to_all (4 exchanges of the routed tokens per MoE layer and micro-batch); what the ``Offload``
  callback adds: its host-link copies (offloaded activations out in forward and back in backward; under optimizer
  offload the master shards in for each gather and the gradient shards out) beyond the compute of their phase,
  and the host's optimizer step, which nothing overlaps; and latencies: a fixed
  one per p2p message and pipeline action (what makes many tiny microbatches slow), and for each TP and DP
  collective NCCL's ring model — a base plus one hop per ring step, inter-node hops slower (what makes ZeRO-3
  over hundreds of ranks latency-bound). Links: a group within one node uses the intra-node bandwidth,
  otherwise the inter-node one (mesh order pp, dp, ep, tp: tp innermost).

:func:`plan` ranks every valid candidate; :func:`format_plan` prints the best ones and why the winner won.
The assumptions are deliberately few; ``benchmarks/planner.py`` measures how far they are from published
large-scale runs and from the model state meshlight actually holds.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from meshlight.parallel.layout import _check_size, _check_zero, _divisors
from meshlight.parallel.pipeline import SCHEDULES, default_virtual_stages
from meshlight.parallel.presets import GB, HARDWARE, MODELS, Hardware, ModelSpec

__all__ = [
    "ACHIEVABLE_FRACTION", "AUTOCAST_ACTIVATION_BYTES", "HARDWARE", "MODELS", "Candidate", "Hardware", "ModelSpec",
    "PlanError", "best_per_layout", "detect_hardware", "estimate", "explain", "fewest_devices", "format_plan",
    "host_state_bytes", "model_spec_of", "model_state_bytes", "more_devices_hint", "nearest_fitting", "plan",
    "precision_bytes", "preset_named", "same_devices_hint", "shown_layouts",
]

#: Fraction of the dense peak that large transformer matmuls reach end to end (Megatron-Core's weak-scaling
#: runs reach 41–49% of H100 peak with their communication hidden; this leaves the rest to the model below).
ACHIEVABLE_FRACTION = 0.5
#: Share of device memory the planner lets a layout use (the rest: allocator fragmentation, buffers, CUDA context).
MEMORY_HEADROOM = 0.9
#: Bytes autograd keeps per activation value (as :meth:`ModelSpec.activation_values_per_token` counts them) under
#: autocast to 16 bits: each matmul saves its low-precision cast of the input beside the fp32 values norms and
#: residuals keep (measured with saved-tensor hooks: 2.69 for a Llama block, 2.50 for a GPT-2 one).
AUTOCAST_ACTIVATION_BYTES = 2.7
#: Schedules that run every microbatch's forward before any backward: a stage holds all their activations.
ALL_FORWARDS_FIRST = ("gpipe", "loopedbfs")
#: How many times the devices at hand :func:`fewest_devices` looks up to, for a model that fits on none, and
#: the fewest devices it looks up to whatever the devices at hand
DEVICE_REACH, DEVICE_REACH_FLOOR = 64, 1024


class PlanError(ValueError):
    """No candidate layout fits; the message names the closest ones and what to change."""


@dataclass(frozen=True)
class Candidate:
    """One layout with its per-rank estimates (bytes, seconds)."""

    dp: int
    pp: int
    tp: int
    ep: int
    zero: int
    microbatches: int
    virtual_stages: int
    recompute: bool
    schedule: str  # the pipeline schedule (see meshlight.parallel.pipeline.SCHEDULES)
    model_state_bytes: float
    activation_bytes: float
    memory_limit: float
    times: dict[str, float]  # compute, bubble, tp, p2p, dp, ep, host (exposed seconds per step)
    tokens_per_step: int
    world: int
    flops_per_token: float
    peak_flops: float
    host_bytes: float = 0.0  # what the Offload callback keeps in host memory for this device
    host_limit: float = math.inf

    @property
    def memory_bytes(self) -> float:
        return self.model_state_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.memory_limit and self.host_bytes <= self.host_limit

    @property
    def step_time(self) -> float:
        return sum(self.times.values())

    @property
    def tokens_per_second_per_device(self) -> float:
        return self.tokens_per_step / self.step_time / self.world

    @property
    def mfu(self) -> float:
        return self.tokens_per_second_per_device * self.flops_per_token / self.peak_flops

    @property
    def layout(self) -> tuple[int, int, int, int]:
        return self.dp, self.pp, self.tp, self.ep

    @property
    def sizes(self) -> str:
        """``dp=… pp=… tp=…`` (and ``ep=…`` when experts are split)."""
        return f"dp={self.dp} pp={self.pp} tp={self.tp}" + (f" ep={self.ep}" if self.ep > 1 else "")

    def describe(self) -> str:
        parts = [self.sizes, f"zero={self.zero}"]
        if self.pp > 1:
            parts += [f"{self.schedule}", f"m={self.microbatches}"] + (
                [f"v={self.virtual_stages}"] if self.virtual_stages > 1 else [])
        elif self.microbatches > 1:
            parts.append(f"accumulate={self.microbatches}")
        if self.recompute:
            parts.append("recompute")
        return " ".join(parts)

    def strategy_arguments(self) -> dict[str, Any]:
        """Arguments of :class:`~meshlight.strategies.Hybrid3DStrategy` for this layout."""
        return dict(dp=self.dp, pp=self.pp, tp=self.tp, ep=self.ep, zero=self.zero, schedule=self.schedule,
                    microbatches=self.microbatches if self.pp > 1 else None, virtual_stages=self.virtual_stages)


def model_spec_of(module: nn.Module, seq_len: Optional[int] = None) -> ModelSpec:
    """The planner's view of ``module``: from a GPT-style ``config`` (``n_layers``, ``dim``, ``n_heads``,
    ``vocab_size``) anywhere in it, else from its structure (repeated blocks, their Linear widths, head-count
    attributes, the largest Embedding, MoE layers). ``seq_len`` default: the config's, else 2048."""
    for child in module.modules():
        config = getattr(child, "config", None)
        if all(hasattr(config, a) for a in ("n_layers", "dim", "n_heads", "vocab_size", "ffn_dim")):
            return ModelSpec.from_gpt_config(config, seq_len)
    from meshlight.nn import MoE
    from meshlight.parallel.data_parallel import repeated_blocks
    from meshlight.parallel.tensor_plan import HEAD_COUNT_ATTRIBUTES

    blocks = repeated_blocks(module)
    if not blocks:
        raise PlanError(f"{type(module).__name__} has no repeated blocks (an nn.ModuleList of layers) to plan"
                        " a layout for: give every size (dp, pp, tp, ep and zero).")
    linears = [m for m in blocks[0].modules() if isinstance(m, nn.Linear)]
    hidden = max(((m.in_features, sum(1 for n in linears if n.in_features == m.in_features)) for m in linears),
                 key=lambda pair: pair[1])[0] if linears else 0
    counts = {a: getattr(m, a) for m in blocks[0].modules() for a in HEAD_COUNT_ATTRIBUTES if hasattr(m, a)}
    heads = next((v for a, v in counts.items() if "kv" not in a and "key_value" not in a), max(hidden // 64, 1))
    kv_heads = next((v for a, v in counts.items() if "kv" in a or "key_value" in a), heads)
    widths = [m.out_features for m in linears if m.in_features == hidden and m.out_features != hidden]
    embeddings = [m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)]
    moe = next((m for m in module.modules() if isinstance(m, MoE)), None)
    moe_layers = sum(isinstance(m, MoE) for m in module.modules())
    return ModelSpec(layers=len(blocks), hidden=hidden, heads=heads, kv_heads=kv_heads,
                     ffn_hidden=max(widths, default=4 * hidden), vocab=max(embeddings, default=0),
                     seq_len=seq_len or 2048, experts=moe.num_experts if moe else 0, top_k=moe.top_k if moe else 1,
                     moe_every=max(len(blocks) // moe_layers, 1) if moe_layers else 1, name=type(module).__name__)


def precision_bytes(precision: str, param_dtype: Optional[torch.dtype] = None) -> dict[str, float]:
    """:class:`Hardware`'s ``param_bytes``, ``activation_bytes`` and ``state_bytes`` for a run with Lightning's
    ``precision`` flag (``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, …), or with meshlight's ``MixedPrecision``
    parameters in ``param_dtype`` (which overrides it). fp32 keeps 4 bytes of each; autocast keeps fp32
    parameters and state, and :data:`AUTOCAST_ACTIVATION_BYTES`; ``MixedPrecision`` computes with 16-bit
    parameters and activations from an fp32 master copy; 16-bit "true" precision keeps 2 bytes of everything,
    its gradients and the optimizer's moments included."""
    if param_dtype is not None:
        size = torch.finfo(param_dtype).bits // 8
        return {"param_bytes": size, "activation_bytes": size, "state_bytes": 4}
    if precision.endswith("-mixed"):
        return {"param_bytes": 4, "activation_bytes": AUTOCAST_ACTIVATION_BYTES, "state_bytes": 4}
    size = {"64": 8, "32": 4}.get(precision.split("-")[0], 2)
    return {"param_bytes": size, "activation_bytes": size, "state_bytes": size}


def preset_named(device_name: str) -> Optional[Hardware]:
    """The device preset whose key is in ``device_name`` ("NVIDIA H100 80GB HBM3": ``h100``; "NVIDIA H100 PCIe":
    ``h100-pcie``; "NVIDIA A100-PCIE-40GB": ``a100-pcie``), or None."""
    name = device_name.lower()
    kind = next((k for k in ("h200", "h100", "a100", "b200", "mi300x") if k in name), None)
    card = next((c for c in ("pcie", "nvl") if c in name), None)
    return HARDWARE.get(f"{kind}-{card}", HARDWARE[kind]) if kind else None


def detect_hardware(device: torch.device, processes_per_node: int) -> Hardware:
    """The preset matching ``device`` (CUDA by name, its memory as reported, and the process's float32 matmul
    precision), or the CPU preset; either with this node's host memory shared by its processes (a CPU process's
    memory is the host's). A CUDA device without a preset gets generic figures, with a warning that says how to
    give its own."""
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(processes_per_node, 1)
    except (ValueError, OSError, AttributeError):
        host = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        preset = preset_named(props.name)
        if preset is None:
            preset = Hardware(props.name, props.total_memory, 100e12, 100 * GB, 25 * GB)
            rank_zero_warn(
                f"meshlight has no figures for the device {props.name!r}: the planner and TrainingMonitor's MFU assume"
                f" {preset.peak_flops / 1e12:g} TFLOP/s for its matmuls (16-bit and fp32 alike),"
                f" {preset.intra_bandwidth / GB:g} GB/s between the devices of a node and"
                f" {preset.inter_bandwidth / GB:g} GB/s between nodes. Give its own: Hybrid3DStrategy(hardware="
                f"meshlight.parallel.planner.Hardware(name, memory, peak_flops, intra_bandwidth, inter_bandwidth,"
                f" fp32_flops=...)) and TrainingMonitor(peak_flops=...).")
        return preset.replace(memory=float(props.total_memory), devices_per_node=processes_per_node,
                              host_memory=float(host or preset.host_memory),
                              float32_matmul_precision=torch.get_float32_matmul_precision())
    memory = float(host or HARDWARE["cpu"].memory)
    return HARDWARE["cpu"].replace(memory=memory, host_memory=memory, devices_per_node=processes_per_node)


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
    recompute: Optional[bool] = None,
    schedule: Optional[str] = None,
    virtual_stages: Optional[int] = None,
    microbatches: Optional[int] = None,
) -> list[Candidate]:
    """Every valid candidate for ``world`` devices, highest throughput first, those that fit in memory before
    those that do not. The batch is ``global_batch`` sequences per optimizer step, or ``local_batch`` per data
    replica (as a LightningModule's DataLoader gives it: the global batch then grows with dp). Sizes given are
    kept fixed, and so are, for pipelined candidates, the ``schedule``, ``virtual_stages`` and ``microbatches``
    given (otherwise 1F1B or Interleaved1F1B with 2 virtual stages, and the best microbatch count)."""
    if (global_batch is None) == (local_batch is None):
        raise ValueError("Give exactly one of global_batch and local_batch.")
    _check_request(world, global_batch, local_batch, schedule, dp=dp, pp=pp, tp=tp, ep=ep, zero=zero,
                   virtual_stages=virtual_stages, microbatches=microbatches)
    pipelines = _pipeline_choices(schedule, virtual_stages, microbatches)
    candidates = [
        estimate(model, hardware, world, global_batch or local_batch * layout[0], *layout)
        for layout in _layouts(model, hardware, world, global_batch, local_batch, dp, pp, tp, ep, zero, recompute,
                               pipelines)
    ]
    if not candidates:
        message = _no_layout_message(model, hardware, world, global_batch, local_batch, pipelines, dp, pp, tp, ep)
        nearest = nearest_fitting(model, hardware, world, global_batch, local_batch=local_batch,
                                  given={"dp": dp, "pp": pp, "tp": tp, "ep": ep})
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
    """The best candidate of each (dp, pp, tp, ep), in the order given."""
    seen: dict[tuple[int, int, int, int], Candidate] = {}
    for candidate in candidates:
        seen.setdefault(candidate.layout, candidate)
    return list(seen.values())


def estimate(
    model: ModelSpec, hw: Hardware, world: int, global_batch: int, dp: int, pp: int, tp: int, ep: int, zero: int,
    microbatches: int, virtual_stages: int, recompute: bool, schedule: Optional[str] = None,
) -> Candidate:
    """Per-rank memory and step time of one layout (see the module docstring for the model). ``schedule``
    default: 1F1B, interleaved with more than one virtual stage."""
    schedule = schedule or _schedule_of(virtual_stages)
    s, h = model.seq_len, model.hidden
    micro_batch = global_batch // dp // microbatches
    layers_per_stage = math.ceil(model.layers / pp)
    # --- model state: the most loaded stage (blocks, plus the embedding or the head at either end)
    stage_share = layers_per_stage / model.layers
    ends = max(model.embedding_params, model.head_params) if pp > 1 else model.embedding_params + model.head_params
    dense = (model.block_params * stage_share + ends) / tp
    experts = model.expert_params * stage_share / (tp * ep)
    # ZeRO-3 without pipelining keeps the root unit (embedding and head) gathered from forward to backward
    root = model.embedding_params + model.head_params if pp == 1 else 0
    block = model.block_params / model.layers / tp
    model_state = (model_state_bytes(dense, dp, zero, hw, pipelined=pp > 1, block=block, root=root / tp)
                   + model_state_bytes(experts, dp // ep, zero, hw, pipelined=pp > 1))
    # --- activations of the first stage: micro-batches in flight × layers × per-layer bytes
    layer_activations = model.activation_values_per_token(tp) * s * micro_batch * hw.activation_bytes
    # with recomputation a block keeps only its input: the residual stream, split over the sequence under tp
    per_layer = s * micro_batch * h * hw.activation_bytes / tp if recompute else layer_activations
    # 1F1B: the first stage holds pp microbatches of its layers; interleaving adds (pp−1)/(pp·v) (Korthikanti);
    # GPipe and looped BFS run every forward first and hold them all
    interleave = 1 + (pp - 1) / (pp * virtual_stages) if virtual_stages > 1 else 1
    in_flight = microbatches if schedule in ALL_FORWARDS_FIRST else min(microbatches, pp) * interleave
    # blocks whose activations wait in host memory hold, on the device, the one being computed and the one
    # brought back ahead of its backward
    offloaded = hw.offload_activations
    activations = per_layer * layers_per_stage * in_flight * (1 - offloaded) + (2 * per_layer if offloaded else 0.0)
    # in host memory: the offloaded activations, and what optimizer offload keeps there
    host = (per_layer * layers_per_stage * in_flight * offloaded + host_state_bytes(dense, dp, zero, hw)
            + host_state_bytes(experts, dp // ep, zero, hw))
    if recompute:  # one layer's full activations during its recomputation
        activations += layer_activations
    # fp32 logits and their gradient, on the last stage; added to the first stage's activations (a bound)
    activations += 2 * s * micro_batch * model.vocab * 4 / tp
    # --- time
    tokens = global_batch * s
    flops = tokens * (model.flops_per_token() + (model.recompute_flops_per_token() if recompute else 0)) / world
    compute = flops / (hw.compute_flops * ACHIEVABLE_FRACTION)
    bubble = compute * (pp - 1) / (microbatches * virtual_stages) if pp > 1 else 0.0
    activation = s * micro_batch * h * hw.activation_bytes
    tp_time = 0.0
    if tp > 1:
        collectives = 6 if recompute else 4
        messages = layers_per_stage * microbatches * collectives
        tp_time = messages * (2 * (tp - 1) / tp * activation / _bandwidth(hw, tp, 1) + _ring_latency(hw, tp, 1))
    p2p = 0.0
    if pp > 1:  # activations forward and gradients back, and the schedule's actions, per microbatch and stage
        actions = 2 * microbatches * virtual_stages
        p2p = actions * (activation / tp / _bandwidth(hw, 2, world // pp) + 2 * hw.latency)
    grad_bytes = (dense + experts) * hw.state_bytes
    param_bytes = (dense + experts) * hw.param_bytes
    gathers = {0: 0, 1: 1, 2: 1, 3: 2 * microbatches}[zero]
    reductions = microbatches if zero >= 2 and pp == 1 else 1  # pipeline schedules reduce once per step
    kept_root = microbatches * root / tp * hw.param_bytes if zero == 3 else 0.0  # not gathered again in backward
    dp_bytes = (gathers * param_bytes - kept_root + reductions * grad_bytes * (1 if zero else 2)) * (dp - 1) / dp
    dp_messages = (layers_per_stage + 1) * (gathers + reductions)  # one collective per block and direction
    # an all-reduce (zero=0) is a reduce-scatter then an all-gather: twice the ring's steps
    dp_latency = dp_messages * _ring_latency(hw, dp, tp) * (1 if zero else 2)
    dp_time = dp_bytes / _bandwidth(hw, dp, tp) + dp_latency if dp > 1 else 0.0
    # reduced bucket by bucket during backward (2/3 of compute); the last bucket is exposed
    dp_exposed = max(0.0, dp_time - compute * 2 / 3) + dp_time / max(layers_per_stage, 1)
    ep_time = 0.0
    if ep > 1:
        routed = s * micro_batch * model.top_k * h * hw.activation_bytes * (ep - 1) / ep
        exchanges = 5 * model.moe_layers / pp * microbatches  # counts, then tokens out and back, both directions
        ep_time = exchanges * hw.latency + 4 * routed * model.moe_layers / pp * microbatches / _bandwidth(hw, ep, tp)
    host_time = _host_time(model, hw, world, compute, recompute,
                           moved=per_layer * layers_per_stage * microbatches * offloaded,
                           shard=host_state_bytes(dense, dp, zero, hw) + host_state_bytes(experts, dp // ep, zero, hw),
                           gathers=microbatches if zero == 3 else 1,
                           regathers=microbatches if zero == 3 else 0, reductions=reductions,
                           kept=host_state_bytes(root / tp, dp, zero, hw) if zero == 3 else 0.0)
    times = {"compute": compute, "bubble": bubble, "tp": tp_time, "p2p": p2p, "dp": dp_exposed, "ep": ep_time,
             "host": host_time}
    return Candidate(dp, pp, tp, ep, zero, microbatches, virtual_stages, recompute, schedule, model_state, activations,
                     hw.memory * MEMORY_HEADROOM, times, tokens, world, model.flops_per_token(), hw.peak_flops,
                     host, hw.host_memory * MEMORY_HEADROOM)


def model_state_bytes(params: float, dp: int, zero: int, hardware: Hardware, *, pipelined: bool = False,
                      block: float = 0.0, root: float = 0.0) -> float:
    """Bytes of ``params`` parameters (compute copy and master copy or shard), their gradients and Adam's two
    moments (``hardware.state_bytes`` each: fp32, or 16 bits in "true" 16-bit precision), data parallel over
    ``dp`` ranks with ZeRO stage ``zero``, at their peak inside a step (FSDP2: stages 1–2 keep the gathered
    parameters beside the shard; stage 1 keeps whole gradients until the step, stages 2–3 reduce-scatter them
    one ``block`` of parameters at a time; stage 3 gathers a block for compute and prefetches the next, beside
    the ``root`` parameters kept gathered from forward to backward). Inside a pipeline schedule (``pipelined``) PyTorch
    keeps every stage's parameters gathered after their first backward and defers the gradient reduce-scatter to
    the schedule's end, so stages 2 and 3 peak where stage 1 does. With ``hardware.offload_optimizer`` the
    shards, their gradients and the optimizer's state are in host memory: the device keeps what is gathered, and
    whole gradients while they wait to be reduced. Under offload or mixed precision FSDP2 runs every layout, over
    shard groups of one rank where nothing is sharded (``dp`` = 1)."""
    state = hardware.state_bytes
    if dp == 1 and not (hardware.offload_optimizer or hardware.param_bytes != state):
        return 4 * state * params  # no data-parallel wrapper: parameters, gradients and Adam's two moments
    if pipelined and zero:
        zero = 1
    shard = params / dp
    gathered = hardware.param_bytes * (params if zero < 3 else min(2 * block + root, params))
    whole_gradients = state * (params if zero <= 1 else min(block, params))
    if hardware.offload_optimizer:
        return gathered + whole_gradients
    gradients = whole_gradients + (state * shard if zero >= 2 else 0.0)
    master = state * (shard if zero else params) if hardware.param_bytes != state or zero else 0.0
    optimizer = 2 * state * (shard if zero else params)
    return gathered + master + gradients + optimizer


def host_state_bytes(params: float, dp: int, zero: int, hardware: Hardware) -> float:
    """Bytes of host memory per rank under ``hardware.offload_optimizer`` (else none): the master copy of the
    rank's share of ``params``, its gradients and Adam's two moments — sharded over ``dp`` ranks under ZeRO,
    whole on each without (FSDP2 then replicates over shard groups of one rank)."""
    if not hardware.offload_optimizer:
        return 0.0
    return 4 * hardware.state_bytes * (params / dp if zero else params)


def _host_time(model: ModelSpec, hw: Hardware, world: int, compute: float, recompute: bool, *, moved: float,
               shard: float, gathers: int, regathers: int, reductions: int, kept: float) -> float:
    """Seconds per step the ``Offload`` callback adds: the host link's copies beyond the compute of their phase,
    each direction at once, and the host's optimizer step. Forward sends the ``moved`` bytes of offloaded
    activations out and, under optimizer offload, brings each parameter's master shard in for each of its
    ``gathers`` (FSDP2 copies it to the device, then gathers); backward brings the activations back, the shards in
    again for ZeRO-3's ``regathers`` (but those of the root unit, whose host-held bytes are ``kept``: it stays
    gathered from forward to backward), and sends each gradient shard out after each of its ``reductions`` — all but
    the last while accumulating, which FSDP2 copies synchronously: exposed. ``shard``: the host-held bytes
    (:func:`host_state_bytes`: master copy, gradients and Adam's two moments, a quarter each), whose parameters
    the host steps after backward, with nothing to overlap, sharing the node's host memory with the ``world``'s other
    ranks there."""
    if not moved and not shard:
        return 0.0
    master = shard / 4
    forward_share = model.flops_per_token() / 3 / (
        model.flops_per_token() + (model.recompute_flops_per_token() if recompute else 0.0))
    forward = max(moved, gathers * master) / hw.host_bandwidth
    backward = max(moved + regathers * (master - kept / 4), master) / hw.host_bandwidth
    accumulating = (reductions - 1) * master / hw.host_bandwidth
    return (max(0.0, forward - compute * forward_share) + max(0.0, backward - compute * (1 - forward_share))
            + accumulating + master / hw.state_bytes / hw.host_steps_per_second(world))


def _bandwidth(hw: Hardware, size: int, stride: int) -> float:
    """Per-device bandwidth of a group of ``size`` ranks ``stride`` apart in the rank order."""
    span = size * stride
    return hw.intra_bandwidth if hw.devices_per_node % span == 0 else hw.inter_bandwidth


def _ring_latency(hw: Hardware, size: int, stride: int) -> float:
    """Latency of one all-gather or reduce-scatter over a ring of ``size`` ranks ``stride`` apart, as NCCL's
    tuning model has it: a base plus one hop latency per step (``size − 1`` steps, ``nodes − 1`` of them
    between nodes). It grows with the group, which is what makes ZeRO-3 over hundreds of ranks latency-bound."""
    per_node = max(1, min(size, hw.devices_per_node // stride))
    nodes = -(-size // per_node)
    return hw.latency + (size - nodes) * hw.hop_latency_intra + (nodes - 1) * hw.hop_latency_inter


def _layouts(
    model: ModelSpec, hw: Hardware, world: int, global_batch: Optional[int], local_batch: Optional[int],
    dp: Optional[int], pp: Optional[int], tp: Optional[int], ep: Optional[int], zero: Optional[int],
    recompute: Optional[bool], pipelines: _Pipelines,
) -> Iterable[tuple[Any, ...]]:
    """(dp, pp, tp, ep, zero, microbatches, virtual stages, recompute, schedule) of every valid candidate."""
    for t, p in itertools.product(_divisors(world), repeat=2):
        d = world // t // p if world % (t * p) == 0 else 0
        fixed = all(given is None or given == size for given, size in ((tp, t), (pp, p), (dp, d)))
        if not (d and fixed and p <= model.layers and _tp_fits(model, hw, t)):
            continue
        if global_batch is not None and global_batch % d:
            continue
        replica_batch = local_batch if global_batch is None else global_batch // d
        experts = [e for e in _divisors(d) if model.experts % e == 0] if model.experts else [1]
        for e, z, (s, v), r in itertools.product(
            experts if ep is None else [ep], (0, 1, 2, 3) if zero is None else [zero],
            pipelines.schedules if p > 1 else [("1f1b", 1)], (False, True) if recompute is None else [recompute],
        ):
            if p * v > model.layers or (model.experts and (model.experts % e or d % e)):
                continue
            # without pipelining, microbatches are gradient accumulation: the trainer's when it gives the batch
            accumulate = p == 1 and local_batch is not None
            for m in [1] if accumulate else pipelines.microbatch_choices(replica_batch, p, v):
                yield d, p, t, e, z, m, v, r, s


@dataclass(frozen=True)
class _Pipelines:
    """What a pipelined candidate may run: (schedule, virtual stages) pairs, and a fixed microbatch count
    (None: any that suits the replica's batch)."""

    schedules: tuple[tuple[str, int], ...]
    microbatches: Optional[int] = None

    def microbatch_choices(self, replica_batch: int, pp: int, virtual_stages: int) -> list[int]:
        if pp > 1 and self.microbatches is not None:
            return [self.microbatches] if replica_batch % self.microbatches == 0 else []
        return _microbatch_choices(replica_batch, pp, virtual_stages)


def _schedule_of(virtual_stages: int) -> str:
    """The schedule the planner assumes for this many stages per rank: 1F1B, interleaved beyond one."""
    return "1f1b" if virtual_stages == 1 else "interleaved1f1b"


def _pipeline_choices(schedule: Optional[str], virtual_stages: Optional[int],
                      microbatches: Optional[int]) -> _Pipelines:
    """The schedules a pipelined candidate may run: the one given (virtual stages: those given, else 1 for
    single-stage schedules and 2 for the rest), else 1F1B and Interleaved1F1B with 2 virtual stages (or those
    given)."""
    if schedule is not None:
        choices = [(schedule, virtual_stages or default_virtual_stages(schedule))]
    else:
        choices = [(_schedule_of(v), v) for v in ([1, 2] if virtual_stages is None else [virtual_stages])]
    return _Pipelines(tuple(choices), microbatches)


def _tp_fits(model: ModelSpec, hw: Hardware, tp: int) -> bool:
    if tp == 1:
        return True
    return (hw.devices_per_node % tp == 0 and not model.experts and model.heads % tp == 0
            and model.kv_heads % tp == 0 and model.ffn_hidden % tp == 0)


def _microbatch_choices(replica_batch: int, pp: int, virtual_stages: int) -> list[int]:
    """Microbatch counts dividing the replica's batch; under pipelining at least one per stage (interleaved
    schedules: a multiple of pp)."""
    if pp == 1:
        return _divisors(replica_batch)
    return [m for m in _divisors(replica_batch)
            if m >= pp * virtual_stages and (virtual_stages == 1 or m % pp == 0)]


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


def _no_layout_message(model: ModelSpec, hw: Hardware, world: int, global_batch: Optional[int],
                       local_batch: Optional[int], pipelines: _Pipelines, *sizes: Optional[int]) -> str:
    """Which constraints a world (and the sizes given) failed, and the nearest worlds and global batches that
    have a layout."""
    dp, pp, tp, ep = sizes
    given = ", ".join(f"{n}={v}" for n, v in zip(("dp", "pp", "tp", "ep"), sizes) if v is not None)
    hints = [f"tp must divide heads={model.heads}, kv_heads={model.kv_heads} and the MLP width"
             f" {model.ffn_hidden}, and stay within a node", f"pp ≤ layers={model.layers}",
             f"dp must divide the global batch and the microbatches a replica's batch"
             f" ({global_batch or local_batch})"]
    if pipelines.microbatches is not None:
        hints.append(f"microbatches={pipelines.microbatches} must divide a pipelined replica's batch")
    if model.experts:
        hints.append(f"ep must divide experts={model.experts} and dp")
    message = (f"No layout of {world} devices{' with ' + given if given else ''} suits {model.name}: "
               + "; ".join(hints) + ".")

    def valid(devices: int, batch: Optional[int]) -> bool:
        pipelined = _Pipelines(pipelines.schedules[:1], pipelines.microbatches)
        layouts = _layouts(model, hw, devices, batch, local_batch, dp, pp, tp, ep, None, False, pipelined)
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
             "p2p": "pipeline sends", "dp": "exposed data-parallel traffic", "ep": "expert all_to_all",
             "host": "offload's host copies and host step"}
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
    lines = [f"{'layout':<56} {'memory/rank':>12}" + (f" {'host/rank':>12}" if host else "")
             + f" {'step':>10} {'tokens/s/dev':>13} {'MFU':>6}  {'fits':>4}"]
    for c in rows:
        lines.append(f"{c.describe():<56} {_format_bytes(c.memory_bytes):>12}"
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
