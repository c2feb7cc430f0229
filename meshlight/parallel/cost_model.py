"""The layout planner's cost model: what one candidate layout costs each rank, analytically.

- **Memory**: parameters, gradients and optimizer state of the rank's share of the model (tensor, pipeline and expert
  splits — a multimodal model's encoder whole on every tp rank of the first stage —, then ZeRO over the data ranks —
  dp × cp: context-parallel ranks hold the same weights — as meshlight's FSDP2 ZeRO holds them: stages 1–2 keep the
  gathered parameters beside the shard, stage 3 a block gathered and the next one's gather in flight, stage 1 whole
  gradients, stages 2–3 one block's whole gradients at a time; inside a pipeline schedule every stage peaks as stage 1
  does, since PyTorch's schedules keep the parameters gathered and the gradients whole until the schedule's last
  backward; at the run's bytes per value — :func:`precision_bytes` — less what the ``Offload`` callback keeps in host
  memory), plus activations: per layer and micro-batch what autograd saves in meshlight's blocks
  (:meth:`ModelSpec.activation_values_per_token`, checked against saved-tensor hooks in the tests; about ``22·h/tp``
  values per token for Llama shapes: the inputs of the column-parallel projections are kept split and gathered again
  in backward, as in Megatron-Core), the block's input (``h/tp``) with full recomputation plus one block's activations
  while it is recomputed; stage ``s`` of a 1F1B pipeline holds ``pp − s`` micro-batches in flight (interleaved, as
  torch's schedule runs its forwards ahead: the first rank ``pp·(1 + (pp−1)/(pp·v))``, :func:`_blocks_held`;
  GPipe and looped BFS hold all of them); the last stage also holds fp32 logits; blocks whose activations are
  offloaded keep two blocks' worth in transit. Each pipeline rank is priced with its own blocks' state and
  activations, the first with the embedding, the last with the head (a copy of the embedding where the two are tied),
  and a layout needs what its most loaded rank needs. Context parallelism (``cp``) leaves each rank ``seq/cp`` tokens
  of every sequence, and a block's backward keeps the K/V its attention gathered over the whole sequence
  (``2·seq·heads·head_dim/tp`` values: K/V heads repeated to the query heads for the GPU kernels;
  :func:`_context_parallel_values`), in a recomputed block only while it is recomputed. What the ``Offload`` callback
  moves out (optimizer state with the master shards and their gradients, the offloaded activations) must fit the
  device's share of host memory, as the rest must fit the device.
- **Step time**: compute at :data:`ACHIEVABLE_FRACTION` of the device's dense peak for the run's matmuls
  (:attr:`Hardware.compute_flops`: 16-bit, or fp32 as torch's float32 matmul precision runs it; a head tied to the
  embedding counted, :meth:`ModelSpec.executed_flops_per_token`; recomputation adds the blocks' forward) on the most
  loaded rank — under pipelining, with the layers split evenly (``v`` stages of ``⌈layers/(pp·v)⌉`` a rank, as
  Megatron-Core splits them by default and ``split="layers"`` does), the last, which runs the LM head's matmul beside
  its blocks, or the first where it must hold more blocks (:attr:`ModelSpec.first_stage_layers`: Qwen3-VL's); with
  the stages' blocks given (``stage_blocks``: ``Hybrid3DStrategy`` gives those of the split it runs — by default
  balancing parameters, which lightens the last rank by about the head and the first by the embedding — or of one
  naming where stages begin), each rank's blocks are its stages', and the most loaded rank is priced — plus the
  memory-bound kernels between them streaming the activations at the device memory's bandwidth
  (:func:`_streamed_time`: four passes over what autograd saves, a fifth with recomputation), stretched by the
  pipeline bubble ``(pp−1)/(m·v)``; tensor/sequence-parallel traffic (4 collectives of the activations per layer and
  micro-batch, 6 with recomputation) not overlapped; pipeline p2p; data
  parallel traffic (2·P, 3·P for ZeRO-3 less the root unit — embedding and head, kept gathered from forward to
  backward without pipelining — parameters gathered again for every micro-batch under ZeRO-3 and,
  without pipelining, gradients reduce-scattered per micro-batch under ZeRO-2) overlapped with backward compute
  except the last bucket (as Megatron-Core overlaps it; meshlight's pipeline schedules still reduce after the
  last microbatch);
  expert all_to_all (4 exchanges of the routed tokens per MoE layer and micro-batch); context parallelism's K/V
  all-gather before each layer's attention (again when it is recomputed) and the reduce-scatter of their gradients
  in backward, ``(cp−1)/cp`` of the whole sequence's K/V per rank, not overlapped (:func:`_kv_exchange_time`);
  what the ``Offload`` callback adds: its host-link copies (offloaded activations out in forward and back in
  backward; under optimizer offload the master shards in for each gather and the gradient shards out) beyond the
  compute of their phase, and the host's optimizer step, which nothing overlaps; and latencies: a fixed one per p2p
  message and pipeline action (what makes many tiny microbatches slow), and for each TP and DP
  collective NCCL's ring model — a base plus one hop per ring step, inter-node hops slower (what makes ZeRO-3
  over hundreds of ranks latency-bound). Links: a group within one node uses the intra-node bandwidth;
  one spanning nodes the NICs of its members on each node together, up to the intra-node bandwidth (NCCL's
  rings run one channel per NIC, so a ring over whole nodes crosses between them on all of a node's NICs at
  once, and a group with one member per node on that member's NIC alone) (mesh order pp, dp, ep, cp, tp: tp
  innermost, cp next to it). Compute needs no
  term of its own for cp: each rank runs ``1/cp`` of every sequence's tokens through the weights and, its chunks
  balanced (an early and a late one), ``1/cp`` of the causal attention.

:func:`estimate` prices one layout; :mod:`meshlight.parallel.planner` searches the layouts and ranks them.
The assumptions are deliberately few; ``benchmarks/planner.py`` measures how far they are from published
large-scale runs and from the model state meshlight actually holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from meshlight.parallel.pipeline import rank_holding, stages_of_rank
from meshlight.parallel.presets import Hardware, ModelSpec

__all__ = [
    "ACHIEVABLE_FRACTION", "ALL_FORWARDS_FIRST", "AUTOCAST_ACTIVATION_BYTES", "MEMORY_HEADROOM", "Candidate",
    "estimate", "host_state_bytes", "model_state_bytes", "precision_bytes",
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


@dataclass(frozen=True)
class Candidate:
    """One layout with its per-rank estimates (bytes, seconds)."""

    dp: int
    pp: int
    tp: int
    ep: int
    cp: int  # ranks each sequence is split over
    zero: int
    microbatches: int
    virtual_stages: int
    recompute: bool
    schedule: str  # the pipeline schedule (see meshlight.parallel.pipeline.SCHEDULES)
    rank_state: tuple[float, ...]  # model-state bytes of each pipeline rank
    rank_activations: tuple[float, ...]  # activation bytes each pipeline rank holds at its peak
    memory_limit: float
    times: dict[str, float]  # compute, bubble, tp, cp, p2p, dp, ep, host (exposed seconds per step)
    tokens_per_step: int
    world: int
    flops_per_token: float
    peak_flops: float
    host_bytes: float = 0.0  # what the Offload callback keeps in host memory for this device
    host_limit: float = math.inf
    experts: str = "split"  # under tp, MoE experts split over the tp ranks or folded (ep spanning them)
    stage_blocks: Optional[tuple[int, ...]] = None  # the blocks of each pipeline stage it is priced with (None: even)

    @property
    def model_state_bytes(self) -> float:
        """The model state of the rank holding the most."""
        return max(self.rank_state)

    @property
    def activation_bytes(self) -> float:
        """The activations of the rank holding the most."""
        return max(self.rank_activations)

    @property
    def memory_bytes(self) -> float:
        """The peak of the rank whose model state and activations together are the most."""
        return max(state + held for state, held in zip(self.rank_state, self.rank_activations))

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
    def layout(self) -> tuple[int, int, int, int, int]:
        return self.dp, self.pp, self.tp, self.ep, self.cp

    @property
    def folded(self) -> bool:
        """Whether expert parallelism spans the tp ranks (the experts whole on each)."""
        return self.experts == "fold" and self.tp > 1 and self.ep > 1

    @property
    def sizes(self) -> str:
        """``dp=… pp=… tp=…`` (and ``cp=…`` when sequences are split, ``ep=…`` when experts are, ``(folded)`` when
        ep spans the tp ranks)."""
        return (f"dp={self.dp} pp={self.pp} tp={self.tp}" + (f" cp={self.cp}" if self.cp > 1 else "")
                + (f" ep={self.ep}" if self.ep > 1 else "") + (" (folded)" if self.folded else ""))

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
        return dict(dp=self.dp, pp=self.pp, tp=self.tp, ep=self.ep, cp=self.cp, zero=self.zero,
                    schedule=self.schedule, microbatches=self.microbatches if self.pp > 1 else None,
                    virtual_stages=self.virtual_stages, experts="fold" if self.folded else "split")


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


def estimate(
    model: ModelSpec, hw: Hardware, world: int, global_batch: int, dp: int, pp: int, tp: int, ep: int, zero: int,
    microbatches: int, virtual_stages: int, recompute: bool, schedule: Optional[str] = None, cp: int = 1,
    experts: str = "split", stage_blocks: Optional[Sequence[int]] = None,
) -> Candidate:
    """Per-rank memory and step time of one layout (see the module docstring for the model). ``schedule``
    default: 1F1B, interleaved with more than one virtual stage. ``cp``: ranks each sequence is split over.
    ``experts``: under tp, MoE experts split over the tp ranks (``"split"``) or whole, ep spanning them (``"fold"``).
    ``stage_blocks``: the blocks of each of the ``pp × virtual_stages`` stages, where a split fixes them (default: an
    even split)."""
    schedule = schedule or _schedule_of(virtual_stages)
    s, h = model.seq_len, model.hidden
    local = s / cp  # tokens of each sequence on this rank
    data = dp * cp  # ranks holding the same weights: gradients are reduced and ZeRO shards over them
    micro_batch = global_batch // dp // microbatches
    # the blocks of each rank, and of the most loaded one; the LM head's matmul runs on the rank of the last stage
    stages = _rank_stages(model, pp, virtual_stages, schedule, stage_blocks)
    loads = [sum(blocks) for blocks in stages]
    moe_shares = _moe_shares(model, pp, virtual_stages, schedule, stage_blocks)
    head_rank = rank_holding(pp * virtual_stages - 1, pp, schedule) if pp > 1 else 0
    layers_per_stage = max(loads)
    # --- model state of each rank: its blocks, the embedding (and an encoder beside the decoder, whole on every tp
    # rank) on the first stage's, the LM head on the last stage's (a copy of the token embedding where it is tied)
    head_params = model.vocab * h if head_rank != 0 else model.head_params
    # (the blocks holding experts hold them in place of a dense MLP: DeepSeek's dense first layers are the first rank's)
    dense = [(model.blocks_params(load, load * share) + (model.embedding_params if rank == 0 else 0)
              + (head_params if rank == head_rank else 0)) / tp + (model.encoder_params if rank == 0 else 0)
             for rank, (load, share) in enumerate(zip(loads, moe_shares))]
    folded = experts == "fold" and tp > 1 and ep > 1
    # folded, whole experts over ep ranks that span tp: the ranks holding the same ones are data·tp/ep
    experts_shard = [model.experts * model.mlp_params * load * share / (ep if folded else tp * ep)
                     for load, share in zip(loads, moe_shares)]
    expert_data = data * tp // ep if folded else data // ep
    # ZeRO-3 without pipelining keeps the root unit (embedding and head) gathered from forward to backward
    root = model.embedding_params + model.head_params if pp == 1 else 0
    block = model.block_params / model.layers / tp
    model_state = [model_state_bytes(d, data, zero, hw, pipelined=pp > 1, block=block, root=root / tp,
                                     trainable=model.trainable)
                   + model_state_bytes(e, expert_data, zero, hw, pipelined=pp > 1, trainable=model.trainable)
                   for d, e in zip(dense, experts_shard)]
    host_state = [host_state_bytes(d, data, zero, hw, trainable=model.trainable)
                  + host_state_bytes(e, expert_data, zero, hw, trainable=model.trainable)
                  for d, e in zip(dense, experts_shard)]
    # --- activations of each rank: micro-batches in flight × its blocks × per-layer bytes
    # bytes per saved value, where ActivationCompression keeps some blocks' in fewer (never more) bytes
    compressed = hw.compressed_activations
    saved_bytes = hw.activation_bytes * (1 - compressed) + min(hw.activation_bytes,
                                                                hw.compressed_activation_bytes) * compressed
    layer_activations = [(model.activation_values_per_token(tp, share) * local * micro_batch
                          + _context_parallel_values(model, cp, tp, micro_batch)) * saved_bytes for share in moe_shares]
    # with recomputation a block keeps only its input: the residual stream, split over the sequence under tp
    per_layer = [local * micro_batch * h * saved_bytes / tp if recompute else values for values in layer_activations]
    held = [_blocks_held(rank, blocks, pp, microbatches, virtual_stages, schedule)
            for rank, blocks in enumerate(stages)]
    # blocks whose activations wait in host memory hold, on the device, the one being computed and the one
    # brought back ahead of its backward
    offloaded = hw.offload_activations
    # beside them: one layer's full activations during its recomputation, and on the last stage fp32 logits and
    # their gradient (the logits of every micro-batch where all forwards, the loss's included, run first)
    logits = local * micro_batch * model.vocab * 4 / tp * (
        1 + (microbatches if schedule in ALL_FORWARDS_FIRST and pp > 1 else 1))
    activations = [per_layer[rank] * blocks * (1 - offloaded) + (2 * per_layer[rank] if offloaded else 0.0)
                   + (layer_activations[rank] if recompute else 0.0) + (logits if rank == head_rank else 0.0)
                   for rank, blocks in enumerate(held)]
    # in host memory: the offloaded activations, and what optimizer offload keeps there
    host = max(values * blocks * offloaded + state for values, blocks, state in zip(per_layer, held, host_state))
    # --- time
    tokens = global_batch * s
    recomputed = model.recompute_flops_per_token() if recompute else 0
    per_token = model.executed_flops_per_token() + recomputed
    if pp > 1:  # a pipeline runs at its most loaded rank's pace: the last stage's, which runs the LM head beside its
        head = model.head_flops_per_token()  # blocks, or one that holds more blocks (or more of those with experts)
        per_block = (per_token - head) / model.layers
        mean_layer = model.layer_flops_per_token(model.moe_layers / model.layers)
        paces = [per_block * load * model.layer_flops_per_token(share) / mean_layer + (head if rank == head_rank else 0)
                 for rank, (load, share) in enumerate(zip(loads, moe_shares))]
        per_token = pp * max(paces)
    compute = tokens * per_token / world / (hw.compute_flops * ACHIEVABLE_FRACTION) + _streamed_time(
        model, hw, tp, global_batch * s / data, recompute, layers_per_stage)
    bubble = compute * (pp - 1) / (microbatches * virtual_stages) if pp > 1 else 0.0
    activation = local * micro_batch * h * hw.activation_bytes
    tp_time = 0.0
    if tp > 1:
        collectives = 6 if recompute else 4
        messages = layers_per_stage * microbatches * collectives
        tp_time = messages * (2 * (tp - 1) / tp * activation / _bandwidth(hw, tp, 1) + _ring_latency(hw, tp, 1))
    cp_time = _kv_exchange_time(model, hw, cp, tp, micro_batch, layers_per_stage * microbatches, recompute)
    p2p = 0.0
    if pp > 1:  # activations forward and gradients back, and the schedule's actions, per microbatch and stage
        actions = 2 * microbatches * virtual_stages
        p2p = actions * (activation / tp / _bandwidth(hw, 2, world // pp) + 2 * hw.latency)
    synced = max(d + e for d, e in zip(dense, experts_shard))  # the parameters of the rank with the most
    grad_bytes = synced * model.trainable * hw.state_bytes * hw.gradient_compression
    param_bytes = synced * hw.param_bytes
    gathers = {0: 0, 1: 1, 2: 1, 3: 2 * microbatches}[zero]
    reductions = microbatches if zero >= 2 and pp == 1 else 1  # pipeline schedules reduce once per step
    kept_root = microbatches * root / tp * hw.param_bytes if zero == 3 else 0.0  # not gathered again in backward
    dp_bytes = (gathers * param_bytes - kept_root + reductions * grad_bytes * (1 if zero else 2)) * (data - 1) / data
    dp_messages = (layers_per_stage + 1) * (gathers + reductions)  # one collective per block and direction
    # an all-reduce (zero=0) is a reduce-scatter then an all-gather: twice the ring's steps
    dp_latency = dp_messages * _ring_latency(hw, data, tp) * (1 if zero else 2)
    dp_time = dp_bytes / _bandwidth(hw, data, tp) + dp_latency if data > 1 else 0.0
    # reduced bucket by bucket during backward (2/3 of compute); the last bucket is exposed
    dp_exposed = max(0.0, dp_time - compute * 2 / 3) + dp_time / max(layers_per_stage, 1)
    ep_time = 0.0
    if ep > 1:
        # every tp rank routes the whole tokens; split, each sends all of them (to its slice of the experts), folded
        # each sends its 1/tp part, over ep ranks adjacent to it
        routed = local * micro_batch * model.top_k * h * hw.activation_bytes * (ep - 1) / ep / (tp if folded else 1)
        moe_held = max(load * share for load, share in zip(loads, moe_shares))  # the most loaded rank's MoE blocks
        exchanges = 5 * moe_held * microbatches  # counts, then tokens out and back, both directions
        link = _bandwidth(hw, ep, 1 if folded else tp)
        ep_time = exchanges * hw.latency + 4 * routed * moe_held * microbatches / link
    host_time = _host_time(model, hw, world, compute, recompute,
                           moved=max(per_layer) * layers_per_stage * microbatches * offloaded,
                           shard=max(host_state),
                           gathers=microbatches if zero == 3 else 1,
                           regathers=microbatches if zero == 3 else 0, reductions=reductions,
                           kept=host_state_bytes(root / tp, data, zero, hw, trainable=model.trainable)
                           if zero == 3 else 0.0)
    times = {"compute": compute, "bubble": bubble, "tp": tp_time, "cp": cp_time, "p2p": p2p, "dp": dp_exposed,
             "ep": ep_time, "host": host_time}
    return Candidate(dp, pp, tp, ep, cp, zero, microbatches, virtual_stages, recompute, schedule, tuple(model_state),
                     tuple(activations), hw.memory * MEMORY_HEADROOM, times, tokens, world, model.flops_per_token(),
                     hw.peak_flops, host, hw.host_memory * MEMORY_HEADROOM, "fold" if folded else "split",
                     tuple(stage_blocks) if stage_blocks and pp > 1 else None)


def _blocks_held(rank: int, stages: Sequence[int], pp: int, microbatches: int, virtual_stages: int,
                 schedule: str) -> float:
    """Blocks × micro-batches whose activations pipeline rank ``rank`` holds at its peak, its ``stages`` holding
    those blocks (in the order it runs them): under 1F1B stage ``s`` holds ``pp − s`` micro-batches; under torch's
    interleaved 1F1B the most held over torch's order of the rank's forwards and backwards (a round of ``pp``
    micro-batches of each stage in turn; ``(v−1)·pp + 2·(pp−1−rank)`` forwards ahead of the first backward, then one
    of each: with even stages the peak is at that first backward, ``pp·(1 + (pp−1)/(pp·v))`` micro-batches on the
    first rank, as Korthikanti counts, but a heavier stage's forward may enter while a lighter one's backward
    leaves); for the other interleaved schedules that first rank's count bounds every rank's; GPipe and looped BFS
    run every forward first and hold them all."""
    blocks = sum(stages)
    if pp == 1:  # micro-batches accumulate one after another
        return blocks
    if schedule in ALL_FORWARDS_FIRST:
        return blocks * microbatches
    if schedule == "1f1b":
        return blocks * min(microbatches, pp - rank)
    if schedule == "interleaved1f1b":  # torch runs rounds of pp microbatches (all of them in one, with fewer)
        per_round = microbatches // max(1, microbatches // pp)
        total = microbatches * virtual_stages
        warmup = min((virtual_stages - 1) * per_round + 2 * (pp - 1 - rank), total)
        held = peak = sum(stages[step // per_round % virtual_stages] for step in range(warmup))
        # the steady state repeats with a period of v rounds: one period after the warmup bounds it
        for step in range(warmup, min(total, warmup + virtual_stages * per_round + 1)):
            held += stages[step // per_round % virtual_stages]
            peak = max(peak, held)
            held -= stages[virtual_stages - 1 - (step - warmup) // per_round % virtual_stages]
        return peak
    interleave = 1 + (pp - 1) / (pp * virtual_stages) if virtual_stages > 1 else 1
    return blocks * min(microbatches, pp) * interleave


def _moe_shares(model: ModelSpec, pp: int, virtual_stages: int, schedule: str,
                stage_blocks: Optional[Sequence[int]]) -> list[float]:
    """For each of the ``pp`` ranks, the share of the blocks it holds that hold experts
    (:meth:`~meshlight.parallel.presets.ModelSpec.moe_positions_of`), its stages cut as :func:`_rank_stages` cuts
    them; the model's share where a rank holds no whole block."""
    overall = model.moe_layers / model.layers
    if pp == 1 or not model.experts:
        return [overall] * pp
    positions, stages = model.moe_positions_of(), pp * virtual_stages
    sizes = _stage_sizes(model, stages, stage_blocks)
    starts = [sum(sizes[:stage]) for stage in range(stages)]
    shares = []
    for rank in range(pp):
        held = [index for stage in stages_of_rank(rank, pp, virtual_stages, schedule)
                for index in range(starts[stage], min(starts[stage] + sizes[stage], model.layers))]
        shares.append(sum(index in positions for index in held) / len(held) if held else overall)
    return shares


def _rank_stages(model: ModelSpec, pp: int, virtual_stages: int, schedule: str,
                 stage_blocks: Optional[Sequence[int]]) -> list[list[int]]:
    """The blocks of each stage each of the ``pp`` ranks holds, in the order it runs them: a split's
    (``stage_blocks``), placed as ``schedule`` places them; else ``virtual_stages`` stages of ``⌈layers/(pp·v)⌉``
    each, as an even split gives them, the first rank's first stage at least :attr:`ModelSpec.first_stage_layers`
    (Qwen3-VL's: the blocks its encoder's features are fed to)."""
    if pp == 1:
        return [[model.layers]]
    sizes = _stage_sizes(model, pp * virtual_stages, stage_blocks)
    return [[sizes[stage] for stage in stages_of_rank(rank, pp, virtual_stages, schedule)] for rank in range(pp)]


def _stage_sizes(model: ModelSpec, stages: int, stage_blocks: Optional[Sequence[int]]) -> list[int]:
    """The blocks of each of ``stages`` stages, in stage order: a split's, else ``⌈layers/stages⌉`` each, the first at
    least :attr:`ModelSpec.first_stage_layers`."""
    if stage_blocks:
        return list(stage_blocks)
    share = math.ceil(model.layers / stages)
    return [max(share, model.first_stage_layers)] + [share] * (stages - 1)


def model_state_bytes(params: float, dp: int, zero: int, hardware: Hardware, *, pipelined: bool = False,
                      block: float = 0.0, root: float = 0.0, trainable: float = 1.0) -> float:
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
    shard groups of one rank where nothing is sharded (``dp`` = 1). Only the ``trainable`` share of the parameters
    has gradients and moments; the frozen rest is parameters alone (master copy included)."""
    state = hardware.state_bytes
    if dp == 1 and not (hardware.offload_optimizer or hardware.param_bytes != state):
        return (1 + 3 * trainable) * state * params  # no data-parallel wrapper: parameters; gradients, Adam's moments
    if pipelined and zero:
        zero = 1
    shard = params / dp
    gathered = hardware.param_bytes * (params if zero < 3 else min(2 * block + root, params))
    whole_gradients = trainable * state * (params if zero <= 1 else min(block, params))
    if hardware.offload_optimizer:
        return gathered + whole_gradients
    gradients = whole_gradients + (trainable * state * shard if zero >= 2 else 0.0)
    master = state * (shard if zero else params) if hardware.param_bytes != state or zero else 0.0
    optimizer = 2 * trainable * state * (shard if zero else params)
    return gathered + master + gradients + optimizer


def host_state_bytes(params: float, dp: int, zero: int, hardware: Hardware, *, trainable: float = 1.0) -> float:
    """Bytes of host memory per rank under ``hardware.offload_optimizer`` (else none): the master copy of the
    rank's share of ``params``, and of its ``trainable`` share the gradients and Adam's two moments — sharded over
    ``dp`` ranks under ZeRO, whole on each without (FSDP2 then replicates over shard groups of one rank)."""
    if not hardware.offload_optimizer:
        return 0.0
    return (1 + 3 * trainable) * hardware.state_bytes * (params / dp if zero else params)


def _host_time(model: ModelSpec, hw: Hardware, world: int, compute: float, recompute: bool, *, moved: float,
               shard: float, gathers: int, regathers: int, reductions: int, kept: float) -> float:
    """Seconds per step the ``Offload`` callback adds: the host link's copies beyond the compute of their phase,
    each direction at once, and the host's optimizer step. Forward sends the ``moved`` bytes of offloaded
    activations out and, under optimizer offload, brings each parameter's master shard in for each of its
    ``gathers`` (FSDP2 copies it to the device, then gathers); backward brings the activations back, the shards in
    again for ZeRO-3's ``regathers`` (but those of the root unit, whose host-held bytes are ``kept``: it stays
    gathered from forward to backward), and sends each gradient shard out after each of its ``reductions`` — all but
    the last while accumulating, which FSDP2 copies synchronously: exposed. ``shard``: the host-held bytes
    (:func:`host_state_bytes`: master copy, and of the trainable share gradients and Adam's two moments, as many
    bytes each), whose trainable parameters the host steps after backward, with nothing to overlap, sharing the
    node's host memory with the ``world``'s other ranks there. Frozen parameters travel in as the others do, but
    send no gradient out and take no step."""
    if not moved and not shard:
        return 0.0
    per_copy = 1 + 3 * model.trainable  # host-held bytes per master byte
    master, kept_master = shard / per_copy, kept / per_copy
    trained = model.trainable * master  # bytes of the trainable share's master copy (and of its gradients)
    forward_share = model.executed_flops_per_token() / 3 / (
        model.executed_flops_per_token() + (model.recompute_flops_per_token() if recompute else 0.0))
    forward = max(moved, gathers * master) / hw.host_bandwidth
    backward = max(moved + regathers * (master - kept_master), trained) / hw.host_bandwidth
    accumulating = (reductions - 1) * trained / hw.host_bandwidth
    return (max(0.0, forward - compute * forward_share) + max(0.0, backward - compute * (1 - forward_share))
            + accumulating + trained / hw.state_bytes / hw.host_steps_per_second(world))


def _context_parallel_values(model: ModelSpec, cp: int, tp: int, micro_batch: int) -> float:
    """Values a block's attention keeps for backward under context parallelism beside its own tokens': the K/V it
    gathered over the whole sequence, split over tp — on a GPU at the query heads, to which meshlight's all-gather
    attention repeats a GQA model's K/V heads for the flash and efficient kernels (which take as many). Its chunks'
    causal masks are no values: those kernels apply a mask aligned to the lower right without building it."""
    if cp == 1:
        return 0.0
    return 2 * model.seq_len * model.heads * model.head_dim / tp * micro_batch


def _kv_exchange_time(model: ModelSpec, hw: Hardware, cp: int, tp: int, micro_batch: int, passes: int,
                      recompute: bool) -> float:
    """Seconds per step context parallelism's K/V exchange takes on a rank, over ``passes`` layer-microbatch passes:
    K and V all-gathered over the ``cp`` ranks (``tp`` apart) before each layer's attention, again when it is
    recomputed, and their gradients reduce-scattered in backward — each ``(cp−1)/cp`` of the whole sequence's K/V
    (at the model's K/V heads, split over tp), two ring collectives. None of it is hidden: meshlight's attention
    waits for the gathered K/V at once (nothing is left to compute beside them), and the K/V projections' backward
    needs the reduced gradients next. The bytes grow with the sequence, attention's compute with its square, so
    at long sequences this is small beside the step anyway."""
    if cp == 1:
        return 0.0
    kv = 2 * model.seq_len * micro_batch * model.kv_heads * model.head_dim / tp * hw.activation_bytes
    exchanges = passes * (3 if recompute else 2)
    return exchanges * ((cp - 1) / cp * kv / _bandwidth(hw, cp, tp) + 2 * _ring_latency(hw, cp, tp))


def _streamed_time(model: ModelSpec, hw: Hardware, tp: int, tokens: float, recompute: bool, layers: int) -> float:
    """Seconds per step a rank's memory-bound kernels take — norms, activations, residual adds, rotary, routing's
    copies, the loss's softmax — which stream activations through device memory at ``hw.memory_bandwidth`` while
    the tensor cores idle: every value autograd saves (:meth:`ModelSpec.activation_values_per_token`) is written
    once in forward and read once in backward, and its gradient written and read once, four passes (five when the
    forward is recomputed), over ``layers`` blocks and ``tokens`` of this rank; and the fp32 logits, written and
    read in forward, their gradient in backward. Per token the passes grow with the width and the matmuls with
    its square, so this is what keeps narrow models (and fine-grained experts) below the matmuls' rate."""
    passes = 5 if recompute else 4
    block = passes * model.activation_values_per_token(tp) * hw.activation_bytes * layers
    logits = 4 * 4 * model.vocab / tp
    return tokens * (block + logits) / hw.memory_bandwidth


def _bandwidth(hw: Hardware, size: int, stride: int) -> float:
    """Per-device bandwidth of a group of ``size`` ranks ``stride`` apart in the rank order: the intra-node link
    within a node; across nodes, the NICs of the group's members on a node together (NCCL's rings, a channel per
    NIC, leave each node on all of them at once), at most what the intra-node link carries to them."""
    span = size * stride
    if hw.devices_per_node % span == 0:
        return hw.intra_bandwidth
    per_node = max(1, min(size, hw.devices_per_node // stride))
    return min(hw.intra_bandwidth, per_node * hw.inter_bandwidth)


def _ring_latency(hw: Hardware, size: int, stride: int) -> float:
    """Latency of one all-gather or reduce-scatter over a ring of ``size`` ranks ``stride`` apart, as NCCL's
    tuning model has it: a base plus one hop latency per step (``size − 1`` steps, ``nodes − 1`` of them
    between nodes). It grows with the group, which is what makes ZeRO-3 over hundreds of ranks latency-bound."""
    per_node = max(1, min(size, hw.devices_per_node // stride))
    nodes = -(-size // per_node)
    return hw.latency + (size - nodes) * hw.hop_latency_intra + (nodes - 1) * hw.hop_latency_inter


def _schedule_of(virtual_stages: int) -> str:
    """The schedule the planner assumes for this many stages per rank: 1F1B, interleaved beyond one."""
    return "1f1b" if virtual_stages == 1 else "interleaved1f1b"
