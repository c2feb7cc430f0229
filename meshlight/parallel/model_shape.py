"""A model's shape — blocks, hidden size, attention heads, MLP width, experts, vocabulary — read from its structure,
or from its config where it has one that says it (Hugging Face's, litgpt's).

The layout planner prices a model by its shape (:func:`model_shape`); tensor parallelism splits it by the head
counts its structure holds. Those come from the attributes an attention module keeps them under
(:data:`HEAD_COUNT_ATTRIBUTES`, which tensor parallelism divides by tp), else from its ``head_dim`` and its
projections' widths (Hugging Face's Llama keeps only ``head_dim`` and reshapes with ``-1``). Where a config states
the shape the planner takes it from there, as fused projections hide the heads from the structure; a layout it
proposes is still one the engine accepts, because ``Hybrid3DStrategy`` holds tp at 1 where no plan splits the model.
"""

from __future__ import annotations

import functools
import os
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

from torch import nn

from meshlight.nn.moe import MoE
from meshlight.parallel.blocks import class_path, holds_blocks, repeated_blocks
from meshlight.parallel.expert import is_dense_experts, is_stacked_experts, listed_experts

__all__ = [
    "BETWEEN_BLOCKS", "GROUP_ATTRIBUTES", "HEAD_COUNT_ATTRIBUTES", "HEAD_DIM_ATTRIBUTES", "KEPT_WHOLE",
    "KEY_SELECTORS", "WHOLE_MIXERS", "WIDTH_ATTRIBUTES", "ModelShape", "ModelShapeError", "attention_heads",
    "blocks_fed_between", "config_shape", "count_holder", "decoder_blocks", "decoder_container", "encoder_blocks",
    "encoder_parameters", "fused_parts", "head_counts", "head_dim_of", "head_width", "hidden_size",
    "is_transposed_linear", "linear_widths", "lm_heads", "model_shape", "per_head_parameters", "projection_heads",
    "projections",
]

#: Sequence mixers that tensor parallelism keeps whole on every rank, by class (``package.module.Class``): the linear
#: attention (Gated DeltaNet) of Qwen3-Next's, Qwen3.5's (and its MoE's) and OLMo hybrid's layers — a recurrence over
#: the sequence, its q|k|v through a depthwise convolution over it — Kimi Linear's KDA, MiniMax's lightning attention,
#: the Mamba mixers of Nemotron-H, Jamba, Bamba, Falcon-H1, Granite 4 and Zamba, and LFM2's short convolutions. Every
#: rank runs the whole module on the whole sequence (role ``whole``: :class:`~meshlight.parallel.tensor_styles.
#: WholeMixer`); the attention layers, MLPs and experts beside it are split. (Each class here was checked against one
#: process, but Zamba's and Zamba2's, whose shared transformer blocks tensor parallelism refuses.) Their Linears do not
#: count towards :func:`hidden_size`.
WHOLE_MIXERS = frozenset({
    "transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet",
    "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet",
    "transformers.models.olmo_hybrid.modeling_olmo_hybrid.OlmoHybridGatedDeltaNet",
    "transformers.models.nemotron_h.modeling_nemotron_h.NemotronHMamba2Mixer",
    "transformers.models.jamba.modeling_jamba.JambaMambaMixer",
    "transformers.models.bamba.modeling_bamba.BambaMixer",
    "transformers.models.falcon_h1.modeling_falcon_h1.FalconH1Mixer",
    "transformers.models.granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridMambaLayer",
    "transformers.models.zamba.modeling_zamba.ZambaMambaMixer",
    "transformers.models.zamba2.modeling_zamba2.Zamba2MambaMixer",
    "transformers.models.minimax.modeling_minimax.MiniMaxLightningAttention",
    "transformers.models.lfm2.modeling_lfm2.Lfm2ShortConv",
    "transformers.models.lfm2_moe.modeling_lfm2_moe.Lfm2MoeShortConv",
    "transformers.models.kimi_linear.modeling_kimi_linear.KimiLinearDeltaAttention",
})
#: Modules inside an attention that pick, from its whole input, the keys each query attends to — DeepSeek Sparse
#: Attention's lightning indexer (DeepSeek-V3.2's, GLM-5's), which scores every key with heads of its own and returns
#: each query's top-k: every tp rank runs it whole on the whole input (role ``latent``), so that all ranks' heads
#: attend to the same keys. (Hugging Face's runs without gradients: DeepSeek trains it apart.) Their Linears do not
#: count towards :func:`hidden_size`.
KEY_SELECTORS = frozenset({
    "transformers.models.deepseek_v32.modeling_deepseek_v32.DeepseekV32Indexer",
    "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaIndexer",
})
#: Decoders whose forward changes the hidden state between their first blocks, by class (``package.module.Class``) →
#: the model's config entry listing what it adds, one item per block fed: Qwen3-VL's and its MoE's deepstack adds the
#: vision encoder's features from some of its blocks (``vision_config.deepstack_visual_indexes``) to the image tokens'
#: hidden states after as many of the decoder's first layers (:func:`blocks_fed_between`). Under sequence parallelism
#: over the blocks only, the hidden state is gathered after each of those blocks and cut to the share again before the
#: next; pipelining keeps them, and the block after them, on the first stage, which runs the encoder.
BETWEEN_BLOCKS = {
    "transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLTextModel": "vision_config.deepstack_visual_indexes",
    "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeTextModel":
        "vision_config.deepstack_visual_indexes",
}
#: The modules tensor parallelism keeps whole on every rank, by class: their insides get no role.
KEPT_WHOLE = WHOLE_MIXERS | KEY_SELECTORS
#: Attribute names under which attention modules keep their head counts (tensor parallelism divides them by tp).
HEAD_COUNT_ATTRIBUTES = (
    "n_heads", "num_heads", "n_head", "num_attention_heads", "heads", "nheads",
    "n_kv_heads", "num_kv_heads", "n_kv_head", "num_key_value_heads", "kv_heads", "n_query_groups",
)
#: Attribute names under which attention modules keep the widths they split a fused projection's output by (GPT-2's
#: ``split_size``; StarCoder's ``embed_dim`` and ``kv_dim``, its q and its key/value heads): tensor parallelism makes
#: them this rank's widths with the head counts.
WIDTH_ATTRIBUTES = ("split_size", "embed_dim", "kv_dim")
#: Attribute names under which attention modules keep how many query heads read each key/value head (Hugging Face's
#: ``num_key_value_groups``): tensor parallelism divides them where it holds fewer key/value heads than query heads
#: per rank would need (key/value heads fewer than the ranks).
GROUP_ATTRIBUTES = ("num_key_value_groups",)
#: Attribute names under which attention modules keep the width of one head.
HEAD_DIM_ATTRIBUTES = ("head_dim", "head_size")


class ModelShapeError(ValueError):
    """A model whose shape cannot be read from its structure (no repeated blocks)."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape as its structure tells it. ``heads``, ``kv_heads`` and ``head_dim`` are
    None where no attention module names its head count or ``head_dim``; ``mlp_width`` is the widest projection
    out of the hidden state that is not the hidden size (the experts' width where that is wider); ``gated_mlp``:
    two projections read the hidden state into that width (SwiGLU's gate and up), not one (GPT-2's), None where no
    Linear does (experts stacked as parameters); ``tied_head``: the LM head's weight is the token embedding's (one
    parameter)."""

    blocks: int
    hidden: int
    heads: Optional[int]
    kv_heads: Optional[int]
    head_dim: Optional[int]
    mlp_width: int
    vocab: int
    experts: int = 0
    top_k: int = 1
    moe_layers: int = 0
    #: the indices of the blocks holding experts where some blocks hold none (DeepSeek's dense first layers, Llama 4
    #: Maverick's every other one); empty where all do, or where the blocks are not at hand
    moe_positions: tuple[int, ...] = ()
    gated_mlp: Optional[bool] = None
    tied_head: bool = False
    #: the width of what every token of an MoE layer runs beside its routed experts (Qwen2-MoE's shared expert,
    #: DeepSeek's shared experts together), 0 for none; as the config states it, else as the MoE block holds it
    shared_mlp_width: int = 0
    #: the MLP width of an MoE model's layers without experts, 0 for ``mlp_width``
    dense_mlp_width: int = 0
    #: parameters of the encoders beside the decoder (a multimodal model's vision tower and its projector), which
    #: tensor parallelism keeps whole on every rank (:func:`encoder_parameters`)
    encoder_params: int = 0
    #: the fewest blocks the first pipeline stage holds: those after which the decoder adds its encoder's features,
    #: and the next (:func:`blocks_fed_between`)
    first_stage_blocks: int = 1


def model_shape(module: nn.Module) -> ModelShape:
    """The shape of ``module``: its config's (:func:`config_shape`) where it has one, else from its decoder's blocks
    (:func:`decoder_blocks`): the hidden size the most Linears in them read, the first
    block's attention heads (:func:`attention_heads`), the largest Embedding's vocabulary and the
    ``meshlight.nn.MoE`` layers' experts."""
    stated = config_shape(module)
    if stated is not None:
        return stated
    blocks = decoder_blocks(module)
    if not blocks:
        raise ModelShapeError(f"{type(module).__name__} has no repeated blocks (an nn.ModuleList of layers).")
    hidden = hidden_size(blocks) or 0
    attention = next((m for m in blocks[0].modules() if attention_heads(m, hidden)), None)
    heads, kv_heads = attention_heads(attention, hidden) if attention else (None, None)
    moes = [m for m in module.modules() if isinstance(m, MoE)]
    mlp_width = max(moes[0].config.hidden_dim, _widest_projection(blocks, hidden)) if moes else _widest_projection(
        blocks, hidden)
    return ModelShape(
        blocks=len(blocks), hidden=hidden, heads=heads, kv_heads=kv_heads,
        head_dim=(head_dim_of(attention) or hidden // heads) if attention else None,
        mlp_width=mlp_width, gated_mlp=mlp_gated(blocks, hidden, mlp_width),
        vocab=max((m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)), default=0),
        experts=moes[0].num_experts if moes else 0, top_k=moes[0].top_k if moes else 1, moe_layers=len(moes),
        moe_positions=_moe_positions(blocks), tied_head=head_tied(module), encoder_params=encoder_parameters(module),
        first_stage_blocks=blocks_fed_between(module) + 1,
    )


def _widest_projection(blocks: list[nn.Module], hidden: int) -> int:
    """The widest output of the first block's Linears outside its attention that read the hidden state and write
    another width (the MLP's up-projection, where no config names it: BLOOM's four times the hidden size, MPT's
    ``expansion_ratio`` times), or four times ``hidden`` where there is none."""
    if not blocks:
        return 4 * hidden
    attention = [m for m in blocks[0].modules() if attention_heads(m, hidden)]
    inside = {id(linear) for a in attention for linear in a.modules()}
    widths = [width[1] for m in blocks[0].modules() if id(m) not in inside
              and (width := linear_widths(m)) and width[0] == hidden and width[1] != hidden]
    return max(widths, default=4 * hidden)


def config_shape(module: nn.Module) -> Optional[ModelShape]:
    """The shape the config of ``module`` (or of its first submodule that has one) states, read under Hugging Face's
    names (``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``,
    ``num_local_experts``, …, GPT-2's through its attribute map) or litgpt's (``n_layer``, ``n_head``,
    ``n_query_groups``, ``padded_vocab_size``, ``n_expert``, …); None where no config says so. Fused projections
    (GPT-2's ``Conv1D``, litgpt's ``qkv``) hide the heads from the structure, not from the config. The configs of the
    modules holding the decoder's blocks (:func:`decoder_blocks`) come first, outermost first: a multimodal model's
    text config, not its vision encoder's."""
    decoder = decoder_blocks(module)
    first = next((name for name, m in module.named_modules() if decoder and m is decoder[0]), "")
    parts = first.split(".") if first else []
    holders = [module.get_submodule(".".join(parts[:i])) for i in range(len(parts) + 1)]
    for submodule in (*holders, *module.modules()):
        stated = functools.partial(_stated, getattr(submodule, "config", None))
        layers, hidden = stated("num_hidden_layers", "n_layer"), stated("hidden_size", "n_embd")
        heads = stated("num_attention_heads", "n_head")
        if not (layers and hidden and heads):
            continue
        experts = stated("num_local_experts", "num_experts", "n_routed_experts", "n_expert", default=0)
        mlp_width = (stated("moe_intermediate_size") if experts else None) or stated(
            "intermediate_size", "n_inner", "ffn_dim") or _widest_projection(decoder, hidden)
        moe_blocks = [block for block in map(moe_block, decoder) if block is not None]
        shared = stated("shared_expert_intermediate_size", default=stated(
            "n_shared_experts", "n_shared_expert", default=0) * mlp_width) or shared_width(moe_blocks[:1], hidden)
        # the dense layers' width, where the config states one beside the experts' (Llama 4's, DeepSeek's)
        dense = stated("intermediate_size_mlp") or (stated("intermediate_size") if stated("moe_intermediate_size")
                                                    else None) or 0
        return ModelShape(
            blocks=layers, hidden=hidden, heads=heads, kv_heads=stated("num_key_value_heads", "n_query_groups",
                                                                       default=heads),
            head_dim=stated("head_dim", "head_size", default=hidden // heads), mlp_width=mlp_width,
            vocab=stated("padded_vocab_size", "vocab_size", default=0), experts=experts,
            top_k=stated("num_experts_per_tok", "n_expert_per_token", default=1) if experts else 1,
            moe_layers=(len(moe_blocks) or layers) if experts else 0,
            moe_positions=_moe_positions(decoder) if experts and len(decoder) == layers else (),
            tied_head=head_tied(module),
            gated_mlp=mlp_gated(decoder, hidden, mlp_width),
            shared_mlp_width=shared if experts else 0, dense_mlp_width=dense if experts else 0,
            encoder_params=encoder_parameters(module), first_stage_blocks=blocks_fed_between(module) + 1,
        )


def _moe_positions(blocks: Sequence[nn.Module]) -> tuple[int, ...]:
    """The indices of ``blocks`` that hold experts (:func:`moe_block`), where some hold none; else empty."""
    positions = tuple(index for index, block in enumerate(blocks) if moe_block(block) is not None)
    return positions if 0 < len(positions) < len(blocks) else ()


def moe_block(block: nn.Module) -> Optional[nn.Module]:
    """The module of ``block`` holding its experts (a model's own MoE block: the experts beside the router that
    scores them, a shared expert), or a ``meshlight.nn.MoE`` layer; None in a dense block."""
    for module in block.modules():
        if isinstance(module, MoE):
            return module
        if any(is_stacked_experts(c) or is_dense_experts(c) for c in module.children()) or any(
                "." not in name for name in listed_experts(module)):  # a list of experts among its own children
            return module
    return None


def shared_width(moe_blocks: Sequence[nn.Module], hidden: int) -> int:
    """The width of the MLPs the first of ``moe_blocks`` runs on every token beside its experts (a shared expert): the
    input width of each child MLP's projection back to the ``hidden`` size, summed; 0 for none."""
    total = 0
    for block in moe_blocks[:1]:
        for child in block.children():
            linears = [m for m in child.modules() if linear_widths(m)]
            if is_stacked_experts(child) or is_dense_experts(child) or isinstance(child, nn.ModuleList) or len(
                    linears) < 2:
                continue
            writers = [widths[0] for m in linears if (widths := linear_widths(m))[1] == hidden]
            total += writers[-1] if writers else 0
    return total


def mlp_gated(blocks: Sequence[nn.Module], hidden: int, width: int) -> Optional[bool]:
    """Whether the first of ``blocks`` reads the ``hidden`` state into the MLP's ``width`` by two projections (a
    gate and up: SwiGLU's three matrices), or by one fused gate|up twice as wide beside the projection back (Phi-3's
    ``gate_up_proj`` and ``down_proj``), or by one (GPT-2's two); None where none does (no blocks, experts stacked
    as parameters)."""
    parents = [m for block in blocks[:1] for m in block.modules()]
    if any({(hidden, 2 * width), (width, hidden)} <= {linear_widths(c) for c in m.children()} for m in parents):
        return True
    readers = [m for m in parents if linear_widths(m) == (hidden, width)]
    return len(readers) > 1 if readers else None


def head_tied(module: nn.Module) -> bool:
    """Whether a linear projection of ``module`` (its LM head) holds an Embedding's weight as its own: the parameter
    itself, as ``tie_word_embeddings`` and ``head.weight = embedding.weight`` leave it (a config's flag is not read:
    the structure is what trains)."""
    tables = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    return any(id(m.weight) in tables for m in module.modules() if isinstance(m, nn.Linear))


def _stated(config: object, *names: str, default: Optional[int] = None) -> Optional[int]:
    """The first of ``names`` that ``config`` holds as a whole number, else ``default``."""
    value = next((v for n in names if isinstance(v := stated_attribute(config, n), int)), None)
    return default if value is None else value


def stated_attribute(holder: object, name: str) -> object:
    """``holder.name``, None where it has none or will not say: transformers' configs of models whose layers differ
    (Gemma 4's) raise for a per-layer value such as ``head_dim`` read from the whole model's config — a count the
    layers' own modules then keep."""
    try:
        return getattr(holder, name, None)
    except RuntimeError:
        return None


def linear_widths(module: nn.Module) -> Optional[tuple[int, int]]:
    """(input, output) widths of a linear projection: an ``nn.Linear``, or Hugging Face's ``Conv1D`` (GPT-2's, its
    weight stored transposed, ``[in, out]``); None for any other module."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_transposed_linear(module):
        return tuple(module.weight.shape)
    return None


def is_transposed_linear(module: nn.Module) -> bool:
    """Whether ``module`` is Hugging Face's ``Conv1D``: a Linear whose weight is ``[in, out]`` (checked only once
    ``transformers`` is imported, which a model holding one has done)."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return conv1d is not None and isinstance(module, conv1d)


def hidden_size(blocks: Iterable[nn.Module]) -> Optional[int]:
    """The width the most Linears in ``blocks`` read, those of modules kept whole aside (a Mamba mixer's widen the
    state before its recurrence): the hidden state's; None when they hold no Linear."""
    widths = Counter(width[0] for block in blocks for m in _outside_kept_whole(block) if (width := linear_widths(m)))
    return widths.most_common(1)[0][0] if widths else None


def decoder_blocks(module: nn.Module) -> list[nn.Module]:
    """``module``'s repeated blocks (:func:`~meshlight.parallel.blocks.repeated_blocks`) that the token embedding
    feeds: where a model holds other blocks beside them — a multimodal model's vision or audio encoder, whose output
    joins the token embeddings before the decoder's first layer — those of the one container as wide as the token
    embedding and nearest it (Qwen2.5-VL's ``model.language_model.layers``, not ``model.visual.blocks``); all of them
    where no single container is (one container, or an encoder and a decoder alike, T5's). The token embedding: the
    Embedding outside the blocks with the vocabulary a Linear outside them (the LM head) produces, else the largest."""
    decoder = _decoder_container(module)
    return decoder[1] if decoder else repeated_blocks(module)


def decoder_container(module: nn.Module) -> Optional[str]:
    """The name of the container of the decoder's blocks (:func:`decoder_blocks`) where ``module`` holds more than one
    container of blocks and one of them is the decoder's; None otherwise."""
    decoder = _decoder_container(module)
    return decoder[0] if decoder else None


def blocks_fed_between(module: nn.Module) -> int:
    """How many of its first blocks ``module``'s decoder (a :data:`BETWEEN_BLOCKS` class) adds what its encoder
    computed after, as the model's config says (Qwen3-VL: one per deepstack layer of its vision encoder); every block
    of the decoder where no config says; 0 for other models."""
    decoder = next((m for m in module.modules() if class_path(m) in BETWEEN_BLOCKS), None)
    if decoder is None:
        return 0
    path = BETWEEN_BLOCKS[class_path(decoder)].split(".")
    for config in (m.config for m in module.modules() if hasattr(m, "config")):
        value = functools.reduce(lambda held, attribute: getattr(held, attribute, None), path, config)
        if value is not None:
            return len(value)
    return len(decoder_blocks(decoder))


def encoder_blocks(module: nn.Module) -> list[str]:
    """The containers of blocks beside the decoder's (:func:`decoder_blocks`), by name: a multimodal model's
    encoders."""
    decoder = _decoder_container(module)
    return [name for name, _ in _block_containers(module) if decoder and name != decoder[0]]


def encoder_parameters(module: nn.Module) -> int:
    """How many parameters ``module`` holds outside the module holding its decoder's blocks (Qwen2.5-VL's
    ``model.language_model``) and outside its LM head — a multimodal model's encoders and projector (0 for a model
    without :func:`encoder_blocks`); a parameter shared with the decoder (a tied head) is the decoder's."""
    decoder = _decoder_container(module)
    if decoder is None or not encoder_blocks(module):
        return 0
    holder = module.get_submodule(decoder[0].rpartition(".")[0])
    decoder_params = {id(p) for m in (holder, *lm_heads(module)) for p in m.parameters()}
    return sum(p.numel() for p in module.parameters() if id(p) not in decoder_params)


def lm_heads(module: nn.Module) -> list[nn.Module]:
    """A multimodal model's LM head: the Linears outside its encoders' subtrees (below the deepest module each shares
    with the decoder: Qwen2.5-VL's ``model.visual``) from the decoder's token embedding's width to its vocabulary;
    none for a model without :func:`encoder_blocks`."""
    decoder = _decoder_container(module)
    if decoder is None or not encoder_blocks(module):
        return []
    holder = module.get_submodule(decoder[0].rpartition(".")[0])
    token = max((m for m in holder.modules() if isinstance(m, nn.Embedding)), key=lambda m: m.num_embeddings,
                default=None)
    if token is None:
        return []
    path = decoder[0].split(".")
    roots = [".".join(name.split(".")[:len(os.path.commonprefix([name.split("."), path])) + 1])
             for name in encoder_blocks(module)]
    encoders = {id(m) for root in roots for m in module.get_submodule(root).modules()}
    return [m for m in module.modules() if isinstance(m, nn.Linear) and id(m) not in encoders
            and (m.in_features, m.out_features) == (token.embedding_dim, token.num_embeddings)]


def _decoder_container(module: nn.Module) -> Optional[tuple[str, list[nn.Module]]]:
    """(name, blocks) of the decoder's container (:func:`decoder_blocks`) where ``module`` holds more than one."""
    containers = list(_block_containers(module))
    if len(containers) < 2:
        return None
    inside = {id(m) for _, blocks in containers for block in blocks for m in block.modules()}
    outside = [(name, m) for name, m in module.named_modules() if id(m) not in inside]
    embeddings = [(name, m) for name, m in outside if isinstance(m, nn.Embedding)]
    produced = {m.out_features for _, m in outside if isinstance(m, nn.Linear)}
    token = next(((n, m) for n, m in embeddings if m.num_embeddings in produced), None) or max(
        embeddings, key=lambda entry: entry[1].num_embeddings, default=None)
    if token is None:
        return None
    name, embedding = token
    as_wide = [entry for entry in containers if hidden_size(entry[1]) == embedding.embedding_dim] or containers
    shared = [len(os.path.commonprefix([n.split("."), name.split(".")])) for n, _ in as_wide]
    nearest = [entry for entry, depth in zip(as_wide, shared) if depth == max(shared)]
    return nearest[0] if len(nearest) == 1 else None


def _block_containers(module: nn.Module, prefix: str = "") -> Iterable[tuple[str, list[nn.Module]]]:
    """(name, blocks) of each outermost container of blocks in ``module``, in the order
    :func:`~meshlight.parallel.blocks.repeated_blocks` finds them."""
    for name, child in module.named_children():
        full = f"{prefix}{name}"
        if holds_blocks(child):
            entries = child.values() if isinstance(child, nn.ModuleDict) else child
            yield full, [entry for entry in entries if next(entry.parameters(), None) is not None]
        else:
            yield from _block_containers(child, f"{full}.")


def _outside_kept_whole(module: nn.Module) -> Iterable[nn.Module]:
    yield module
    if class_path(module) not in KEPT_WHOLE:
        for child in module.children():
            yield from _outside_kept_whole(child)


def projections(module: nn.Module, hidden: int) -> tuple[list[str], Optional[str]]:
    """(readers, writer) among ``module``'s Linear children (:func:`linear_widths`), by name: the last that writes
    the ``hidden`` size back (an output projection), and those that read it (q, k, v; gate and up), the writer aside.
    No writer: a gate. An output gate (hidden → heads × head_dim, multiplied into the attention's output) writes the
    hidden size too where heads × head_dim is it, and AFMoE's and HRM's attention register theirs (``gate_proj``) after
    ``o_proj``: a Linear named a gate is the writer only where no other writes the hidden size."""
    linears = [(name, width) for name, m in module.named_children() if (width := linear_widths(m))]
    writers = [name for name, (_, out) in linears if out == hidden]
    writers = [name for name in writers if "gate" not in name] or writers
    writer = writers[-1] if writers else None
    return [name for name, (read, _) in linears if read == hidden and name != writer], writer


def count_holder(module: nn.Module) -> object:
    """Where an attention ``module`` keeps its head counts: itself, or — where it keeps neither counts nor a
    ``head_dim`` of its own — its ``config`` when that holds them (litgpt's attention reads ``self.config.n_head``).
    Tensor parallelism divides them there, in a copy of the config for that module alone."""
    config = getattr(module, "config", None)
    if head_counts(module, own=True) or head_dim_of(module, own=True) or config is None:
        return module
    counts, head_dim = list(head_counts(config, own=True).values()), head_dim_of(config, own=True)
    if not (counts and head_dim):
        return module
    heads, groups = counts[0], counts[-1]  # a config names heads first (Hugging Face's and litgpt's do)
    fused = {2 * groups * head_dim, (heads + 2 * groups) * head_dim}
    # only attention, which reads them through a fused projection of the hidden state: the config is the whole
    # model's (an MLP holds it too, and its output projection may be as wide as a fused k|v by chance)
    hidden = _stated(config, "hidden_size", "n_embd")
    held = any((width := linear_widths(m)) and width[1] in fused and (hidden is None or width[0] == hidden)
               for m in module.children())
    return config if held else module


def head_counts(module: object, *, own: bool = False) -> dict[str, int]:
    """The head counts ``module`` keeps under :data:`HEAD_COUNT_ATTRIBUTES`, by attribute (where it keeps them: see
    :func:`count_holder`; ``own``: in ``module`` itself)."""
    holder = module if own else count_holder(module)
    counts = {a: stated_attribute(holder, a) for a in HEAD_COUNT_ATTRIBUTES}
    return {a: v for a, v in counts.items() if isinstance(v, int) and not isinstance(v, bool)}


def head_dim_of(module: object, *, own: bool = False) -> Optional[int]:
    """The width of one head, where ``module`` keeps it under :data:`HEAD_DIM_ATTRIBUTES` (or its config does:
    :func:`count_holder`; ``own``: ``module`` itself)."""
    holder = module if own else count_holder(module)
    dims = (stated_attribute(holder, a) for a in HEAD_DIM_ATTRIBUTES)
    return next((d for d in dims if isinstance(d, int) and not isinstance(d, bool) and d > 0), None)


def fused_parts(owner: nn.Module, width: int, written: int, hidden: int, *, kv: bool = False
                ) -> Optional[tuple[int, ...]]:
    """The widths of the parts a fused projection of ``owner`` packs one after another in its ``width`` outputs,
    where ``owner``'s output projection reads ``written``: q|k|v (GPT-2's ``c_attn``, litgpt's ``qkv`` with its
    query groups), k|v beside a q (named so: ``kv``), or gate|up (two halves of what the output projection reads).
    None where the projection is not one of these (a plain q, or an MLP's up projection, whose width the output
    projection reads), or where the head counts do not explain what the output projection reads (counts already
    divided by tensor parallelism).
    ``hidden``: the model's hidden size; ``kv``: the projection is named as a fused k|v (as wide as q where there are
    half as many key/value heads)."""
    if width == written and not kv:
        return None
    heads = attention_heads(owner, hidden)
    head_dim = head_width(owner, heads, written)
    if heads and head_dim and heads[0] * head_dim == written:  # the counts explain what the output projection reads
        queries, keys = heads[0] * head_dim, heads[1] * head_dim
        if width == queries + 2 * keys:
            return queries, keys, keys
        if kv and width == 2 * keys:
            return keys, keys
    if heads and head_dim:  # attention whose counts explain neither: a q|k|v as wide as two halves is not a gate|up
        return None
    return (written, written) if width == 2 * written else None


def head_width(owner: nn.Module, heads: Optional[tuple[int, int]], written: Optional[int]) -> Optional[int]:
    """The width of one of attention ``owner``'s heads: its ``head_dim`` (:func:`head_dim_of`), else what its output
    projection reads (``written``) over its query ``heads`` (:func:`attention_heads`) where they divide it."""
    if head_dim := head_dim_of(owner):
        return head_dim
    return written // heads[0] if heads and written and written % heads[0] == 0 else None


def projection_heads(module: nn.Module, names: Sequence[str]) -> dict[str, int]:
    """Heads of each of ``module``'s Linear children ``names`` whose width is whole heads of its ``head_dim``: the
    width over ``head_dim``. Empty where ``module`` keeps no ``head_dim``."""
    head_dim = head_dim_of(module)
    if not head_dim:
        return {}
    widths = {name: linear_widths(module.get_submodule(name)) for name in names}
    return {name: width[1] // head_dim for name, width in widths.items() if width and width[1] % head_dim == 0}


def per_head_parameters(module: nn.Module, hidden: int) -> list[str]:
    """Names of an attention ``module``'s own 1-D parameters holding one value per query head (GPT-OSS's attention
    sinks): tensor parallelism splits them with the heads. Where an attention has as many heads as each is wide,
    only those named as sinks: DiffLlama's λ vectors are as wide as a head (and with 8 heads of 8, as many)."""
    heads = attention_heads(module, hidden)
    if not heads:
        return []
    ambiguous = heads[0] == head_dim_of(module)
    return [name for name, param in module.named_parameters(recurse=False)
            if param.dim() == 1 and param.shape[0] == heads[0] and (not ambiguous or "sink" in name)]


def attention_heads(module: nn.Module, hidden: int) -> Optional[tuple[int, int]]:
    """(heads, kv heads) of an attention ``module``: from its head-count attributes (kv heads: a name with ``kv`` or
    ``key_value``; none: as many as heads; where it keeps only its kv heads, its query heads from its ``config``, as
    Phi-3's attention does), else from ``head_dim`` and the widths of its first two projections out of the
    ``hidden`` state (q, then k). None where it names neither."""
    counts = head_counts(module)
    kv_named = {a: v for a, v in counts.items() if "kv" in a or "key_value" in a or "groups" in a}
    config = getattr(module, "config", None)
    if counts and len(kv_named) == len(counts) and config is not None:  # its query heads counted in its config only
        counts = {**{a: v for a, v in head_counts(config, own=True).items() if a not in kv_named}, **counts}
    derived = list(projection_heads(module, projections(module, hidden)[0]).values())
    heads = next((v for a, v in counts.items() if a not in kv_named), derived[0] if derived else None)
    if not heads:
        return None
    kv_heads = next(iter(kv_named.values()), derived[1] if len(derived) > 1 else heads)
    return heads, kv_heads
