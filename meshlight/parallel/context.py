"""Context parallelism: each sequence split over the ranks of the mesh's ``cp`` axis, attention by K/V exchange.

The sequence is cut into ``2·cp`` equal chunks and rank ``i`` holds chunks ``i`` and ``2·cp−1−i`` (Megatron's and
torchtitan's layout): under a causal mask early chunks attend to little and late ones to much, so every rank gets the
same work. The strategy splits every tensor of the batch that runs along the sequence (inputs, labels, position ids)
before the user's step runs; the model itself needs no change, because while a step runs :class:`ContextParallel`
intercepts, through a ``TorchFunctionMode``, the three places a model written for one device depends on where its
tokens sit:

- ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` becomes attention over the whole sequence
  (:func:`gathered_kv_attention`: K and V all-gathered over cp, each local chunk attending to the keys up to its own
  end under its causal mask, aligned to the lower right, which CUDA's kernels apply without building it — any
  device, any SDPA backend; or torch's ring attention on CUDA). Hugging Face models
  get the same through an attention implementation set on their own config (``"meshlight_cp"``).
- a buffer sliced by the local length (``self.cos[:seq_len]``, rotary tables) returns the rows of this rank's
  global positions instead;
- an embedding looked up with ``arange(seq_len)`` (learned positions) looks up the global positions; Hugging Face
  models are given ``position_ids``.

Losses are weighted by each rank's share of the tokens (:func:`token_weighted_loss`), so the step's loss and
gradients are those of the whole sequence. What cp cannot split is refused, naming the module: attention with a
custom mask or without ``is_causal``, and a block that computes attention some other way.

Backward keeps the gathered K/V of each layer rather than gathering them again: one all-gather per layer and step,
not two. They are kept at the model's K/V heads, except on CUDA, where a GQA model's are repeated to the query heads
first: the flash and efficient kernels take as many (without them SDPA would fall back to building every score).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.attention.bias import causal_lower_right
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from meshlight.parallel.adapters import read_without_adapters
from meshlight.parallel.blocks import repeated_blocks
from meshlight.parallel.collectives import all_gather_along
from meshlight.parallel.dtensors import as_dtensor_like, dtensor_spec
from meshlight.parallel.expert import expert_layers
from meshlight.parallel.model_shape import encoder_blocks
from meshlight.parallel.router_logits import gather_router_logits

__all__ = [
    "ATTENTION_METHODS",
    "ContextParallel",
    "ContextParallelError",
    "LocalBatch",
    "SequenceShares",
    "balanced_positions",
    "check_no_encoder",
    "check_sequence_length",
    "gathered_kv_attention",
    "split_batch",
    "token_weighted_loss",
    "tokens_of",
]

#: How attention sees the whole sequence: ``"allgather"`` (K/V all-gathered; any device) or ``"ring"`` (torch's ring
#: attention, K/V passed around the ranks while the flash or efficient CUDA kernels run; CUDA only).
ATTENTION_METHODS = ("allgather", "ring")
#: Labels equal to this are no tokens (Hugging Face's and ``F.cross_entropy``'s default ``ignore_index``).
IGNORE_INDEX = -100
#: The attention implementation Hugging Face models are switched to under context parallelism.
HF_ATTENTION = "meshlight_cp"
#: Hugging Face attention implementations whose attention is plain causal softmax attention (cp may replace them).
_HF_PLAIN_ATTENTION = (None, "sdpa", "eager", "flash_attention_2", "flash_attention_3", HF_ATTENTION)


class ContextParallelError(ValueError):
    """Something context parallelism cannot split; the message names it and what to change."""


@read_without_adapters
def check_no_encoder(model: nn.Module) -> None:
    """Refuse a model with blocks beside its decoder's (:func:`~meshlight.parallel.model_shape.encoder_blocks`: a
    multimodal model's vision encoder), whose inputs do not follow a cut of the token sequence."""
    encoders = encoder_blocks(model)
    if encoders:
        raise ContextParallelError(
            f"{type(model).__name__} holds blocks beside its decoder's ({', '.join(encoders)}: an encoder whose output"
            " joins the token embeddings at its tokens' places, as a multimodal model's vision tower's does). Context"
            " parallelism splits the token sequence, which such a model's inputs do not follow (the image's pixels are"
            " not cut with its tokens): train it with cp=1."
        )


def balanced_positions(seq_len: int, cp: int, rank: int, device: Optional[torch.device] = None) -> Tensor:
    """The global positions rank ``rank`` of ``cp`` holds: chunks ``rank`` and ``2·cp−1−rank`` of ``2·cp``."""
    check_sequence_length(seq_len, cp)
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)]).to(device)


def check_sequence_length(seq_len: int, cp: int) -> None:
    if seq_len % (2 * cp):
        fits = [d for d in range(1, seq_len // 2 + 1) if seq_len % (2 * d) == 0]
        raise ContextParallelError(
            f"The sequence length {seq_len} does not split into 2·cp = {2 * cp} equal chunks (context parallelism"
            f" gives each rank two, one early and one late, to balance the causal work): make the sequences"
            f" {math.ceil(seq_len / (2 * cp)) * 2 * cp} tokens long (pad or crop), or choose cp in {fits[-4:]}."
        )


@dataclass
class LocalBatch:
    """This rank's share of a batch: ``batch`` with every sequence tensor cut to ``positions`` (global, ascending by
    chunk), the whole ``seq_len``, and ``tokens``, the number of labels here that count (None: no labels found;
    every rank then weighs the same); ``labels_shifted``: its ``labels`` are Hugging Face's, shifted already."""

    batch: Any
    positions: Tensor
    seq_len: int
    tokens: Optional[Tensor]
    labels_shifted: bool = False


def split_batch(batch: Any, cp: int, rank: int, *, shift_labels: bool = False) -> LocalBatch:
    """Cut every tensor of ``batch`` that runs along the sequence (dimension 1 as long as the inputs') to this rank's
    positions. The sequence is the inputs': a mapping's ``input_ids`` (else its first tensor of two or more
    dimensions), a sequence's first tensor. ``shift_labels``: a mapping's ``labels`` are Hugging Face's, which the
    model shifts by one itself; they are shifted here, before the cut, because the next token of a chunk's last one
    sits on another rank (the model is then told they are shifted already, as ``shift_labels``).

    A padding mask that masks anything is refused: context parallelism splits plain causal attention only.
    """
    leaves, spec = tree_flatten(batch)
    inputs = _inputs_of(batch)
    if inputs is None:
        raise ContextParallelError(
            "Context parallelism found no sequence in the batch: it splits the tensors of shape [batch, sequence, …]"
            " of a tuple, list or dict batch (a dict's `input_ids` give the length). Pass the inputs as such a"
            " tensor."
        )
    seq_len = inputs.shape[1]
    check_sequence_length(seq_len, cp)
    shifted = False
    if isinstance(batch, Mapping):
        _check_padding_mask(batch.get("attention_mask"))
        if shift_labels and isinstance(batch.get("labels"), Tensor):
            batch, shifted = {**batch, "labels": _shifted(batch["labels"])}, True
            leaves, spec = tree_flatten(batch)
    positions = balanced_positions(seq_len, cp, rank, inputs.device)
    local = [leaf.index_select(1, positions) if _along_sequence(leaf, seq_len) else leaf for leaf in leaves]
    batch = tree_unflatten(local, spec)
    return LocalBatch(batch, positions, seq_len, tokens_of(batch, seq_len // cp), shifted)


def tokens_of(batch: Any, local_len: int) -> Optional[Tensor]:
    """How many labels of this rank's ``batch`` count (are not ``IGNORE_INDEX``); None when it has no labels."""
    labels = _labels_of(batch, local_len)
    return (labels != IGNORE_INDEX).sum().to(torch.float32) if labels is not None else None


def _inputs_of(batch: Any) -> Optional[Tensor]:
    if isinstance(batch, Tensor):
        return batch if batch.dim() >= 2 else None
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), Tensor):
        return batch["input_ids"]
    return next((leaf for leaf in tree_flatten(batch)[0] if isinstance(leaf, Tensor) and leaf.dim() >= 2), None)


def _along_sequence(leaf: Any, seq_len: int) -> bool:
    return isinstance(leaf, Tensor) and leaf.dim() >= 2 and leaf.shape[1] == seq_len


def _labels_of(batch: Any, local_len: int) -> Optional[Tensor]:
    """A mapping's ``labels``; a tuple or list's last tensor when it runs along the sequence (``(inputs, targets)``)."""
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
    elif isinstance(batch, (tuple, list)) and len(batch) >= 2:
        labels = batch[-1]
    else:
        return None
    if not (isinstance(labels, Tensor) and labels.dim() >= 2 and labels.shape[1] == local_len):
        return None
    return labels if not labels.is_floating_point() else None


def _shifted(labels: Tensor) -> Tensor:
    """Hugging Face's shift: position ``t`` is scored against the token at ``t + 1`` (the last against nothing)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def _check_padding_mask(mask: Any) -> None:
    if isinstance(mask, Tensor) and not bool(mask.bool().all()):
        raise ContextParallelError(
            "The batch's attention_mask masks some tokens: context parallelism splits plain causal attention over"
            " whole sequences only. Pack sequences without padding (separate documents with an end-of-text token),"
            " or train with cp=1."
        )


class _TokenWeightedMean(torch.autograd.Function):
    """Forward: the mean over the cp ranks' losses, each weighted by its tokens (the whole sequence's loss, on every
    rank). Backward: this rank's own term only, scaled by ``cp`` because the data-parallel reduction averages over
    the cp ranks as well."""

    @staticmethod
    def forward(ctx: Any, loss: Tensor, tokens: Tensor, group: dist.ProcessGroup) -> Tensor:
        size = dist.get_world_size(group)
        # A rank whose share holds no label (its loss a NaN, 0/0) adds nothing.
        share = torch.where(tokens > 0, loss.detach().to(torch.float32) * tokens, 0.0)
        both = torch.stack([share, tokens]).to(loss.device)
        dist.all_reduce(both, group=group)
        ctx.scale = (size * tokens / both[1]).to(loss.dtype) if float(both[1]) > 0 else loss.new_zeros(())
        return (both[0] / both[1].clamp_min(1)).to(loss.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None]:
        return grad * ctx.scale, None, None


def token_weighted_loss(loss: Tensor, tokens: Optional[Tensor], group: dist.ProcessGroup) -> Tensor:
    """The whole sequence's loss from each cp rank's mean ``loss`` over its ``tokens`` (None: equal shares)."""
    if isinstance(loss, DTensor):  # a loss on vocabulary-sharded logits: replicated over tp
        loss = loss.full_tensor()
    tokens = tokens if tokens is not None else torch.ones((), dtype=torch.float32)
    return _TokenWeightedMean.apply(loss, tokens.to(loss.device), group)


def gathered_kv_attention(
    query: Tensor, key: Tensor, value: Tensor, group: dist.ProcessGroup, *, scale: Optional[float] = None,
    dropout_p: float = 0.0, enable_gqa: bool = False, window: Optional[int] = None, sinks: Optional[Tensor] = None,
) -> Tensor:
    """Causal attention of this rank's queries (``[batch, heads, 2·chunk, head_dim]``, chunks ``rank`` and
    ``2·cp−1−rank``) over the whole sequence's keys and values, all-gathered over ``group`` (backward
    reduce-scatters their gradients). Each local chunk attends only to the keys up to its own end. ``window``: each
    query sees only the last ``window`` positions up to its own (Hugging Face's sliding window); ``sinks``: a learned
    logit per head that joins each query's softmax and attends to nothing (GPT-OSS's attention sinks), computed as the
    model's own eager attention computes it."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = query.shape[2] // 2
    keys, values = (_gather_sequence(t, group, chunk) for t in (key, value))
    if (enable_gqa and query.is_cuda) or sinks is not None:  # CUDA's kernels take as many K/V heads as query heads
        # (else SDPA falls back to one that builds the whole score matrix); elsewhere K/V stay at their own heads
        repeat = query.shape[1] // keys.shape[1]
        keys, values, enable_gqa = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1), False
    out = []
    for slot, index in enumerate((rank, 2 * cp - 1 - rank)):
        end = (index + 1) * chunk
        queries, seen = query[:, :, slot * chunk:(slot + 1) * chunk], (keys[:, :, :end], values[:, :, :end])
        if window is None and sinks is None:
            # A causal mask aligned to the lower right: the chunk's i-th query sees keys up to index·chunk + i. CUDA's
            # flash and efficient kernels apply it without building it; elsewhere SDPA builds it.
            out.append(F.scaled_dot_product_attention(queries, *seen, attn_mask=causal_lower_right(chunk, end),
                                                      dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa))
            continue
        positions = torch.arange(end - chunk, end, device=query.device)[:, None]
        keys_seen = torch.arange(end, device=query.device)
        visible = keys_seen <= positions
        if window is not None:
            visible &= keys_seen > positions - window
        if sinks is None:
            out.append(F.scaled_dot_product_attention(queries, *seen, attn_mask=visible, dropout_p=dropout_p,
                                                      scale=scale, enable_gqa=enable_gqa))
        else:
            out.append(_attention_with_sinks(queries, *seen, visible, sinks, scale, dropout_p))
    return torch.cat(out, dim=2)


def _attention_with_sinks(query: Tensor, key: Tensor, value: Tensor, visible: Tensor, sinks: Tensor,
                          scale: Optional[float], dropout_p: float) -> Tensor:
    """softmax over the visible keys' scores and each head's sink logit, the sink's share dropped, times the values."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = (query @ key.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    sink = sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[2], 1).to(scores.dtype)
    weights = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return F.dropout(weights, p=dropout_p).to(value.dtype) @ value


def _gather_sequence(tensor: Tensor, group: dist.ProcessGroup, chunk: int) -> Tensor:
    """``tensor``'s dimension 2 (the sequence) from every rank of ``group``, in global order."""
    cp = dist.get_world_size(group)
    return all_gather_along(tensor, 2, group).index_select(2, _global_order(cp, chunk, tensor.device))


@functools.lru_cache(maxsize=16)
def _global_order(cp: int, chunk: int, device: torch.device) -> Tensor:
    """For each global position, where it sits in the ranks' concatenated chunks."""
    owner = [(i if i < cp else 2 * cp - 1 - i, 0 if i < cp else 1) for i in range(2 * cp)]
    return torch.cat([torch.arange(chunk) + (rank * 2 + slot) * chunk for rank, slot in owner]).to(device)


def ring_attention(query: Tensor, key: Tensor, value: Tensor, mesh: DeviceMesh, *, scale: Optional[float] = None,
                   dropout_p: float = 0.0) -> Tensor:
    """torch's ring attention (``torch.distributed.tensor.experimental``) over ``mesh`` for this rank's chunks, which
    are torch's load-balanced layout too; its DTensor handlers must be on (:meth:`ContextParallel.active`)."""
    if key.shape[1] != query.shape[1]:  # the flash and efficient kernels take as many K/V heads as query heads
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    q, k, v = (DTensor.from_local(t.contiguous(), mesh, [Shard(2)], run_check=False) for t in (query, key, value))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale).to_local()


@contextmanager
def _ring_handlers() -> Iterator[None]:
    from torch.distributed.tensor.experimental._attention import _cp_options
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _disable_cp_dtensor_dispatcher,
        _enable_cp_dtensor_dispatcher,
    )

    balanced = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = True
    _enable_cp_dtensor_dispatcher()
    try:
        yield
    finally:
        _disable_cp_dtensor_dispatcher()
        _cp_options.enable_load_balance = balanced


def check_attention_method(method: str, device: torch.device) -> None:
    if method not in ATTENTION_METHODS:
        raise ContextParallelError(f"cp_attention={method!r}: choose one of {list(ATTENTION_METHODS)}.")
    if method == "ring" and device.type != "cuda":
        raise ContextParallelError(
            f"cp_attention='ring' runs torch's ring attention, which splits only CUDA's flash, efficient and cuDNN"
            f" attention kernels; this run is on {device.type}. Use cp_attention='allgather' (any device)."
        )


class ContextParallel:
    """The context-parallel side of one model on one rank: the cp group, the attention method, and the hooks that
    make the model's attention and positions see the whole sequence while :meth:`active`."""

    def __init__(self, mesh: DeviceMesh, model: nn.Module, *, attention: str = "allgather",
                 device: Optional[torch.device] = None) -> None:
        check_attention_method(attention, device or torch.device("cpu"))
        self.mesh, self.group = mesh, mesh.get_group()
        self.size, self.rank = mesh.size(), mesh.get_local_rank()
        self.attention_method = attention
        self.local: Optional[LocalBatch] = None  # while active
        self._buffers: set[int] = set()
        self._hooked: set[int] = set()
        self._positional: dict[int, bool] = {}  # embedding weight → looked up by position (decided at first use)
        self._names: list[str] = []  # the modules whose forward is running, innermost last
        self._unchecked: dict[int, str] = {}  # blocks not yet seen calling attention → their names
        self._calls = 0
        self.computing = False  # inside :meth:`attention`: its own SDPA calls are not intercepted again
        self.hf_models: list[nn.Module] = []
        self._hf_implementations: dict[int, Optional[str]] = {}  # id(config) -> the attention it had
        self.add_model(model)

    # ------------------------------------------------------------------------------------------ setup

    def add_model(self, model: nn.Module) -> None:
        """Hook ``model`` (a LightningModule, or a pipeline stage holding some of its modules)."""
        check_no_encoder(model)
        self._buffers |= {id(b) for b in model.buffers()}
        # (a pipeline stage's stand-ins for other stages' blocks hold no parameters and attend to nothing)
        blocks = {id(b) for b in repeated_blocks(model) if any(True for _ in b.parameters())}
        for name, module in model.named_modules():
            # (a pipeline stage's shallow copy of a module shares the original's hooks)
            if id(module._forward_pre_hooks) in self._hooked:
                continue
            self._hooked.add(id(module._forward_pre_hooks))
            module._meshlight_cp = self
            module.register_forward_pre_hook(functools.partial(self._enter, name or type(model).__name__))
            module.register_forward_hook(self._leave)
            if id(module) in blocks:
                self._unchecked[id(module)] = name
        for hf in _hugging_face_models(model):
            self._prepare_hf(hf)
        for layer in expert_layers(model):  # capacity and balancing counted over the whole sequence
            layer.sequence_split = SequenceShares(self)

    def _prepare_hf(self, model: nn.Module) -> None:
        config = model.config
        implementation = getattr(config, "_attn_implementation", None)
        if implementation not in _HF_PLAIN_ATTENTION:
            raise ContextParallelError(
                f"{type(model).__name__} computes attention with {implementation!r}, a function context parallelism"
                " cannot split (it would attend to this rank's share of the sequence alone). Load the model with"
                " attn_implementation='sdpa', or train with cp=1."
            )
        _check_hf_positions(model)
        _register_hf_attention()
        self._hf_implementations[id(config)] = implementation
        config._attn_implementation = HF_ATTENTION
        model.register_forward_pre_hook(self._hf_inputs, with_kwargs=True)
        # its own MoE load-balancing loss (output_router_logits) over the whole sequence's routing
        gather_router_logits(model, self.group, replicated_loss=False, split=lambda: self.local is not None)
        self.hf_models.append(model)

    # ------------------------------------------------------------------------------------------ a step

    def split(self, batch: Any) -> LocalBatch:
        return split_batch(batch, self.size, self.rank, shift_labels=bool(self.hf_models))

    @contextmanager
    def active(self, local: LocalBatch) -> Iterator[None]:
        """While a step runs on ``local`` (forward, and backward: recomputed blocks run forward again in it)."""
        self.local, self._names = local, []
        with ExitStack() as stack:
            stack.enter_context(_ContextParallelMode(self))
            if self.attention_method == "ring":
                stack.enter_context(_ring_handlers())
            try:
                yield
            finally:
                self.local = None

    def weighted_loss(self, loss: Tensor, tokens: Optional[Tensor]) -> Tensor:
        return token_weighted_loss(loss, tokens, self.group)

    def tokens_of(self, batch: Any) -> Optional[Tensor]:
        """The counted labels of a piece of this rank's batch (a pipeline's microbatch), while :meth:`active`."""
        assert self.local is not None
        return tokens_of(batch, self.local.seq_len // self.size)

    # ------------------------------------------------------------------------------------------ interception

    def _enter(self, name: str, module: nn.Module, args: Any) -> None:
        if self.local is not None:
            self._names.append(name)
            if id(module) in self._unchecked:
                module._meshlight_cp_calls = self._calls

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.local is None:
            return
        if self._names:
            self._names.pop()
        name = self._unchecked.get(id(module))
        if name is not None and self._calls == getattr(module, "_meshlight_cp_calls", self._calls):
            raise ContextParallelError(
                f"Block `{name}` ({type(module).__name__}) ran no scaled_dot_product_attention: its attention is"
                " computed some other way, which context parallelism cannot split (it would attend to this rank's"
                " share of the sequence alone). Call F.scaled_dot_product_attention(q, k, v, is_causal=True) in it (a"
                " Hugging Face model: attn_implementation='sdpa'), or train with cp=1."
            )
        if name is not None:
            del self._unchecked[id(module)]

    def attention(self, query: Tensor, key: Tensor, value: Tensor, *, attn_mask: Optional[Tensor] = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                  enable_gqa: bool = False, window: Optional[int] = None, sinks: Optional[Tensor] = None) -> Tensor:
        """``F.scaled_dot_product_attention`` over the whole sequence, for this rank's queries (``window`` and
        ``sinks``: see :func:`gathered_kv_attention`)."""
        assert self.local is not None
        where = f"`{self._names[-1]}`" if self._names else "the model"
        if attn_mask is not None or not is_causal:
            what = "a custom attn_mask" if attn_mask is not None else "is_causal=False"
            raise ContextParallelError(
                f"{where} calls scaled_dot_product_attention with {what}: context parallelism splits causal attention"
                " over whole sequences only. Call it with is_causal=True and no mask (pack sequences instead of"
                " padding them), or train with cp=1."
            )
        local_len = self.local.seq_len // self.size
        if query.shape[2] != local_len or key.shape[2] != local_len:
            raise ContextParallelError(
                f"{where} attends {query.shape[2]} queries to {key.shape[2]} keys, but this rank holds {local_len}"
                " tokens of the sequence: context parallelism splits self-attention over the whole sequence only"
                " (no cached keys, no cross-attention). Train with cp=1."
            )
        self._calls += 1
        spec = dtensor_spec(query)
        query, key, value = (t.to_local() if isinstance(t, DTensor) else t for t in (query, key, value))
        self.computing = True
        try:
            if self.attention_method == "ring":
                if window is not None or sinks is not None:
                    raise ContextParallelError(
                        f"{where} attends with {'a sliding window' if window is not None else 'attention sinks'},"
                        " which torch's ring attention does not take: use attention='allgather'."
                    )
                out = ring_attention(query, key, value, self.mesh, scale=scale, dropout_p=dropout_p)
            else:
                out = gathered_kv_attention(query, key, value, self.group, scale=scale, dropout_p=dropout_p,
                                            enable_gqa=enable_gqa or query.shape[1] != key.shape[1], window=window,
                                            sinks=sinks)
        finally:
            self.computing = False
        return as_dtensor_like(out, spec)

    def positions_of(self, index: Any, tensor: Tensor) -> Any:
        """``tensor[index]`` for a buffer sliced ``[:local length]`` along one dimension: that dimension's rows at this
        rank's global positions (the index unchanged when it is no such slice)."""
        assert self.local is not None
        local_len = self.local.seq_len // self.size
        items = index if isinstance(index, tuple) else (index,)
        dims = [i for i, item in enumerate(items) if isinstance(item, slice) and item.start in (None, 0)
                and item.stop == local_len and item.step in (None, 1)]
        if len(dims) != 1 or any(item is Ellipsis or item is None for item in items[:dims[0]]):
            return None
        dim = dims[0]
        if tensor.dim() <= dim or tensor.shape[dim] < self.local.seq_len:
            return None
        return tensor.index_select(dim, self.local.positions.to(tensor.device))

    def embedding_positions(self, indices: Tensor, weight: Tensor) -> Optional[Tensor]:
        """The global positions for an embedding looked up with ``arange(local length)`` (learned positions)."""
        assert self.local is not None
        local_len = self.local.seq_len // self.size
        spec = dtensor_spec(indices)  # (under tensor parallelism an embedding's input may be a DTensor)
        indices = indices.to_local() if isinstance(indices, DTensor) else indices
        if indices.is_floating_point() or indices.dim() == 0 or indices.shape[-1] != local_len:
            return None
        key = id(weight)
        if key not in self._positional:
            counting = torch.arange(local_len, device=indices.device)
            self._positional[key] = bool((indices == counting).all())
        if not self._positional[key]:
            return None
        return as_dtensor_like(self.local.positions.to(indices.device)[indices], spec)

    def _hf_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        """A Hugging Face model's forward under cp: its positions are this rank's, and its labels (shifted by
        :func:`split_batch`) are not shifted again."""
        if self.local is None:
            return None
        if kwargs.get("position_ids") is None:  # one row per sequence (a pipeline cuts them into microbatches)
            inputs = _first_tensor(args, kwargs)
            rows = inputs.shape[0] if inputs is not None and inputs.dim() >= 2 else 1
            device = inputs.device if inputs is not None else None
            kwargs["position_ids"] = self.local.positions.to(device).expand(rows, -1)
        if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
            if not self.local.labels_shifted:
                raise ContextParallelError(
                    f"{type(module).__name__} is given labels that did not come in the batch as its 'labels': the"
                    " model shifts labels by one itself, and under context parallelism the next token of a rank's"
                    " last one sits on another rank. Put the labels in a dict batch under 'labels' (meshlight shifts"
                    " them before splitting the sequence), or compute the loss from the logits with targets shifted"
                    " in the data."
                )
            kwargs["shift_labels"] = kwargs["labels"]
        return args, kwargs


class SequenceShares:
    """What a :class:`~meshlight.nn.MoE` layer needs under context parallelism to count its capacity and balancing
    loss per whole sequence, as on one device (set as its ``sequence_split``): while a cp step runs, each rank holds
    ``count`` shares of every sequence; :meth:`whole` gathers a per-token tensor ``[batch, local, ...]`` of every rank
    into global order, :meth:`local` cuts a whole one to this rank's positions, :meth:`summed` adds over the ranks."""

    def __init__(self, cp: ContextParallel) -> None:
        self.cp = cp

    @property
    def count(self) -> int:
        return self.cp.size if self.cp.local is not None else 1

    def whole(self, tensor: Tensor) -> Tensor:
        gathered = all_gather_along(tensor.contiguous(), 1, self.cp.group)
        return gathered.index_select(1, _global_order(self.cp.size, tensor.shape[1] // 2, tensor.device))

    def local(self, tensor: Tensor) -> Tensor:
        return tensor.index_select(1, balanced_positions(tensor.shape[1], self.cp.size, self.cp.rank, tensor.device))

    def summed(self, tensor: Tensor) -> Tensor:
        out = tensor.clone()
        dist.all_reduce(out, group=self.cp.group)
        return out


def _first_tensor(args: tuple, kwargs: dict) -> Optional[Tensor]:
    return next((x for x in tree_flatten((args, kwargs))[0] if isinstance(x, Tensor)), None)


class _ContextParallelMode(TorchFunctionMode):
    """Routes a step's attention, position-table slices and position lookups through :class:`ContextParallel`."""

    def __init__(self, cp: ContextParallel) -> None:
        super().__init__()
        self.cp = cp

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.cp.computing:
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return self.cp.attention(*args, **kwargs)
        if getattr(func, "__name__", None) == "__getitem__" and id(args[0]) in self.cp._buffers:
            rows = self.cp.positions_of(args[1], args[0])
            if rows is not None:
                return func(rows, *args[1:], **kwargs)
        elif func is F.embedding:
            positions = self.cp.embedding_positions(args[0], args[1])
            if positions is not None:
                return func(positions, *args[1:], **kwargs)
        return func(*args, **kwargs)


def _hugging_face_models(model: nn.Module) -> list[nn.Module]:
    """The outermost Hugging Face ``transformers`` models inside ``model``."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if type(module).__module__.startswith("transformers.") and hasattr(getattr(module, "config", None),
                                                                            "_attn_implementation"):
            found.append(module)
            inside |= {id(m) for m in module.modules()}
    return found


#: the kinds of layer (a config's ``layer_types``) whose attention cp splits: causal, within a window or not
_HF_SPLIT_LAYERS = ("full_attention", "sliding_attention")


def _check_hf_positions(model: nn.Module) -> None:
    """Refuse what a Hugging Face model's config says it computes from positions that cp cannot give it: attention in
    chunks (Llama 4's ``chunked_attention`` layers: their mask, which cp's attention does not take), and Llama 4's
    query temperature in its layers without rotary, computed from each token's index in the model's input (under cp,
    in this rank's share)."""
    config, name = model.config, type(model).__name__
    kinds = sorted(set(getattr(config, "layer_types", None) or ()) - set(_HF_SPLIT_LAYERS))
    if kinds:
        chunk = getattr(config, "attention_chunk_size", None)
        raise ContextParallelError(
            f"{name} has {', '.join(map(repr, kinds))} layers (config.layer_types)"
            + (f", attending within chunks of {chunk} tokens (config.attention_chunk_size)" if chunk else "")
            + ": context parallelism splits causal attention (with a sliding window or attention sinks) over whole"
            " sequences only. Train this model with cp=1"
            + (", or without chunks (attention_chunk_size=None in its config)." if chunk else ".")
        )
    if getattr(config, "attn_temperature_tuning", False) and 0 in (getattr(config, "no_rope_layers", None) or ()):
        raise ContextParallelError(
            f"{name} scales the queries of its layers without rotary positions by a temperature of each token's"
            " index in its input (config.attn_temperature_tuning), which under context parallelism is the index in"
            " this rank's share of the sequence. Train it with cp=1, or with attn_temperature_tuning=False."
        )


def _hf_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                  dropout: float = 0.0, scaling: Optional[float] = None, **kwargs: Any) -> tuple[Tensor, None]:
    """The ``"meshlight_cp"`` attention of Hugging Face models: outside a cp step the model's own eager attention
    where it had that, else sdpa; the whole sequence's inside one."""
    cp: Optional[ContextParallel] = getattr(module, "_meshlight_cp", None)
    if cp is None or cp.local is None:
        had = cp._hf_implementations.get(id(getattr(module, "config", None))) if cp is not None else None
        own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if had == "eager" and callable(own):  # (GPT-OSS's sinks: sdpa would leave them out)
            return own(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    unsupported = [name for name in ("softcap",) if kwargs.get(name) is not None]
    if unsupported or (attention_mask is not None and attention_mask.dim() == 4):
        what = f"{', '.join(unsupported)}" if unsupported else "a custom 4-D attention mask"
        raise ContextParallelError(
            f"{type(module).__name__} attends with {what}: context parallelism splits causal attention (with a"
            " sliding window or attention sinks) over whole sequences only. Train this model with cp=1."
        )
    out = cp.attention(query, key, value, is_causal=True, scale=scaling,
                       dropout_p=dropout if module.training else 0.0, window=kwargs.get("sliding_window"),
                       sinks=kwargs.get("s_aux"))
    return out.transpose(1, 2).contiguous(), None


def _register_hf_attention() -> None:
    from transformers import AttentionInterface

    if HF_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(HF_ATTENTION, _hf_attention)
