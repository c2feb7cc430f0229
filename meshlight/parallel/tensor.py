"""Tensor parallelism (+ sequence parallelism) with DTensor on the mesh's ``tp`` axis.

A plan gives each module a role; :func:`apply_tensor_parallel` turns roles into PyTorch parallel styles:

================= =========================================================================================
role              what it does
================= =========================================================================================
``colwise``       Linear sharded by output features (a block's q, k, v, up, gate projections)
``fused_colwise`` a fused projection (q|k|v, k|v, gate|up, its parts one after another): this rank computes its
                  share of each part (see below)
``rowwise``       Linear sharded by input features, output summed over tp (a block's output projections)
``embedding``     token embedding sharded by vocabulary (masked lookup, outputs summed over tp)
``head``          LM head sharded by vocabulary; in training its logits stay sharded for loss parallelism
``norm``          with sequence parallelism: runs on this rank's share of the sequence (outside the blocks, only in
                  Megatron-LM's region; see below)
``head_norm``     a norm over each head inside attention (QK-norm): runs on this rank's heads, its weight a
                  replicated DTensor, so its gradient is the sum over the ranks' heads
``colwise_norm``  a norm over a colwise projection's whole output (OLMo 2's q and k norms over all heads at once):
                  its vectors sharded as that output, its statistics summed over tp (:class:`_ColwiseNorm`)
``latent``        a latent attention's down-projection to a latent every head reads, or a norm over it (DeepSeek's
                  multi-head latent attention), or a module picking the keys every head reads (a sparse attention's
                  indexer, with its submodules): whole on every rank, run on plain tensors, its gradient summed over
                  tp; the up-projections that read a latent (``colwise``) run on plain tensors too, each rank's
                  heads (:class:`_OnLocalWeights`)
``interior``      a module holding parameters between a column→row group's readers and its writer (a learned
                  activation, Apertus's xIELU): runs on this rank's hidden units, its parameters replicated DTensors
                  whose gradients are summed over tp (:class:`_Interior`)
``replicate``     left whole on every rank. Under sequence parallelism (in its region) an Embedding's output is cut
                  to this rank's share of the sequence (learned positions), and a Linear runs on that share with its
                  weights a replicated DTensor, so its gradient is the sum over the shares (a gate)
``whole``         a sequence mixer left whole on every rank (a linear attention's recurrence, Qwen3.5's): under
                  sequence parallelism it reads the whole sequence and hands on its share (:class:`_WholeMixer`)
================= =========================================================================================

With sequence parallelism the region that runs on this rank's share of the sequence is Megatron-LM's when the model
holds nothing outside its blocks but a token embedding, position tables, norms and an LM head: the embedding's output is
reduce-scattered over the sequence and the LM head gathers its input. A model with more outside its blocks (an adapter,
a factorized embedding's projection, a value head, a class token) keeps those on the whole sequence, as without
sequence parallelism: the first block's input is cut to this rank's share and the last block's output gathered
(:func:`~meshlight.parallel.tensor_plan.sequence_region`).

Linear means ``nn.Linear`` or Hugging Face's ``Conv1D`` (GPT-2's, its weight stored ``[in, out]``). A fused projection
packs its parts one after another (GPT-2's ``c_attn`` is q|k|v; litgpt's ``qkv`` is q|k|v with fewer key/value heads);
column sharding would hand one rank all of q and another all of v. Each rank computes its heads of every part instead
(:class:`_FusedColwise`): the weight is stored sharded over tp by rows like any other, gathered whole for the forward
(an all-gather of the fused weight per call), and its gradient reduce-scattered back, as FSDP does for a whole
model. Checkpoints, full state dicts and resharding see the weight in its own layout. Storing each rank's rows of
every part instead would save that traffic; DTensor has no placement for it (``_StridedShard`` has equal parts only,
and DCP would save its non-contiguous shard as one chunk), so it is not done.

Per block the traffic is Megatron-LM's: in forward the input of each colwise group is gathered once — an
all-gather of the sequence with sequence parallelism, nothing otherwise — and in backward its gradient is
reduced once; each rowwise output is reduce-scattered over the sequence (or all-reduced without sequence
parallelism). Backward keeps a colwise group's input as this rank's share of the sequence and gathers it
once more, as Megatron-LM does (:mod:`meshlight.parallel.sequence_gather`; ``keep_gathered_inputs`` keeps it
whole instead).

Plans — which module takes which role, derived from the model's structure or resolved from a user's patterns, and
validated against tp — are :mod:`meshlight.parallel.tensor_plan`'s.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
from collections import defaultdict
from collections.abc import Generator, Iterable, Mapping
from contextlib import contextmanager
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshlight.parallel.collectives import all_gather_along
from meshlight.parallel.dtensors import modifiable_local, shallow_copy
from meshlight.parallel.model_shape import (
    GROUP_ATTRIBUTES,
    WIDTH_ATTRIBUTES,
    blocks_fed_between,
    head_counts,
    hidden_size,
    is_transposed_linear,
    linear_widths,
    per_head_parameters,
)
from meshlight.parallel.sequence_gather import register_sequence_gather, sequence_share
from meshlight.parallel.tensor_plan import (
    TensorParallelError,
    _colwise_parents,
    _named_blocks,
    _shown,
    _within,
    block_held_groups,
    fused_projection,
    head_biases,
    moe_blocks_of,
    replicated_kv_heads,
)

__all__ = [
    "apply_tensor_parallel", "explaining_tensor_parallel_errors", "reduce_partial_gradients", "sequence_share_input",
]


# ------------------------------------------------------------------------------------------- apply


def apply_tensor_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: Mapping[str, Union[str, ParallelStyle]],
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    keep_gathered_inputs: bool = False,
    sequence_region: Optional[tuple[str, str]] = None,
) -> None:
    """Shard ``model`` in place over the 1-D ``mesh`` (the tp axis) following ``plan`` (name → role or style).
    ``keep_gathered_inputs``: backward keeps each colwise group's sequence-gathered input whole rather than
    gathering it again (more memory, one all-gather fewer per group). ``sequence_region``: with sequence
    parallelism, :func:`sequence_region` of the whole model (``model`` may be a pipeline stage cut from it)."""
    tp = mesh.size()
    modules = dict(model.named_modules())
    blocks = [name for name, _ in _named_blocks(model)]
    # with sequence parallelism, whether the modules outside the blocks run on this rank's share of the sequence
    shares_outside = sequence_parallel and sequence_region is None
    styles: dict[str, ParallelStyle] = {}
    hidden = hidden_size(modules[name] for name in blocks)
    # latent attentions: their down-projections and up-projections run on plain tensors, all but the heads whole
    latent = {name.rpartition(".")[0] for name, role in plan.items() if role == "latent"}
    # MoE blocks, which flatten the tokens for their experts (and what else they hold: a shared expert's gate)
    flattening = moe_blocks_of(model)
    # attention whose key/value heads tp exceeds: each rank computes the one its query heads read
    replicated = {parent: kv for parent in _colwise_parents(plan)
                  if hidden and (kv := replicated_kv_heads(modules, plan, parent, hidden, tp))}
    # MLPs a block holds beside its norms: the block's input is its residual stream, so the first Linear gathers its
    # own input over the sequence (and its gradient is reduce-scattered back to the share)
    block_held = block_held_groups(model, plan)
    for name, role in plan.items():
        on_share = sequence_parallel if _within(name, blocks) else shares_outside
        if isinstance(role, ParallelStyle):
            styles[name] = role
        elif role == "fused_colwise":
            styles[name] = _FusedColwise(fused_projection(modules, plan, name), replicated.get(name.rpartition(".")[0]))
        elif role == "colwise" and (kv := replicated.get(name.rpartition(".")[0])) and (
                linear_widths(modules[name])[1] == kv[0] * kv[1]):  # key/value heads fewer than the ranks
            styles[name] = _FusedColwise((kv[0] * kv[1],), kv)
        elif role == "colwise" and name.rpartition(".")[0] in latent and linear_widths(modules[name])[0] != hidden:
            styles[name] = _OnLocalWeights(sharded=True)  # a latent attention's up-projection: reads a latent
        elif role == "colwise" and name.rpartition(".")[0] in block_held:
            styles[name] = _ColwiseFromShare() if on_share else ColwiseParallel()
        elif role == "colwise":
            styles[name] = _TransposedColwise() if is_transposed_linear(modules[name]) else ColwiseParallel()
        elif role == "rowwise":
            rowwise = _TransposedRowwise if is_transposed_linear(modules[name]) else _Rowwise
            styles[name] = rowwise(output_layouts=Shard(1) if sequence_parallel else Replicate())
        elif role == "embedding":
            styles[name] = _Rowwise(input_layouts=Replicate(), output_layouts=Shard(1) if on_share else Replicate())
        elif role == "head":
            styles[name] = _LMHead(sequence_parallel=on_share, loss_parallel=loss_parallel)
        elif role == "norm" and on_share:
            styles[name] = _SequenceNorm(use_local_output=True)  # a plain share: post-norm blocks add it to others
        elif role == "head_norm":
            styles[name] = _Replicated(name, over="heads")
        elif role == "colwise_norm":
            styles[name] = _ColwiseNorm(name)
        elif role == "replicate" and on_share and isinstance(modules[name], nn.Embedding):
            styles[name] = _Replicated(name, over="whole")
        elif role == "replicate" and on_share and isinstance(modules[name], nn.Linear) and (
                not _within(name, flattening)):
            styles[name] = _Replicated(name, over="sequence")
        elif role == "replicate" and on_share or role == "latent":  # an MoE block's router, experts and shared
            styles[name] = _OnLocalWeights()  # expert's gate; a latent attention's down-projections and their norms
        elif role == "interior":
            owner = name.rpartition(".")[0]
            writer = next((n for n, r in plan.items() if r == "rowwise" and n.rpartition(".")[0] == owner), None)
            if writer is None:
                raise TensorParallelError(
                    f"{_shown(name)} has the role 'interior' (a module between a column→row group's projections),"
                    f" but {_shown(owner) or 'the model'} holds no 'rowwise' projection beside it to tell this rank's"
                    " share of the hidden units: give the group's output projection the role 'rowwise', or give this"
                    " module another role.")
            styles[name] = _Interior(name, linear_widths(modules[writer])[0])
        elif role == "whole" and on_share:  # (without sequence parallelism every rank computes the same: left plain)
            styles[name] = _WholeMixer()
    per_head = {parent: names for parent in _colwise_parents(plan)
                if hidden and (names := per_head_parameters(modules[parent], hidden))}
    tied = _tied_parameters(model)
    parallelize_module(model, mesh, styles)
    _tie_again(model, tied)
    for parent in _colwise_parents(plan):
        if parent not in block_held:
            register_sequence_gather(modules[parent], mesh, sequence_parallel=sequence_parallel,
                                     keep_gathered=keep_gathered_inputs)
        if biases := head_biases(modules[parent]):
            _narrow_head_biases(modules[parent], biases, max(head_counts(modules[parent]).values()), mesh)
        divided = _divide_counts(modules[parent], tp, replicated.get(parent))
        _name_while_running(modules[parent], _shown(parent), divided)
    for parent, names in per_head.items():  # after the gather has read the forward's signature
        _split_by_head(modules[parent], names, mesh)
    if sequence_parallel:
        for name in blocks:
            modules[name].register_forward_pre_hook(_unwrap_share, prepend=True)
    if shares_outside:
        for module in modules.values():
            if isinstance(module, nn.Embedding):
                module.register_forward_pre_hook(_check_sequence_divisible(tp))
    elif sequence_parallel:  # the blocks only: cut where the first begins, gather where the last ends (this stage's)
        first, last = sequence_region
        if first not in modules or last not in modules:  # a stage holds the others' under their names too
            raise ValueError(f"sequence_region {sequence_region} names no blocks of this {type(model).__name__}: it"
                             " must come from sequence_region() of the same model (or of the model a stage is cut"
                             " from).")
        # a decoder that changes the hidden state after its first blocks (Qwen3-VL's deepstack) gets it whole there
        fed = blocks_fed_between(model)
        for name in blocks:
            index = int(key) if (key := name.rpartition(".")[2]).isdigit() else len(blocks)
            if name == first or 0 < index <= fed:
                modules[name].register_forward_pre_hook(_cut_to_share(mesh))
            if name == last or index < fed:
                modules[name].register_forward_hook(_gather_sequence(mesh))
        enter, leave = _stream_of_own(mesh.get_local_rank())
        for name in blocks:
            modules[name].register_forward_pre_hook(enter, prepend=True)
            modules[name].register_forward_hook(leave, always_call=True)


def _divide_counts(module: nn.Module, tp: int, kv: Optional[tuple[int, int]] = None) -> list[str]:
    """Give an attention ``module`` this rank's heads: divide by ``tp`` the head counts it keeps, those of its config
    — in a copy for it alone, as its forward may read them there (litgpt's reads them all there; Phi-3's slices its
    fused q|k|v at ``config.num_attention_heads`` · head_dim) — and the widths it splits a fused projection by
    (:data:`~meshlight.parallel.model_shape.WIDTH_ATTRIBUTES`). ``kv``: (key/value heads, head width) where tp
    exceeds those heads: each rank one of them (:func:`~meshlight.parallel.tensor_plan.replicated_kv_heads`).
    Returns the attributes divided."""
    if not head_counts(module):  # not attention (or attention that keeps no count: nothing to divide)
        return []
    own, config = head_counts(module, own=True), getattr(module, "config", None)
    in_config = head_counts(config, own=True) if config is not None else {}
    if in_config:
        module.config = copy.copy(config)
    widths = {a: v for a in WIDTH_ATTRIBUTES if isinstance(v := getattr(module, a, None), int)}
    for attribute, value in own.items():
        setattr(module, attribute, _local_count(value, tp))
    for attribute, value in widths.items():  # one key/value head's width where tp exceeds them (kv: heads, width)
        setattr(module, attribute, kv[1] if kv and value == kv[0] * kv[1] else value // tp)
    for attribute, value in in_config.items():
        setattr(module.config, attribute, _local_count(value, tp))
    # key/value heads tp exceeds (one on each rank): fewer query heads share each than in one process
    sharing = max((tp // value for value in {**own, **in_config}.values() if value % tp), default=1)
    groups = {a: v for a in GROUP_ATTRIBUTES if isinstance(v := getattr(module, a, None), int) and sharing > 1}
    for attribute, value in groups.items():
        setattr(module, attribute, value // sharing)
    return sorted([*own, *widths, *groups, *(f"config.{attribute}" for attribute in in_config)])


def _local_count(value: int, tp: int) -> int:
    """A rank's share of ``value`` heads: ``value/tp``, or one where tp exceeds them (key/value heads, each then
    held by ``tp/value`` ranks: :func:`~meshlight.parallel.tensor_plan.replicated_kv_heads`)."""
    return value // tp if value % tp == 0 else 1


def sequence_share_input(stage: nn.Module, mesh: DeviceMesh) -> None:
    """Let a pipeline stage after the first read the whole sequence's length from its input under sequence
    parallelism.

    Stages hand on what flows between blocks, this rank's share of the sequence (1/tp of the bytes). The
    pipelined module's own forward still runs on every stage and may read lengths from its input (a rotary
    table cut to ``x.shape[1]``): given the share, it would cut it 1/tp long. The share is made a DTensor
    sharded over the sequence (dimension 1) on the 1-D ``mesh``, whose shape is the whole sequence's, and the
    stage's blocks get it back as the plain share that sequence parallelism passes between them
    (:func:`apply_tensor_parallel` has them unwrap such inputs)."""

    def whole_shape(module: nn.Module, args: tuple) -> Optional[tuple]:
        if args and isinstance(args[0], Tensor) and not isinstance(args[0], DTensor):
            return (DTensor.from_local(args[0], mesh, [Shard(1)], run_check=False), *args[1:])
        return None

    stage.register_forward_pre_hook(whole_shape)


def _unwrap_share(module: nn.Module, args: tuple) -> Optional[tuple]:
    """A block's forward pre-hook: a DTensor sharded over the sequence (a norm's output before the blocks, a later
    pipeline stage's input) becomes the plain share that sequence parallelism passes between blocks."""
    if args and isinstance(args[0], DTensor) and tuple(args[0].placements) == (Shard(1),):
        return (args[0].to_local(), *args[1:])
    return None


def reduce_partial_gradients(parameters: Iterable[Tensor]) -> None:
    """Turn gradients that are partial sums over tp into replicated ones, one all-reduce per mesh, placement and dtype.

    A replicated parameter applied to sharded activations (a norm under sequence parallelism) gets a
    ``Partial`` gradient: each tp rank holds its share of the sum. Left so, every op that reads it
    reduces it again — AdamW three times per parameter, the norm for clipping once more. FSDP reduces such
    gradients itself; where no data-parallel engine wraps the model (dp = 1) the strategy calls this once per
    optimizer step, after the last backward, as Megatron-LM reduces its sequence-parallel norm gradients.
    """
    groups: dict[tuple, list[Tensor]] = defaultdict(list)
    for param in parameters:
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            summed = all(type(p) is Partial and p.reduce_op in ("sum", "avg")
                         for p in grad.placements if p.is_partial())
            if summed and grad.to_local().device.type == grad.device_mesh.device_type:
                groups[(grad.device_mesh, grad.placements, grad.dtype)].append(param)
            else:  # other reductions, or offloaded gradients: DTensor's own redistribution
                param.grad = grad.redistribute(grad.device_mesh, _replicated(grad.placements))
    for (mesh, placements, _), params in groups.items():
        locals_ = [param.grad.to_local() for param in params]
        flat = torch.cat([local.reshape(-1) for local in locals_])
        for dim, placement in enumerate(placements):
            if placement.is_partial():
                group = mesh.get_group(dim)
                dist.all_reduce(flat, group=group)
                if placement.reduce_op == "avg":
                    flat /= dist.get_world_size(group)
        for param, values in zip(params, flat.split([local.numel() for local in locals_])):
            grad = param.grad
            contiguous = torch.empty(grad.shape, device="meta").stride()  # the buffer's layout, not the old one
            param.grad = DTensor.from_local(values.view_as(grad.to_local()), mesh, _replicated(placements),
                                            run_check=False, shape=grad.shape, stride=contiguous)


def _replicated(placements: tuple) -> tuple:
    return tuple(Replicate() if p.is_partial() else p for p in placements)


def _tied_parameters(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Each parameter that several modules hold (a tied embedding and LM head): its ``(module, attribute)``
    places, first the one ``named_parameters`` reports."""
    places: dict[int, list[tuple[str, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attribute, param in module.named_parameters(recurse=False):
            places.setdefault(id(param), []).append((module_name, attribute))
    return [where for where in places.values() if len(where) > 1]


def _tie_again(model: nn.Module, tied: list[list[tuple[str, str]]]) -> None:
    """``parallelize_module`` gives every module a parameter of its own: hand the first place's to the others, which
    keeps one weight trained by both (embedding and LM head are sharded alike: over the vocabulary, dim 0). A tie
    whose places are sharded differently cannot be kept, and is refused."""
    for places in tied:
        params = [model.get_submodule(name).get_parameter(attribute) for name, attribute in places]
        layouts = {(type(p).__name__, tuple(p.placements) if isinstance(p, DTensor) else None) for p in params}
        if len(layouts) > 1:
            described = ", ".join(f"{name or type(model).__name__}.{attribute} ({_layout_of(p)})"
                                  for (name, attribute), p in zip(places, params))
            raise TensorParallelError(
                f"Tensor parallelism would split one tied parameter differently where it is held: {described}."
                " Give the modules that share it roles that shard it alike (a tied embedding and LM head:"
                " \"embedding\" and \"head\", both over the vocabulary), or untie it.")
        for name, attribute in places[1:]:
            setattr(model.get_submodule(name), attribute, params[0])


def _layout_of(param: Tensor) -> str:
    return f"DTensor {list(param.placements)}" if isinstance(param, DTensor) else "a plain tensor"


class _LMHead(ColwiseParallel):
    """Vocabulary-sharded LM head. While training (and ``loss_parallel``), its logits stay a DTensor sharded
    over the vocabulary for ``torch.distributed.tensor.parallel.loss_parallel``: the full logits never exist
    on one rank. In eval mode they are gathered, so metrics and predictions see ordinary tensors."""

    def __init__(self, *, sequence_parallel: bool, loss_parallel: bool) -> None:
        super().__init__(input_layouts=Shard(1) if sequence_parallel else Replicate(), output_layouts=Shard(-1),
                         use_local_output=False)
        self.loss_parallel = loss_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)

        def gather_unless_loss_parallel(mod: nn.Module, inputs: Any, output: DTensor) -> Any:
            if mod.training and self.loss_parallel:
                return output
            return output.redistribute(device_mesh, [Replicate()]).to_local()

        module.register_forward_hook(gather_unless_loss_parallel)
        return module


class _Transposed:
    """Tensor parallelism for Hugging Face's ``Conv1D``, a Linear whose weight is stored ``[in, out]``: each parameter
    distributed as ``placements`` says; inputs and outputs as torch's style for ``nn.Linear`` has them."""

    placements: dict[str, Placement]

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            _distribute_parameters(mod, mesh, self.placements, self.src_data_rank)

        return distribute_module(
            module, device_mesh, partition,
            functools.partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            functools.partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class _TransposedColwise(_Transposed, ColwiseParallel):
    placements = {"weight": Shard(1), "bias": Shard(0)}


class _Rowwise(RowwiseParallel):
    """Row-parallel; under sequence parallelism (``output_layouts=Shard(1)``) its output is reduce-scattered to this
    rank's share of the sequence wherever that lies (:func:`sequence_share`): the sequence of ``[batch, sequence,
    hidden]``, the tokens of the flattened ``[tokens, hidden]`` an MoE block's shared expert returns. Made local, the
    output is a tensor of its own (:func:`~meshlight.parallel.dtensors.modifiable_local`): a model may modify it in
    place (Llama 4 adds into its shared expert's output, CTRL scales its token embedding's). Also the token
    embedding's style (sharded by vocabulary, its lookups summed)."""

    @staticmethod
    def _prepare_output_fn(output_layouts: tuple, use_local_output: bool, mod: nn.Module, outputs: DTensor,
                           device_mesh: DeviceMesh) -> Tensor:
        if output_layouts == (Shard(1),):
            output_layouts = (sequence_share(outputs),)
        if not use_local_output or torch.compiler.is_compiling():
            return RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        # the summed output is a tensor of its own, which the model may modify in place
        return modifiable_local(outputs.redistribute(placements=output_layouts))


class _TransposedRowwise(_Transposed, _Rowwise):
    placements = {"weight": Shard(0), "bias": Replicate()}
    desired_input_layouts = (Shard(-1),)


class _ColwiseFromShare(ColwiseParallel):
    """Column-parallel on this rank's share of the sequence, gathered first (its gradient reduce-scattered back):
    the first Linear of an MLP its block holds beside its norms (:func:`~meshlight.parallel.tensor_plan.
    block_held_groups`), on the block's residual stream — ``[batch, sequence, hidden]``, or the flattened ``[tokens,
    hidden]`` OPT's block runs its MLP on (:func:`sequence_share`)."""

    def __init__(self) -> None:
        super().__init__(input_layouts=Shard(1))

    @staticmethod
    def _prepare_input_fn(input_layouts: tuple, desired_input_layouts: tuple, mod: nn.Module, inputs: tuple,
                          device_mesh: DeviceMesh) -> DTensor:
        if not isinstance(inputs[0], DTensor):
            input_layouts = (sequence_share(inputs[0]),)
        return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)


class _SequenceNorm(SequenceParallel):
    """A norm on this rank's share of the sequence, its parameters replicated (their gradients summed over tp):
    torch's style, the share where :func:`sequence_share` finds it — ``[batch, sequence, hidden]``'s sequence, or
    the tokens of a block that flattens them (OPT's)."""

    @staticmethod
    def _prepare_input_fn(sequence_sharding: tuple, mod: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> DTensor:
        if not isinstance(inputs[0], DTensor):
            sequence_sharding = (sequence_share(inputs[0]),)
        return SequenceParallel._prepare_input_fn(sequence_sharding, mod, inputs, device_mesh)


class _FusedColwise(ColwiseParallel):
    """A fused projection whose outputs pack ``parts`` (q|k|v, k|v, gate|up) one after another, split part by part:
    each rank computes its ``1/tp`` of every part, in order — ``[q_r | k_r | v_r]``, which the attention splits by its
    divided head counts exactly as one process splits the whole. ``kv``: (key/value heads, head width) where tp
    exceeds those heads (:func:`~meshlight.parallel.tensor_plan.replicated_kv_heads`): of a part that wide (k, v, or
    a plain k or v projection: one part) each rank computes the one head its query heads read.

    The weight and bias are stored sharded by rows (``Shard(0)``, whatever the module's layout), so checkpoints and
    full state dicts hold them as one process does. The module's forward is replaced by one that gathers them whole
    over tp, selects this rank's rows of every part and multiplies; the gathered weight's gradient is a partial sum
    over the ranks, reduce-scattered back to the shards (the ranks sharing a key/value head each add their query
    heads' part)."""

    def __init__(self, parts: tuple[int, ...], kv: Optional[tuple[int, int]] = None) -> None:
        super().__init__()
        self.parts, self.kv = parts, kv

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rows = _rows_of_rank(self.parts, self.kv, device_mesh.size(), device_mesh.get_local_rank())

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            _distribute_parameters(mod, mesh, {"weight": Shard(0), "bias": Shard(0)}, self.src_data_rank)

        distribute_module(module, device_mesh, partition,
                          functools.partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts))
        module.forward = functools.partial(_fused_forward, module, rows, is_transposed_linear(module))
        return module


def _rows_of_rank(parts: tuple[int, ...], kv: Optional[tuple[int, int]], tp: int, rank: int) -> Tensor:
    """The output rows rank ``rank`` of ``tp`` computes of a projection packing ``parts`` one after another: its
    ``1/tp`` of each, but of a part of ``kv`` = (heads, head width) — key/value heads fewer than the ranks, tp a
    multiple of them — the head its query heads read (rank ``r`` holds query heads ``r·H/tp`` on, which read key/value
    head ``r·kv/tp``)."""
    rows, start = [], 0
    for part in parts:
        if kv and part == kv[0] * kv[1]:
            head = rank * kv[0] // tp
            rows.append(torch.arange(start + head * kv[1], start + (head + 1) * kv[1]))
        else:
            rows.append(torch.arange(start + rank * part // tp, start + (rank + 1) * part // tp))
        start += part
    return torch.cat(rows)


def _distribute_parameters(module: nn.Module, mesh: DeviceMesh, placements: Mapping[str, Placement],
                           src_data_rank: Optional[int]) -> None:
    """Make each of ``module``'s own parameters a DTensor placed as ``placements`` says by its name, sharded from
    ``src_data_rank``'s values."""
    for name, param in list(module.named_parameters(recurse=False)):
        placed = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))


def _replicate_parameters(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """A ``distribute_module`` partition function: ``module``'s own parameters become replicated DTensors of the
    values each rank holds (the same on all of them), whose gradients are partial sums to reduce. Those already
    distributed are left: ``distribute_module`` replicates every submodule's, and a submodule with a role of its
    own (ERNIE 4.5's router's statistics inside its router) comes after its parent."""
    for param_name, param in list(module.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            continue
        replicated = DTensor.from_local(param, mesh, [Replicate()], run_check=False)
        module.register_parameter(param_name, nn.Parameter(replicated, requires_grad=param.requires_grad))


def _fused_forward(module: nn.Module, rows: Tensor, transposed: bool, inputs: DTensor) -> Tensor:
    """:class:`_FusedColwise`'s forward: ``inputs`` a replicated DTensor, the output this rank's ``rows`` of it."""
    weight = _gathered(module.weight)
    weight = (weight.t() if transposed else weight).index_select(0, rows.to(weight.device))
    bias = None if module.bias is None else _gathered(module.bias).index_select(0, rows.to(weight.device))
    return nn.functional.linear(inputs.to_local(grad_placements=[Partial()]), weight, bias)


def _gathered(param: DTensor) -> Tensor:
    """``param`` whole on this rank, its gradient taken as this rank's part of a sum over the mesh."""
    return param.redistribute(param.device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])


class _Replicated(ParallelStyle):
    """A module left whole on every rank whose input differs between them: its weights become replicated
    DTensors, so the gradients of all ranks are summed (reduced with the norms'). ``over``:

    - ``"whole"``: an Embedding (learned positions) under sequence parallelism reads the whole sequence and
      keeps its output's share;
    - ``"sequence"``: a Linear (a gate) under sequence parallelism reads this rank's share of the sequence — a
      plain ``[batch, sequence, ...]`` tensor between blocks, or a norm's DTensor — and hands on its output's;
    - ``"heads"``: a norm over each head (QK-norm) reads this rank's heads (``[..., heads, head_dim]``).

    ``name`` is the module's, for the error when its input is not a share of a sequence."""

    def __init__(self, name: str, *, over: str) -> None:
        super().__init__()
        self.name, self.over = name, over

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def inputs_as_dtensors(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            if self.over == "whole":
                return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) if isinstance(t, Tensor)
                             and not isinstance(t, DTensor) else t for t in inputs)
            share = inputs[0]
            if self.over == "heads" and not isinstance(share, DTensor) and share.dim() >= 2:
                return (DTensor.from_local(share, mesh, [Shard(share.dim() - 2)], run_check=False), *inputs[1:])
            if isinstance(share, DTensor) and tuple(share.placements) == (Shard(1),):
                return inputs
            if not isinstance(share, DTensor) and share.dim() >= 3:  # [batch, sequence share, ...]
                return (DTensor.from_local(share, mesh, [Shard(1)], run_check=False), *inputs[1:])
            given = _described(share)
            wanted = ("this rank's heads ([..., heads, head_dim])" if self.over == "heads" else
                      "this rank's share of a sequence ([batch, sequence, ...], split along dimension 1)")
            raise TensorParallelError(
                f"{_shown(self.name)} ({type(mod).__name__}) is left whole on every tensor-parallel rank, and it must"
                f" read {wanted} so that its gradient can be summed over the ranks; it was given {given} (a pooled"
                " or conditioning input?). Give it a role in the plan, or parallelize it yourself in"
                f" configure_model(){'' if self.over == 'heads' else ', or pass sequence_parallel=False'}."
            )

        def output_local(mod: nn.Module, output: DTensor, mesh: DeviceMesh) -> Tensor:
            if self.over == "whole":  # (batch,) sequence, width
                return output.redistribute(mesh, [Shard(output.dim() - 2)]).to_local()
            return output.to_local()

        return distribute_module(module, device_mesh, _replicate_parameters, inputs_as_dtensors, output_local)


def _described(value: Any) -> str:
    """What a module that refuses its input was given, for its error: a tensor's rank and shape, a DTensor's
    placement."""
    if isinstance(value, DTensor):
        return f"a DTensor {tuple(value.shape)} placed {value.placements[0]}"
    return f"a {value.dim()}-D tensor {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__


class _ColwiseNorm(ParallelStyle):
    """A norm over a colwise projection's whole output (OLMo 2's q and k norms, over all heads at once), of which
    each rank holds ``1/tp``: its vectors are sharded as that output is (``Shard(0)``) and its own forward runs on
    DTensors, this rank's share of the output read as ``Shard(-1)``, so the statistics over the whole width (a mean
    of squares) are reduced over tp: an all-reduce of one value per token where gathering the output would move all
    of it. Torch's ``nn.RMSNorm`` and ``nn.LayerNorm``, whose kernels DTensor cannot run on a sharded width, run as
    the same formulas op by op. ``name`` is the module's, for the error when its input is of another width."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        width, tp = next(module.parameters()).shape[0], device_mesh.size()

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            sharded = {n: Shard(0) for n, _ in mod.named_parameters(recurse=False)}
            _distribute_parameters(mod, mesh, sharded, self.src_data_rank)

        def share_as_dtensor(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            share = inputs[0] if inputs else None
            if isinstance(share, Tensor) and not isinstance(share, DTensor) and share.dim() and (
                    share.shape[-1] * tp == width):
                return (DTensor.from_local(share, mesh, [Shard(share.dim() - 1)], run_check=False), *inputs[1:])
            given = _described(share)
            raise TensorParallelError(
                f"{_shown(self.name)} ({type(mod).__name__}) is a norm as wide as a column-parallel projection's"
                f" output beside it ({width}), which tensor parallelism splits so: it must read this rank's 1/{tp} of"
                f" that output, [..., {width // tp}], and it was given {given}. A norm of the module's input (as wide"
                " by chance) belongs outside the module that holds the projections (in the block, before it); or"
                " give it a role in the plan, or parallelize the module yourself in configure_model()."
            )

        def share_of_output(mod: nn.Module, output: DTensor, mesh: DeviceMesh) -> Tensor:
            # DTensor may have gathered the width for an op of the norm's: this rank's share again (a slice)
            return output.redistribute(mesh, [Shard(output.dim() - 1)]).to_local()

        if type(module) in (nn.RMSNorm, nn.LayerNorm):
            module.forward = functools.partial(_norm_op_by_op, module)
        return distribute_module(module, device_mesh, partition, share_as_dtensor, share_of_output)


def _norm_op_by_op(norm: Union[nn.RMSNorm, nn.LayerNorm], x: DTensor) -> DTensor:
    """``norm``'s formula over the last dimension, op by op, on ``x`` sharded over it: each mean is reduced over the
    mesh (not the width gathered to compute it)."""

    def mean(values: DTensor) -> DTensor:
        summed = values.sum(-1, keepdim=True).redistribute(values.device_mesh, [Replicate()])
        return summed / values.shape[-1]

    if isinstance(norm, nn.LayerNorm):
        x = x - mean(x)
    eps = torch.finfo(x.dtype).eps if norm.eps is None else norm.eps
    y = x * torch.rsqrt(mean(x.pow(2)) + eps)
    if norm.weight is not None:
        y = y * norm.weight
    bias = getattr(norm, "bias", None)
    return y if bias is None else y + bias


class _OnLocalWeights(ParallelStyle):
    """A module that runs, as it is, on plain tensors and a shallow copy holding this rank's values of its
    parameters. Replicated (DTensors whose gradients are summed over tp, reduced with the norms'): a Hugging Face MoE
    block's router and stacked experts on this rank's share of the tokens under sequence parallelism (the block
    flattens the tokens first), a latent attention's down-projections and their norms (the latent every head
    reads). ``sharded``: over output features (``Shard(0)``), a latent attention's up-projections, each rank making
    its heads. A replicated DTensor input (the gathered input of the module holding a column→row group) is taken as
    this rank's plain tensor, its gradient this rank's part of a sum — the part its heads make."""

    def __init__(self, *, sharded: bool = False) -> None:
        super().__init__()
        self.sharded = sharded

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            if not self.sharded:
                return _replicate_parameters(name, mod, mesh)
            _distribute_parameters(mod, mesh, {n: Shard(0) for n, _ in mod.named_parameters(recurse=False)},
                                   self.src_data_rank)

        def plain_inputs(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(t.to_local(grad_placements=[Partial()]) if isinstance(t, DTensor)
                         and all(p.is_replicate() for p in t.placements) else t for t in inputs)

        distribute_module(module, device_mesh, partition, plain_inputs)
        # (replicated, its submodules' weights too: a key selector's own projections)
        forward = _forward_on_local_weights if self.sharded else _forward_on_local_tree
        module.forward = functools.partial(forward, module, type(module).forward)
        return module


class _Interior(_OnLocalWeights):
    """A module between a column→row group's readers and its writer that holds parameters (a learned activation,
    Apertus's xIELU): it runs on this rank's hidden units as they are, its parameters replicated, each rank's gradient
    its units' part of the sum over tp. Its input must be this rank's share of the ``width`` the writer reads;
    anything else (a module the group's owner runs on its input) is refused at its first call, naming it."""

    def __init__(self, name: str, width: int) -> None:
        super().__init__()
        self.name, self.width = name, width

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        share = self.width // device_mesh.size()

        def check(mod: nn.Module, args: tuple) -> None:
            given = args[0] if args else None
            if not (isinstance(given, Tensor) and given.dim() and given.shape[-1] == share):
                raise TensorParallelError(
                    f"{_shown(self.name)} ({type(mod).__name__}) holds parameters beside a tensor-parallel group, so"
                    " meshlight takes it for a module between the group's projections (a learned activation): it must"
                    f" read this rank's {share} of the {self.width} hidden units the output projection reads,"
                    f" [..., {share}], and it was given {_described(given)}. Give it a role in the strategy's plan="
                    " (or a ParallelStyle), or parallelize the module yourself in configure_model().")

        module.register_forward_pre_hook(check)
        return module


class _WholeMixer(ParallelStyle):
    """A sequence mixer kept whole on every rank under sequence parallelism (:data:`~meshlight.parallel.model_shape.
    WHOLE_MIXERS`: a linear attention's recurrence): it reads the whole sequence — its input, this rank's share,
    all-gathered, the gradient reduce-scattered back — and hands on its output's share of it. Its weights, and its
    submodules', become replicated DTensors run as plain local values, each rank's gradient (from its share of the
    output) a part of the sum over tp, reduced with the norms'. Every rank computes the whole mixer."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        distribute_module(module, device_mesh, _replicate_parameters)
        # (on copies of the whole tree: its forward reads a submodule's weight itself, Qwen3.5's convolution's)
        module.forward = functools.partial(_forward_on_local_tree, module, type(module).forward)
        first = list(inspect.signature(type(module).forward).parameters)[1]  # after `self`

        def whole(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (all_gather_along(args[0], 1, group), *args[1:]), kwargs
            return args, {**kwargs, first: all_gather_along(kwargs[first], 1, group)}

        def share(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            hidden = output[0] if isinstance(output, tuple) else output
            length = hidden.shape[1] // device_mesh.size()
            mine = hidden.narrow(1, device_mesh.get_local_rank() * length, length)
            return (mine, *output[1:]) if isinstance(output, tuple) else mine

        module.register_forward_pre_hook(whole, with_kwargs=True)
        module.register_forward_hook(share, with_kwargs=True)
        return module


def _split_by_head(module: nn.Module, names: list[str], mesh: DeviceMesh) -> None:
    """An attention ``module``'s own parameters ``names``, one value per head (GPT-OSS's attention sinks), sharded
    over tp as its heads are; its forward runs on a shallow copy holding this rank's values as plain tensors."""
    _distribute_parameters(module, mesh, dict.fromkeys(names, Shard(0)), src_data_rank=0)
    module.forward = functools.partial(_forward_on_local_weights, module, type(module).forward)


def _narrow_head_biases(attention: nn.Module, biases: Mapping[str, Optional[int]], heads: int,
                        mesh: DeviceMesh) -> None:
    """Hand ``attention`` the biases of this rank's ``heads``/tp heads (consecutive, as the q, k, v columns it holds)
    where its model passes the biases of all ``heads`` (ALiBi's) as the arguments ``biases`` names (argument ->
    dimension of the heads; None: dimension 0 holds batch × heads). A tensor whose dimension is not ``heads`` wide
    (a mask broadcast over the heads) is left whole."""
    local = heads // mesh.size()
    start = mesh.get_local_rank() * local
    names = [p for p in inspect.signature(attention.forward).parameters]
    positions = {name: names.index(name) for name in biases if name in names}

    def narrowed(value: Any, dim: Optional[int]) -> Any:
        if not isinstance(value, Tensor):
            return value
        if dim is None:
            if value.shape[0] % heads:
                raise TensorParallelError(
                    f"{type(attention).__name__} received biases of {value.shape[0]} rows, not a multiple of its"
                    f" {heads} heads: meshlight cannot tell this rank's. Train it without tensor parallelism.")
            return value.unflatten(0, (-1, heads))[:, start:start + local].flatten(0, 1)
        return value.narrow(dim, start, local) if value.dim() > dim and value.shape[dim] == heads else value

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs = list(args), dict(kwargs)
        for name, position in positions.items():
            if name in kwargs:
                kwargs[name] = narrowed(kwargs[name], biases[name])
            elif position < len(args):
                args[position] = narrowed(args[position], biases[name])
        return tuple(args), kwargs

    attention.register_forward_pre_hook(hook, with_kwargs=True)


def _forward_on_local_weights(module: nn.Module, forward: Any, *args: Any, **kwargs: Any) -> Any:
    """``forward`` on a shallow copy of ``module`` holding its own DTensor parameters as this rank's plain values:
    the gradients of replicated ones are this rank's part of a sum, those of sharded ones its shard's. Its buffers,
    which ``distribute_module`` makes replicated DTensors (DeepSeek's router's score correction), as plain values
    too."""
    local = shallow_copy(module)
    for name, param in module.named_parameters(recurse=False):
        replicated = all(p.is_replicate() for p in param.placements)
        object.__setattr__(local, name, param.to_local(grad_placements=[Partial()] if replicated else None))
    for name, buffer in module.named_buffers(recurse=False):
        if isinstance(buffer, DTensor):
            object.__setattr__(local, name, buffer.to_local())
    return forward(local, *args, **kwargs)


def _forward_on_local_tree(module: nn.Module, forward: Any, *args: Any, **kwargs: Any) -> Any:
    """``forward`` on a copy of ``module`` and of each of its submodules holding their replicated DTensor parameters
    as this rank's plain values (each gradient this rank's part of a sum), however the forward reaches them."""

    def local(mod: nn.Module) -> nn.Module:
        copied = shallow_copy(mod)
        copied._parameters = {}
        for name, param in mod._parameters.items():  # (None where a Linear has no bias)
            object.__setattr__(copied, name, param.to_local(grad_placements=[Partial()])
                               if isinstance(param, DTensor) else param)
        for name, buffer in mod.named_buffers(recurse=False):
            if isinstance(buffer, DTensor):
                object.__setattr__(copied, name, buffer.to_local())
        copied._modules = {name: local(child) for name, child in mod.named_children()}
        return copied

    return forward(local(module), *args, **kwargs)


def _check_sequence_divisible(tp: int):  # noqa: ANN202 - a forward pre-hook
    def hook(module: nn.Module, args: tuple) -> None:
        tokens = args[0] if args and isinstance(args[0], Tensor) else None
        if tokens is not None and tokens.dim() >= 2 and tokens.shape[1] % tp:
            raise TensorParallelError(
                f"Sequence length {tokens.shape[1]} is not divisible by tp={tp}: sequence parallelism splits the"
                " sequence over the tensor-parallel ranks. Pad sequences to a multiple of tp or pass"
                " sequence_parallel=False."
            )

    return hook


def _cut_to_share(mesh: DeviceMesh):  # noqa: ANN202 - a forward pre-hook
    """The first block's whole ``[batch, sequence, ...]`` input (the same on every tp rank) → this rank's share;
    in backward the shares' gradients are gathered (the region before the blocks runs on the whole sequence)."""
    check = _check_sequence_divisible(mesh.size())

    def hook(module: nn.Module, args: tuple) -> Optional[tuple]:
        whole = args[0] if args else None
        if not isinstance(whole, Tensor) or isinstance(whole, DTensor) or whole.dim() < 2:
            raise TensorParallelError(
                f"Under sequence parallelism the first block ({type(module).__name__}) must receive the hidden"
                " state [batch, sequence, ...] as its first argument, to cut it to this rank's share of the"
                f" sequence; it received {type(whole).__name__ if args else 'no positional argument'}. Pass the hidden"
                " state first, positionally, or pass"
                " sequence_parallel=False."
            )
        check(module, args)
        share = DTensor.from_local(whole, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)])
        return (share.to_local(), *args[1:])

    return hook


def _stream_of_own(tp_rank: int) -> tuple[Any, Any]:
    """Forward pre- and post-hooks that run a block on a random stream of this tp rank's own, when sequence
    parallelism covers the blocks only: outside them the tp ranks hold the same activations and share a stream
    (dropout there must agree), inside them they hold different tokens (their masks must not repeat share after
    share). Each call draws a seed from the shared stream — the same draw on every tp rank, so the shared stream
    stays in step, and a checkpoint's saved random state resumes it exactly — and runs the block seeded from it
    and the tp rank; recomputation replays the block from the state it saw. The shared stream's state is put
    back after the block."""
    saved: list[tuple[Tensor, Optional[list[Tensor]]]] = []

    def enter(module: nn.Module, args: tuple) -> None:
        seed = (int(torch.randint(2**62, (1,)).item()) * 65_537 + tp_rank) % 2**63
        devices = torch.cuda.is_initialized()
        saved.append((torch.get_rng_state(), torch.cuda.get_rng_state_all() if devices else None))
        # the generators in use, not torch.manual_seed: on a host without CUDA that also queues a lazy seed for each
        # accelerator kind torch knows, formatting the stack each time (224 µs a call here, 1.4 µs for the CPU's)
        torch.default_generator.manual_seed(seed)
        if devices:
            torch.cuda.manual_seed_all(seed)

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        if not saved:  # a pre-hook before ``enter`` raised
            return
        host, devices = saved.pop()
        torch.set_rng_state(host)
        if devices is not None:
            torch.cuda.set_rng_state_all(devices)

    return enter, leave


def _gather_sequence(mesh: DeviceMesh):  # noqa: ANN202 - a forward hook
    """The last block's output, this rank's share → the whole sequence, as the modules after the blocks expect."""

    def gather(share: Tensor) -> Tensor:
        return DTensor.from_local(share, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, Tensor):
            return gather(output)
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):  # (OpenAI GPT's: a list)
            return type(output)([gather(output[0]), *output[1:]])
        raise TensorParallelError(
            f"Under sequence parallelism the last block ({type(module).__name__}) must return the hidden state (or a"
            f" tuple or list that starts with it), to gather it over the sequence; it returned {type(output).__name__}."
        )

    return hook


#: the split group (an attention) whose forward is running, left set when it raises: (its name, the head-count
#: attributes the strategy divided in it)
_RUNNING: list[Optional[tuple[str, list[str]]]] = [None]


def _name_while_running(module: nn.Module, name: str, divided: list[str]) -> None:
    def enter(*_: Any) -> None:
        _RUNNING[0] = (name, divided)

    def leave(*_: Any) -> None:
        _RUNNING[0] = None

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def _reshape_note(tp: int, running: Optional[tuple[str, list[str]]]) -> str:
    general = (f"meshlight: under tensor parallelism each rank holds 1/{tp} of the attention heads, and the strategy"
               " divides the head-count attributes (n_heads, num_heads, n_head, …) by tp.")
    fix = (" A reshape whose other sizes come from the full width no longer fits (nanoGPT's view(B, T, self.n_head,"
           " C // self.n_head) with C = x.size(-1)): reshape with the head size or -1, e.g. view(B, T, self.n_head,"
           " -1).")
    if running is None:
        return general + fix
    name, divided = running
    if divided:
        return f"{general} In {name} it divided {', '.join(divided)}.{fix}"
    return (f"{general} {name} has none of them, so it still reshapes by the whole model's head count: name that"
            f" attribute n_heads (or num_heads, …), or reshape by -1; or give {name} its own entry in the"
            " tensor-parallel plan (the strategy's plan=), or parallelize it yourself in configure_model().")


@contextmanager
def explaining_tensor_parallel_errors(tp: int, loss_parallel: bool) -> Generator[None, None, None]:
    """Add what meshlight knows to PyTorch's error, in a training step (or its backward) at tensor-parallel size
    ``tp`` and with loss parallelism on or off as the strategy has it, when a plain tensor meets a DTensor or a
    reshape does not fit a rank's heads."""
    _RUNNING[0] = None
    try:
        yield
    except RuntimeError as error:
        explained = any(note.startswith("meshlight:") for note in getattr(error, "__notes__", ()))
        if tp > 1 and not explained and re.search(r"shape '\[.*\]' is invalid for input of size", str(error)):
            error.add_note(_reshape_note(tp, _RUNNING[0]))
        if tp > 1 and "got mixed torch.Tensor and DTensor" in str(error) and not explained:
            if loss_parallel:
                error.add_note(
                    "meshlight: under tensor parallelism the LM head's training logits are a DTensor sharded over"
                    " the vocabulary (loss parallelism), and F.cross_entropy on them returns a DTensor. Call"
                    " loss.full_tensor() (or logits.full_tensor()) before combining them with plain tensors (an"
                    " auxiliary loss), or pass loss_parallel=False."
                )
            error.add_note(
                "meshlight: inside the model, a plain tensor meeting a DTensor is a module or parameter tensor"
                " parallelism does not split: give it a role in the tensor-parallel plan (the strategy's plan= or"
                " tp_plan=) or pass sequence_parallel=False."
            )
        raise
