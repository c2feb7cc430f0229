"""The parallel styles behind tensor parallelism's roles (:mod:`meshlight.parallel.tensor` has the table): PyTorch's
``ColwiseParallel``, ``RowwiseParallel`` and ``SequenceParallel`` where they fit, and the styles they lack — a
vocabulary-sharded token embedding whose gradient is each rank's rows alone, a vocabulary-sharded LM head that keeps
its logits sharded for the loss, Hugging Face's transposed ``Conv1D``, a LoRA layer split with its Linear, a fused
projection split part by part, modules left whole on every rank whose gradients are summed over tp, a norm over a
sharded width, modules run on this rank's plain values, and a sequence mixer kept whole under sequence parallelism.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from meshlight.nn.experts import scale_gradient
from meshlight.parallel.adapters import low_rank_update, trained_tokens
from meshlight.parallel.collectives import gather_whole_along, slice_along
from meshlight.parallel.dtensors import modifiable_local, shallow_copy
from meshlight.parallel.model_shape import is_transposed_linear
from meshlight.parallel.sequence_gather import sequence_share
from meshlight.parallel.tensor_plan import TensorParallelError, _shown

__all__ = [
    "AgreedDropout", "ColwiseFromShare", "ColwiseNorm", "FusedColwise", "Interior", "LMHead", "LowRankColwise",
    "LowRankFused", "LowRankHead", "LowRankOnLocalWeights", "LowRankReplicated", "LowRankRowwise", "OnLocalWeights",
    "Replicated", "Rowwise", "SequenceNorm", "TrainedTokens", "TransposedColwise", "TransposedRowwise",
    "VocabEmbedding", "WholeMixer", "rows_of_rank", "split_by_head",
]


class LMHead(ColwiseParallel):
    """Vocabulary-sharded LM head. While training (and ``loss_parallel``), its logits stay a DTensor sharded
    over the vocabulary for ``torch.distributed.tensor.parallel.loss_parallel``: the full logits never exist
    on one rank. In eval mode they are gathered, so metrics and predictions see ordinary tensors."""

    def __init__(self, *, sequence_parallel: bool, loss_parallel: bool) -> None:
        ColwiseParallel.__init__(self, input_layouts=Shard(1) if sequence_parallel else Replicate(),
                                 output_layouts=Shard(-1), use_local_output=False)
        self.sequence_parallel, self.loss_parallel = sequence_parallel, loss_parallel

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


class TransposedColwise(_Transposed, ColwiseParallel):
    placements = {"weight": Shard(1), "bias": Shard(0)}


class Rowwise(RowwiseParallel):
    """Row-parallel; under sequence parallelism (``output_layouts=Shard(1)``) its output is reduce-scattered to this
    rank's share of the sequence wherever that lies (:func:`sequence_share`): the sequence of ``[batch, sequence,
    hidden]``, the tokens of the flattened ``[tokens, hidden]`` an MoE block's shared expert returns. Made local, the
    output is a tensor of its own (:func:`~meshlight.parallel.dtensors.modifiable_local`): a model may modify it in
    place (Llama 4 adds into its shared expert's output, CTRL scales its token embedding's). Also the style of a token
    embedding :class:`VocabEmbedding` does not run (sharded by vocabulary, its lookups summed)."""

    @staticmethod
    def _prepare_output_fn(output_layouts: tuple, use_local_output: bool, mod: nn.Module, outputs: DTensor,
                           device_mesh: DeviceMesh) -> Tensor:
        if output_layouts == (Shard(1),):
            output_layouts = (sequence_share(outputs),)
        if not use_local_output or torch.compiler.is_compiling():
            return RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        # the summed output is a tensor of its own, which the model may modify in place
        return modifiable_local(outputs.redistribute(placements=output_layouts))


class VocabEmbedding(ParallelStyle):
    """The token embedding sharded by vocabulary, as Megatron-LM's vocab-parallel embedding: each rank looks up, on
    plain tensors, the tokens its rows hold (the others' rows are zeros) and the lookups are summed over tp —
    reduce-scattered to this rank's share of the sequence under sequence parallelism (:func:`sequence_share`), else
    all-reduced. Backward gathers the output's gradient, and each rank's weight gradient is its own rows' alone, a
    DTensor placed as the weight. (Torch's row-parallel style runs the lookup as a DTensor op, whose backward gives
    every rank the whole vocabulary's gradient, a replicated DTensor: vocabulary × hidden values per rank, where the
    weight holds 1/tp of them.) The embedding's own forward runs, on a copy holding this rank's rows and the rows'
    own ids (a scaled embedding's scale applies); one that renormalizes rows (``max_norm``), scales gradients by
    frequency or makes sparse ones is left to torch's style (:class:`Rowwise`)."""

    def __init__(self, *, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    @staticmethod
    def fits(module: nn.Module) -> bool:
        """Whether ``module`` is an ``nn.Embedding`` this style runs: rows looked up and nothing else."""
        return isinstance(module, nn.Embedding) and module.max_norm is None and not (
            module.scale_grad_by_freq or module.sparse)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute_parameters(module, device_mesh, {"weight": Shard(0)}, self.src_data_rank)
        module.forward = functools.partial(_vocab_lookup, module, type(module).forward, _first_row(module.weight),
                                           device_mesh, self.sequence_parallel)
        return module


def _first_row(weight: DTensor) -> int:
    """The first of the rows this rank holds of ``weight``, sharded by rows over one mesh dimension: torch.chunk's
    split, as ``Shard(0)`` places them (``ceil(rows / tp)`` on each rank but the last ones)."""
    rows, mesh = weight.shape[0], weight.device_mesh
    return min(mesh.get_local_rank() * -(-rows // mesh.size()), rows)


def _vocab_lookup(module: nn.Embedding, forward: Any, first: int, mesh: DeviceMesh, sequence_parallel: bool,
                  ids: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """:class:`VocabEmbedding`'s forward: rows ``first`` onwards are this rank's."""
    weight = module.weight.to_local()  # (its gradient: a DTensor placed as the weight, of this rank's rows)
    mine = (ids >= first) & (ids < first + weight.shape[0])
    local = shallow_copy(module)
    object.__setattr__(local, "weight", weight)
    padding = module.padding_idx
    local.padding_idx = padding - first if padding is not None and first <= padding < first + weight.shape[0] else None
    looked_up = forward(local, torch.where(mine, ids - first, 0), *args, **kwargs)
    summed = DTensor.from_local(looked_up.masked_fill(~mine.unsqueeze(-1), 0), mesh, [Partial()], run_check=False)
    placed = summed.redistribute(mesh, [sequence_share(looked_up) if sequence_parallel else Replicate()])
    # the summed output is a tensor of its own, which the model may modify in place (CTRL scales it)
    return placed.to_local() if torch.compiler.is_compiling() else modifiable_local(placed)


class TransposedRowwise(_Transposed, Rowwise):
    placements = {"weight": Shard(0), "bias": Replicate()}
    desired_input_layouts = (Shard(-1),)


class _LowRank:
    """Tensor parallelism for a LoRA layer (:mod:`meshlight.parallel.adapters`) in its Linear's role: the Linear
    (``base_layer``) split as the role splits it, each adapter's ``lora_A`` and ``lora_B`` placed so that
    ``B(A(x))`` is split as the Linear's output is (``lora_A.*`` and ``lora_B.*`` by :attr:`down` and :attr:`up`);
    the layer's own forward runs on DTensors between the role's input and output hooks."""

    base: dict[str, Placement]
    transposed_base: dict[str, Placement]
    down: dict[str, Placement]
    up: dict[str, Placement]
    magnitude: dict[str, Placement]
    #: the tp ranks draw from streams of their own (sequence parallelism) and hold the input whole: masks gathered
    agreed_dropout: bool = False

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        base = self.transposed_base if is_transposed_linear(module.base_layer) else self.base
        if self.agreed_dropout:
            _agreeing_dropouts(module, device_mesh)

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            placements = {"base_layer": base, "lora_A": self.down, "lora_B": self.up,
                          "lora_magnitude_vector": self.magnitude}.get(name.split(".")[0])
            if placements is not None:
                _distribute_parameters(mod, mesh, placements, self.src_data_rank)

        _dora_update_of_factors(module)
        return distribute_module(
            module, device_mesh, partition,
            functools.partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            functools.partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class TrainedTokens(ParallelStyle):
    """PEFT's trainable tokens (``trainable_token_indices``: some rows of the token embedding trained, the same rows
    of an LM head tied to it) on a module ``style`` splits over the vocabulary (:class:`VocabEmbedding`,
    :class:`Rowwise`, :class:`LMHead`): the style splits the module (the ``base_layer`` of the layer training its
    rows, :func:`~meshlight.parallel.adapters.trained_tokens`), the trained rows (``trainable_tokens_delta``) stay
    whole on every rank, and each forward runs the module on this rank's rows of its weight with the trained ones
    among them put in their places, as PEFT's forward puts them all into one process's weight (``index_copy``). A
    trained row's gradient is its owner rank's alone, summed over tp."""

    def __init__(self, style: ParallelStyle) -> None:
        super().__init__()
        self.style = style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layer = trained_tokens(module)
        self.style._apply(layer.base_layer, device_mesh)
        # (a head tied to the embedding shares its ParameterDict: the first of the two replicates it)
        _replicate_parameters("trainable_tokens_delta", layer.trainable_tokens_delta, device_mesh)
        layer.forward = functools.partial(_with_trained_rows, layer)
        return module


def _with_trained_rows(layer: nn.Module, inputs: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """:class:`TrainedTokens`'s forward of PEFT's trainable-token ``layer``: its module run on this rank's rows of
    the weight, the active adapters' trained rows among them in their places (PEFT's forward with adapters off or
    merged: the module as it is)."""
    base, active = layer.base_layer, layer.active_adapters
    if layer.disable_adapters or layer.merged or not active:
        return base(inputs, *args, **kwargs)
    layer._check_overlapping_tokens(active)
    weight = base.weight
    rows, first = weight.to_local(), _first_row(weight)
    for adapter in active:  # (a later adapter's rows over an earlier's, as PEFT writes them)
        indices = torch.tensor(layer.token_indices[adapter], device=rows.device)
        mine = (indices >= first) & (indices < first + rows.shape[0])
        trained = layer.trainable_tokens_delta[adapter].to_local(grad_placements=[Partial()])
        rows = rows.index_copy(0, indices[mine] - first, trained[mine].to(rows.dtype))
    placed = DTensor.from_local(rows, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape,
                                stride=weight.stride())
    return torch.func.functional_call(base, {"weight": placed}, (inputs, *args), kwargs)


class AgreedDropout(nn.Module):
    """Dropout of probability ``p`` on an input every tp rank of ``mesh`` holds whole (a column-parallel LoRA
    layer's: PEFT's ``lora_dropout``), where the ranks draw from random streams of their own (under sequence
    parallelism): each draws its ``1/tp`` of the mask from its stream and the parts are gathered, so every rank
    drops the same values, as one process's one mask does (separate masks would feed each rank's columns of the
    adapter a different input). Recomputation replays the draws; the gather is of one byte a value."""

    def __init__(self, p: float, mesh: DeviceMesh) -> None:
        super().__init__()
        self.p, self.mesh = p, mesh

    def forward(self, inputs: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return inputs
        local = inputs.to_local() if isinstance(inputs, DTensor) else inputs
        count, ranks = local.numel(), self.mesh.size()
        part = (torch.rand(-(-count // ranks), device=local.device) >= self.p).to(torch.uint8)
        keep = _gathered_parts(part, self.mesh)[:count].view(local.shape)
        dropped = local * keep.to(local.dtype) / (1 - self.p)
        if isinstance(inputs, DTensor):
            return DTensor.from_local(dropped, inputs.device_mesh, inputs.placements, run_check=False)
        return dropped

    def extra_repr(self) -> str:
        return f"p={self.p}, over tp={self.mesh.size()}"


def _gathered_parts(part: Tensor, mesh: DeviceMesh) -> Tensor:
    """Every rank's ``part`` (of one size) one after another, on each rank."""
    whole = part.new_empty(mesh.size() * part.numel())
    torch.distributed.all_gather_into_tensor(whole, part, group=mesh.get_group())
    return whole


def _dora_update_of_factors(module: nn.Module) -> None:
    """Have each DoRA adapter of a LoRA layer compute ``B·A`` as a product of the factors' weights, split or
    replicated as they are: PEFT runs the factors on an identity matrix, a plain tensor that cannot meet DTensors."""
    for dora in getattr(module, "lora_magnitude_vector", {}).values():
        dora.get_lora_weight = low_rank_update


#: a LoRA layer whose Linear's output rows are split (a fused projection's, a latent attention's up-projection's):
#: its Linear's, each ``lora_B``'s and DoRA's magnitudes by rows, each ``lora_A`` whole (by the submodule's first name)
_ROWS_WITH_ADAPTERS: dict[str, dict[str, Placement]] = {
    "base_layer": {"weight": Shard(0), "bias": Shard(0)}, "lora_A": {"weight": Replicate(), "bias": Replicate()},
    "lora_B": {"weight": Shard(0), "bias": Shard(0)}, "lora_magnitude_vector": {"weight": Shard(0)}}


def _agreeing_dropouts(module: nn.Module, mesh: DeviceMesh) -> None:
    """Give a LoRA layer whose input every tp rank holds whole an :class:`AgreedDropout` for each adapter's dropout."""
    for adapter, dropout in module.lora_dropout.items():
        if isinstance(dropout, nn.Dropout) and dropout.p > 0:
            module.lora_dropout[adapter] = AgreedDropout(dropout.p, mesh)


class LowRankColwise(_LowRank, ColwiseParallel):
    """Column-parallel LoRA: the Linear's and each ``lora_B``'s output rows split, each ``lora_A`` whole on every rank
    (its gradient summed over tp), so the adapter adds to each rank's columns of the output its own.
    ``agreed_dropout``: the tp ranks draw from streams of their own (sequence parallelism), so the adapters' dropout
    is an :class:`AgreedDropout`."""

    base = {"weight": Shard(0), "bias": Shard(0)}
    transposed_base = TransposedColwise.placements
    down = {"weight": Replicate(), "bias": Replicate()}
    up = {"weight": Shard(0), "bias": Shard(0)}
    magnitude = {"weight": Shard(0)}

    def __init__(self, *, agreed_dropout: bool = False) -> None:
        super().__init__()
        self.agreed_dropout = agreed_dropout


class LowRankRowwise(_LowRank, Rowwise):
    """Row-parallel LoRA: the Linear's and each ``lora_A``'s input columns split, each ``lora_B`` whole on every rank
    (its gradient summed over tp). ``B`` is linear, so it runs on the partial sums ``A`` leaves, and the adapter's
    output joins the Linear's partial output before the one reduction of the role."""

    base = {"weight": Shard(1), "bias": Replicate()}
    transposed_base = TransposedRowwise.placements
    down = {"weight": Shard(1), "bias": Replicate()}
    up = {"weight": Replicate(), "bias": Replicate()}
    magnitude = {"weight": Replicate()}
    desired_input_layouts = (Shard(-1),)


class LowRankHead(LMHead, LowRankColwise):
    """LoRA on the LM head (:class:`LMHead`: split over the vocabulary, its logits left so for loss parallelism in
    training): the head's and each ``lora_B``'s vocabulary rows split, each ``lora_A`` whole on every rank, as
    :class:`LowRankColwise` places them (whose ``_apply`` the head's runs). ``agreed_dropout``: as
    :class:`LowRankColwise`'s."""

    def __init__(self, *, sequence_parallel: bool, loss_parallel: bool, agreed_dropout: bool = False) -> None:
        super().__init__(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
        self.agreed_dropout = agreed_dropout


class ColwiseFromShare(ColwiseParallel):
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


class SequenceNorm(SequenceParallel):
    """A norm on this rank's share of the sequence, its parameters replicated (their gradients summed over tp):
    torch's style, the share where :func:`sequence_share` finds it — ``[batch, sequence, hidden]``'s sequence, or
    the tokens of a block that flattens them (OPT's)."""

    @staticmethod
    def _prepare_input_fn(sequence_sharding: tuple, mod: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> DTensor:
        if not isinstance(inputs[0], DTensor):
            sequence_sharding = (sequence_share(inputs[0]),)
        return SequenceParallel._prepare_input_fn(sequence_sharding, mod, inputs, device_mesh)

    def _replicate_module_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        # (torch's makes every parameter trainable: a frozen norm, as a LoRA fine-tune's are, stays frozen)
        _replicate_parameters(name, module, device_mesh)


class FusedColwise(ColwiseParallel):
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
        rows = rows_of_rank(self.parts, self.kv, device_mesh.size(), device_mesh.get_local_rank())

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            _distribute_parameters(mod, mesh, {"weight": Shard(0), "bias": Shard(0)}, self.src_data_rank)

        distribute_module(module, device_mesh, partition,
                          functools.partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts))
        module.forward = functools.partial(_fused_forward, module, rows, is_transposed_linear(module))
        return module


class LowRankFused(FusedColwise):
    """:class:`FusedColwise` for a LoRA layer on a fused projection (GPT-2's ``c_attn``, Phi-3's ``qkv_proj`` and
    ``gate_up_proj``, multi-query Falcon's ``query_key_value``), or on a key or value projection whose heads tp
    exceeds: the Linear (``base_layer``) and each adapter's ``lora_B`` write the packed parts, so both are stored
    sharded by rows, gathered for the forward and computing this rank's rows of every part; each ``lora_A`` stays
    whole on every rank (its gradient, a partial sum over the ranks' rows, summed over tp). The layer's own forward
    adds the two on this rank's rows; ``lora_B``'s gather (rank × width values) is the one collective added. DoRA's
    magnitudes are stored by rows as the Linear's output is, and scale this rank's rows (:func:`_fused_dora_forward`,
    which gathers the Linear's weight, ``lora_B`` and the magnitudes again for its norms: three gathers more).
    ``agreed_dropout``: as :class:`LowRankColwise`'s."""

    def __init__(self, parts: tuple[int, ...], kv: Optional[tuple[int, int]] = None, *,
                 agreed_dropout: bool = False) -> None:
        super().__init__(parts, kv)
        self.agreed_dropout = agreed_dropout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rows = rows_of_rank(self.parts, self.kv, device_mesh.size(), device_mesh.get_local_rank())
        if self.agreed_dropout:
            _agreeing_dropouts(module, device_mesh)

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            placements = _ROWS_WITH_ADAPTERS.get(name.split(".")[0])
            if placements is not None:
                _distribute_parameters(mod, mesh, placements, self.src_data_rank)

        distribute_module(module, device_mesh, partition,
                          functools.partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts))
        base = module.base_layer
        base.forward = functools.partial(_fused_forward, base, rows, is_transposed_linear(base))
        for up in module.lora_B.values():
            up.forward = functools.partial(_fused_forward, up, rows, False)
        for dora in getattr(module, "lora_magnitude_vector", {}).values():
            dora.forward = functools.partial(_fused_dora_forward, dora, rows, is_transposed_linear(base))
        return module


def _fused_dora_forward(dora: nn.Module, rows: Tensor, transposed: bool, inputs: Tensor, *, lora_A: nn.Module,
                        lora_B: nn.Module, scaling: float, base_layer: nn.Module, base_result: Optional[Tensor] = None,
                        **_: Any) -> Tensor:
    """PEFT's DoRA forward (``DoraLinearLayer.forward``: what the adapter adds to the Linear's output) on this rank's
    ``rows`` of a fused projection (:class:`LowRankFused`): the Linear's weight, ``lora_B``'s and the magnitudes are
    gathered whole and cut to those rows, each row's norm of the weight plus the update computed there and detached,
    as PEFT detaches it. ``base_result``: the Linear's output on these rows (None where the adapter's dropout is on:
    the dropped input is multiplied by these rows of the weight again, as PEFT does)."""
    index = rows.to(inputs.device)
    weight = _gathered(base_layer.weight)
    weight = (weight.t() if transposed else weight).index_select(0, index)
    with torch.no_grad():
        update = _gathered(lora_B.weight).index_select(0, index) @ lora_A.weight.to_local()
        norm = torch.linalg.norm(weight + scaling * update, dim=1)
    scale = _gathered(dora.weight).index_select(0, index) / norm
    adapted = lora_B(lora_A(inputs))  # (lora_B's forward: these rows)
    if base_result is None:
        plain = inputs.to_local(grad_placements=[Partial()]) if isinstance(inputs, DTensor) else inputs
        base_result = nn.functional.linear(plain, weight)
    elif base_layer.bias is not None:
        base_result = base_result - _gathered(base_layer.bias).index_select(0, index)
    return (scale - 1) * base_result + scale * adapted * scaling


def rows_of_rank(parts: tuple[int, ...], kv: Optional[tuple[int, int]], tp: int, rank: int) -> Tensor:
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
    """:class:`FusedColwise`'s forward: ``inputs`` a replicated DTensor, the output this rank's ``rows`` of it."""
    weight = _gathered(module.weight)
    weight = (weight.t() if transposed else weight).index_select(0, rows.to(weight.device))
    bias = None if module.bias is None else _gathered(module.bias).index_select(0, rows.to(weight.device))
    return nn.functional.linear(inputs.to_local(grad_placements=[Partial()]), weight, bias)


def _gathered(param: DTensor) -> Tensor:
    """``param`` whole on this rank, its gradient taken as this rank's part of a sum over the mesh."""
    return param.redistribute(param.device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])


class Replicated(ParallelStyle):
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


class LowRankReplicated(Replicated):
    """:class:`Replicated` (``over="sequence"``) for a LoRA layer on a Linear left whole on every rank (a shared
    expert's gate) that reads this rank's share of the sequence: its adapters (and DoRA's magnitudes) whole beside it,
    replicated, their gradients summed over tp with the Linear's; DoRA's ``B·A`` multiplied from the factors' weights
    (PEFT runs them on an identity matrix, a plain tensor beside replicated ones)."""

    def __init__(self, name: str) -> None:
        super().__init__(name, over="sequence")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _dora_update_of_factors(module)
        return super()._apply(module, device_mesh)


def _described(value: Any) -> str:
    """What a module that refuses its input was given, for its error: a tensor's rank and shape, a DTensor's
    placement."""
    if isinstance(value, DTensor):
        return f"a DTensor {tuple(value.shape)} placed {value.placements[0]}"
    return f"a {value.dim()}-D tensor {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__


class ColwiseNorm(ParallelStyle):
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


class OnLocalWeights(ParallelStyle):
    """A module that runs, as it is, on plain tensors and a shallow copy holding this rank's values of its
    parameters. Replicated (DTensors whose gradients are summed over tp, reduced with the norms'): a Hugging Face MoE
    block's router and stacked experts on this rank's share of the tokens under sequence parallelism (the block
    flattens the tokens first), a latent attention's down-projections and their norms (the latent every head
    reads). ``sharded``: over output features (``Shard(0)``), a latent attention's up-projections, each rank making
    its heads. A replicated DTensor input (the gathered input of the module holding a column→row group) is taken as
    this rank's plain tensor, its gradient this rank's part of a sum — the part its heads make. ``own``: its own
    parameters only, where submodules have styles of their own (an MoE block's expert-bias beside the shared
    experts tensor parallelism splits: AFMoE's)."""

    def __init__(self, *, sharded: bool = False, own: bool = False) -> None:
        super().__init__()
        self.sharded, self.own = sharded, own

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            if not self.sharded:
                return _replicate_parameters(name, mod, mesh)
            _distribute_parameters(mod, mesh, {n: Shard(0) for n, _ in mod.named_parameters(recurse=False)},
                                   self.src_data_rank)

        if self.own:  # (``distribute_module`` would replicate every submodule's parameters)
            _replicate_parameters("", module, device_mesh)
            module.register_forward_pre_hook(lambda mod, inputs: _plain_inputs(mod, inputs, device_mesh))
        else:
            distribute_module(module, device_mesh, partition, _plain_inputs)
        # (replicated, its submodules' weights too: a key selector's own projections)
        forward = _forward_on_local_weights if self.sharded or self.own else _forward_on_local_tree
        module.forward = functools.partial(forward, module, type(module).forward)
        return module


def _plain_inputs(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    """:class:`OnLocalWeights`' input hook: each replicated DTensor input as this rank's plain tensor, its gradient this
    rank's part of a sum."""
    return tuple(t.to_local(grad_placements=[Partial()]) if isinstance(t, DTensor)
                 and all(p.is_replicate() for p in t.placements) else t for t in inputs)


class LowRankOnLocalWeights(OnLocalWeights):
    """:class:`OnLocalWeights` for a LoRA layer on a latent attention's projection, run as PEFT runs it on this rank's
    plain values of its whole tree: a down-projection (``latent``) whole, its adapters and DoRA's magnitudes whole
    beside it; an up-projection (``sharded``: this rank's heads) with its Linear's and each ``lora_B``'s rows and the
    magnitudes by rows, each ``lora_A`` whole (its gradient summed over tp). Both read the input every tp rank holds
    whole, so where the ranks draw from streams of their own (``agreed_dropout``: sequence parallelism) the adapters'
    dropout is an :class:`AgreedDropout`."""

    def __init__(self, *, sharded: bool = False, agreed_dropout: bool = False) -> None:
        super().__init__(sharded=sharded)
        self.agreed_dropout = agreed_dropout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.agreed_dropout:
            _agreeing_dropouts(module, device_mesh)

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            if not self.sharded:
                return _replicate_parameters(name, mod, mesh)
            placements = _ROWS_WITH_ADAPTERS.get(name.split(".")[0])
            if placements is not None:
                _distribute_parameters(mod, mesh, placements, self.src_data_rank)

        distribute_module(module, device_mesh, partition, _plain_inputs)
        module.forward = functools.partial(_forward_on_local_tree, module, type(module).forward)
        return module


class Interior(OnLocalWeights):
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


class WholeMixer(ParallelStyle):
    """A sequence mixer kept whole on every rank under sequence parallelism (:data:`~meshlight.parallel.model_shape.
    WHOLE_MIXERS`: a linear attention's recurrence): it reads the whole sequence — its input, this rank's share,
    all-gathered — and hands on its output's share of it. In backward the output's gradient is all-gathered, so
    every rank runs the mixer's whole backward as one process does, and its input keeps its share of that gradient:
    float32 parts inside the mixer (a kernel's, a gated norm's) round as in one process, where a backward of each
    rank's share of the output alone rounded each rank's part apart. Its weights, and its submodules', become
    replicated DTensors run as plain local values, each rank's gradient (the whole one) scaled by 1/tp as its part of
    the sum over tp, reduced with the norms' (exact for a power-of-two tp; the sum keeps the ranks' weights alike
    where a kernel is not deterministic)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        distribute_module(module, device_mesh, _replicate_parameters)
        # (on copies of the whole tree: its forward reads a submodule's weight itself, Qwen3.5's convolution's)
        module.forward = functools.partial(_forward_on_local_tree, module, type(module).forward,
                                           gradient_scale=1 / device_mesh.size())
        first = list(inspect.signature(type(module).forward).parameters)[1]  # after `self`

        def whole(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (gather_whole_along(args[0], 1, group), *args[1:]), kwargs
            return args, {**kwargs, first: gather_whole_along(kwargs[first], 1, group)}

        def share(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            hidden = output[0] if isinstance(output, tuple) else output
            mine = slice_along(hidden, 1, group)
            return (mine, *output[1:]) if isinstance(output, tuple) else mine

        module.register_forward_pre_hook(whole, with_kwargs=True)
        module.register_forward_hook(share, with_kwargs=True)
        return module


def split_by_head(module: nn.Module, names: list[str], mesh: DeviceMesh) -> None:
    """An attention ``module``'s own parameters ``names``, one value per head (GPT-OSS's attention sinks), sharded
    over tp as its heads are; its forward runs on a shallow copy holding this rank's values as plain tensors."""
    _distribute_parameters(module, mesh, dict.fromkeys(names, Shard(0)), src_data_rank=0)
    module.forward = functools.partial(_forward_on_local_weights, module, type(module).forward)


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


def _forward_on_local_tree(module: nn.Module, forward: Any, *args: Any, gradient_scale: float = 1.0,
                           **kwargs: Any) -> Any:
    """``forward`` on a copy of ``module`` and of each of its submodules holding their DTensor parameters as this
    rank's plain values (each gradient, times ``gradient_scale``, this rank's part of a sum where the parameter is
    replicated, its shard's where it is sharded), however the forward reaches them."""

    def plain(param: DTensor) -> Tensor:
        replicated = all(p.is_replicate() for p in param.placements)
        return scale_gradient(param.to_local(grad_placements=[Partial()] if replicated else None), gradient_scale)

    def local(mod: nn.Module) -> nn.Module:
        copied = shallow_copy(mod)
        copied._parameters = {}
        for name, param in mod._parameters.items():  # (None where a Linear has no bias)
            object.__setattr__(copied, name, plain(param) if isinstance(param, DTensor) else param)
        for name, buffer in mod.named_buffers(recurse=False):
            if isinstance(buffer, DTensor):
                object.__setattr__(copied, name, buffer.to_local())
        copied._modules = {name: local(child) for name, child in mod.named_children()}
        return copied

    return forward(local(module), *args, **kwargs)
