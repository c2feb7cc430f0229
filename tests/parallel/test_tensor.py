"""Tensor-parallel plans: derived from structure, resolved from patterns, validated against tp — all before
any process group exists (the sharding itself is tested on processes in tests/strategies)."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import meshlight as ml
from meshlight.models import GPT, GPTConfig
from meshlight.parallel import tensor_plan
from meshlight.parallel.tensor import _divide_counts, _narrow_head_biases
from meshlight.parallel.tensor_plan import (
    TensorParallelError,
    block_held_groups,
    derive_plan,
    fused_projection,
    resolve_plan,
    sequence_region,
    validate_plan,
)
from meshlight.parallel.tensor_styles import rows_of_rank
from tests.strategies.hf_models import lit_causal_lm
from tests.strategies.llama import DICT_PLAN, LitLlama


def test_automatic_plan_for_gpt_splits_attention_and_mlp_pairs():
    plan = derive_plan(GPT(GPTConfig.tiny(n_layers=1)))
    assert {name: role for name, role in plan.items() if name.startswith("blocks.0.attn.")} == {
        "blocks.0.attn.wq": "colwise", "blocks.0.attn.wk": "colwise", "blocks.0.attn.wv": "colwise",
        "blocks.0.attn.wo": "rowwise",
    }
    assert (plan["blocks.0.mlp.w1"], plan["blocks.0.mlp.w2"]) == ("colwise", "rowwise")
    assert (plan["embed.tokens"], plan["embed.positions"], plan["head"]) == ("embedding", "replicate", "head")
    assert plan["blocks.0.attn_norm"] == plan["blocks.0.mlp_norm"] == plan["norm"] == "norm"


def test_automatic_plan_for_a_llama_shaped_model_uses_registration_and_shapes_not_names():
    plan = derive_plan(LitLlama())
    block = {n.removeprefix("model.layers.0."): r for n, r in plan.items() if n.startswith("model.layers.0.")}
    assert block == {
        "attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise", "attention.wo": "rowwise",
        "feed_forward.w1": "colwise", "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise",
        "attention_norm": "norm", "ffn_norm": "norm",
    }
    assert (plan["model.tok_embeddings"], plan["model.output"], plan["model.norm"]) == ("embedding", "head", "norm")


def test_dict_plan_matches_inside_the_lightning_module_and_equals_the_automatic_plan():
    module = LitLlama()
    assert resolve_plan(module, DICT_PLAN) == derive_plan(module)
    # a plan resolved once resolves to itself (the strategy plans the whole model, then hands names on), even where
    # a name holds fnmatch's special characters
    model = _model()
    model.blocks = nn.ModuleDict({"h[0]": model.blocks[0], "h[1]": model.blocks[1]})
    plan = derive_plan(model)
    assert plan["blocks.h[0].attn.q"] == "colwise" and resolve_plan(model, plan) == plan


def test_a_pattern_that_matches_nothing_lists_close_module_names():
    with pytest.raises(TensorParallelError, match=r"matches no module\. Close module names: .*attention\.wq"):
        resolve_plan(LitLlama(), {"layers.*.attn.wq": "colwise"})


def test_unknown_style_names_are_rejected():
    with pytest.raises(TensorParallelError, match="Unknown tensor-parallel style 'columnwise'"):
        resolve_plan(LitLlama(), {"layers.*.attention.wq": "columnwise"})


@pytest.mark.parametrize(
    ("config", "tp", "world", "message"),
    [
        (GPTConfig.tiny(dim=48, n_heads=3), 2, 4, r"tp=2 does not divide .*=3; choose tp in \[1\]"),
        # 3 key/value heads: tp=2 neither divides them nor is a multiple of them; tp=6 (one on each pair of ranks) is
        (GPTConfig.tiny(dim=48, n_heads=6, n_kv_heads=3), 2, 6,
         r"tp=2 does not divide heads of blocks.0.attn.wk=3; choose tp in \[1, 3, 6\]"),
    ],
)
def test_a_tp_that_does_not_divide_the_model_names_the_valid_values(config, tp, world, message):
    model = GPT(config)
    with pytest.raises(TensorParallelError, match=message):
        validate_plan(model, derive_plan(model), tp, world)


def test_the_refusal_names_modules_as_the_users_model_has_them_not_under_the_strategys_wrapper():
    # the strategy plans its root wrapper, whose child is the user's module: "module." is not the user's name
    wrapper = nn.Module()
    wrapper.module = GPT(GPTConfig.tiny(dim=48, n_heads=6, n_kv_heads=3))
    with pytest.raises(TensorParallelError, match=r"tp=2 does not divide heads of blocks\.0\.attn\.wk=3; choose"):
        validate_plan(wrapper, derive_plan(wrapper), 2, 6)


def test_any_vocabulary_splits_under_any_tp():
    # GPT-2's 50,257 and BERT's 30,522 at tp=4 are real cases: the embedding and the head are split unevenly
    # (DTensor's shards of 62 and 63 rows here), which trains as one process does (tests/strategies/test_hybrid.py)
    model = GPT(GPTConfig.tiny(vocab_size=250))
    validate_plan(model, derive_plan(model), 4, 4)


def test_head_count_attributes_are_constraints():
    module = LitLlama()  # 8 query heads, 4 key/value heads
    validate_plan(module, derive_plan(module), 4, 4)
    validate_plan(module, derive_plan(module), 8, 8)  # each key/value head on 2 ranks
    with pytest.raises(TensorParallelError, match=r"n_heads=8; choose tp in \[1, 2, 4, 8\]"):
        validate_plan(module, derive_plan(module), 16, 16)


@pytest.mark.parametrize(("parts", "kv", "tp", "rows"), [
    # q|k|v of 4 query heads and 1 key/value head of 8: each rank its 2 query heads and the key/value head
    ((32, 8, 8), (1, 8), 2, [[*range(0, 16), *range(32, 48)], [*range(16, 32), *range(32, 48)]]),
    # 4 query heads, 2 key/value heads over 4 ranks: ranks 0 and 1 read key/value head 0, ranks 2 and 3 head 1
    ((32, 16, 16), (2, 8), 4, [[*range(0, 8), *range(32, 40), *range(48, 56)],
                               [*range(8, 16), *range(32, 40), *range(48, 56)],
                               [*range(16, 24), *range(40, 48), *range(56, 64)],
                               [*range(24, 32), *range(40, 48), *range(56, 64)]]),
    ((8,), (1, 8), 2, [[*range(8)], [*range(8)]]),  # a plain k projection of one head
    ((32, 16, 16), None, 2, [[*range(0, 16), *range(32, 40), *range(48, 56)],
                             [*range(16, 32), *range(40, 48), *range(56, 64)]]),  # tp divides every part
])
def test_each_rank_computes_its_query_heads_and_the_key_value_heads_they_read(parts, kv, tp, rows):
    assert [rows_of_rank(parts, kv, tp, rank).tolist() for rank in range(tp)] == rows


def test_fewer_key_value_heads_than_ranks_leave_one_on_each_rank_and_fewer_queries_reading_it():
    attention = nn.Module()
    attention.num_heads, attention.num_key_value_heads, attention.num_key_value_groups = 8, 2, 4
    attention.config = type("Config", (), {"num_attention_heads": 8, "num_key_value_heads": 2})()
    _divide_counts(attention, 4)
    assert (attention.num_heads, attention.num_key_value_heads, attention.num_key_value_groups) == (2, 1, 2)
    assert (attention.config.num_attention_heads, attention.config.num_key_value_heads) == (2, 1)


def test_a_projection_packing_heads_q_k_and_v_together_keeps_tp_to_divisors_of_its_key_value_heads():
    # Falcon's grouped q|k|v (each key/value group's queries, key and value together), split by plain column sharding
    # into whole groups: with one group, tp=2 would cut it in half
    attention = _attention(query_key_value=nn.Linear(32, 48), dense=nn.Linear(32, 32))
    attention.config = type("Config", (), {"num_attention_heads": 4, "num_kv_heads": 1, "head_dim": 8})()
    block = nn.Module()
    block.attn = attention
    model = _fused_model(block)
    plan = resolve_plan(model, {"h.*.attn.query_key_value": "colwise", "h.*.attn.dense": "rowwise"})
    with pytest.raises(TensorParallelError, match=r"tp=2 does not divide h.0.attn.num_kv_heads=1; choose tp in \[1\]"):
        validate_plan(model, plan, 2, 2)


@pytest.mark.parametrize(("family", "projection", "role"), [
    ("falcon", "transformer.h.0.self_attention.query_key_value", "fused_colwise"),  # multi-query: all q, one k, one v
    ("falcon_grouped", "transformer.h.0.self_attention.query_key_value", "colwise"),  # each group's q, k, v together
    ("gpt_bigcode", "transformer.h.0.attn.c_attn", "fused_colwise"),  # StarCoder's multi-query q|k|v
    ("persimmon", "model.layers.0.self_attn.query_key_value", "colwise"),  # each head's q, k, v together
    ("openai_gpt", "transformer.h.0.attn.c_attn", "fused_colwise"),  # q|k|v one after another
])
def test_fused_q_k_v_of_known_classes_are_split_as_their_class_and_config_pack_them(family, projection, role):
    module = lit_causal_lm(family)
    plan = derive_plan(module)
    assert plan[f"model.{projection}"] == role
    validate_plan(module, plan, 2, 2)


@pytest.mark.parametrize(("family", "projection", "role"), [
    ("bloom", "transformer.h.0.self_attention.query_key_value", "colwise"),  # each head's q, k, v together
    ("mpt", "transformer.blocks.0.attn.Wqkv", "fused_colwise"),  # q|k|v one after another
    ("falcon_rw", "transformer.h.0.self_attention.query_key_value", "colwise"),
])
def test_alibi_models_are_planned_for_tensor_parallelism_their_biases_handed_out_by_head(family, projection, role):
    module = lit_causal_lm(family)
    plan = derive_plan(module)
    assert plan[f"model.{projection}"] == role
    validate_plan(module, plan, 2, 2)


def test_alibi_biases_that_meshlight_cannot_hand_out_by_head_are_refused(monkeypatch):
    # a class whose argument bringing them is unknown: each rank would get the biases of heads it does not hold
    monkeypatch.delitem(tensor_plan.HEAD_BIASES, "transformers.models.falcon.modeling_falcon.FalconAttention")
    module = lit_causal_lm("falcon_rw")
    with pytest.raises(TensorParallelError, match=r"model.transformer.h.0.self_attention \(FalconAttention\) adds ALiBi"
                                                  r" position biases, .* BloomAttention, MptAttention\): .* or with"
                                                  r" rotary positions \(the config's alibi=False\)"):
        validate_plan(module, derive_plan(module), 2, 2)


class _Mesh:
    """What :func:`_narrow_head_biases` reads of a tensor-parallel mesh."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


def test_each_rank_is_handed_the_biases_of_its_heads_however_the_model_passes_them():
    class Attention(nn.Module):
        def forward(self, hidden, alibi=None, attention_mask=None, position_bias=None):
            return alibi, attention_mask, position_bias

    batch, heads, keys = 2, 4, 3
    # value = 10·batch + head, along the keys
    by_head = (10 * torch.arange(batch)[:, None] + torch.arange(heads)).float()[..., None, None].expand(-1, -1, 1, keys)
    attention = Attention()
    _narrow_head_biases(attention, {"alibi": None, "attention_mask": 1, "position_bias": 0}, heads, _Mesh(2, 1))
    hidden = torch.zeros(batch, 5, 8)
    # BLOOM's [batch·heads, 1, keys] by keyword, Falcon's mask [batch, heads, queries, keys] positionally, MPT's
    # [heads, 1, keys]: rank 1 of 2 holds heads 2 and 3
    alibi, mask, position = attention(hidden, attention_mask=by_head.expand(-1, -1, 5, -1),
                                      alibi=by_head.flatten(0, 1), position_bias=by_head[0])
    assert alibi[:, 0, 0].tolist() == [2, 3, 12, 13]
    assert mask.shape == (batch, 2, 5, keys) and mask[:, :, 0, 0].tolist() == [[2, 3], [12, 13]]
    assert position[:, 0, 0].tolist() == [2, 3]
    _, mask, _ = attention(hidden, None, torch.zeros(batch, 1, 5, keys))  # a mask broadcast over the heads: whole
    assert mask.shape == (batch, 1, 5, keys)
    with pytest.raises(TensorParallelError, match="received biases of 6 rows, not a multiple of its 4 heads"):
        attention(hidden, torch.zeros(6, 1, keys))


def test_a_norm_one_head_wide_beside_one_key_value_head_normalizes_each_head():
    # Qwen3's k_norm beside a k projection of one head: as wide as that projection, still a norm over each head; a
    # norm over two key/value heads at once (OLMo 2's) cannot run where tp=4 holds one of them on each rank
    def model(kv_heads: int, norm_width: int) -> nn.Module:
        attention = _attention(q=nn.Linear(32, 32), k=nn.Linear(32, 8 * kv_heads), v=nn.Linear(32, 8 * kv_heads),
                               o=nn.Linear(32, 32))
        attention.num_heads, attention.num_kv_heads, attention.head_dim = 4, kv_heads, 8
        attention.k_norm = nn.RMSNorm(norm_width)
        block = nn.Module()
        block.attn = attention
        return _fused_model(block)

    assert derive_plan(model(1, 8))["h.0.attn.k_norm"] == "head_norm"
    plan = derive_plan(wide := model(2, 16))
    assert plan["h.0.attn.k_norm"] == "colwise_norm"
    validate_plan(wide, plan, 2, 2)
    with pytest.raises(TensorParallelError, match=r"tp=4 exceeds the 2 key/value heads of h.0.attn, .* but"
                                                  r" h.0.attn.k_norm normalizes over all of them at once: choose a tp"
                                                  r" that divides 2"):
        validate_plan(wide, plan, 4, 4)


def _fused_model(attention: nn.Module) -> nn.Module:
    model = nn.Module()
    model.h = nn.ModuleList([attention])
    return model


def _attention(**projections: nn.Linear) -> nn.Module:
    attention = nn.Module()
    for name, projection in projections.items():
        attention.add_module(name, projection)
    return attention


def test_fused_projections_given_the_fused_role_are_split_part_by_part_as_the_head_counts_tell():
    # q|k|v with a head count, q|k|v with grouped queries counted in a config (as litgpt's attention reads them), a
    # fused k|v beside q, and gate|up (two halves of what the output projection reads)
    gpt2 = _attention(c_attn=nn.Linear(32, 96), c_proj=nn.Linear(32, 32))
    gpt2.num_heads = 4
    litgpt = _attention(qkv=nn.Linear(32, 64), proj=nn.Linear(32, 32))
    litgpt.config = type("Config", (), {"n_head": 4, "n_query_groups": 2, "head_size": 8})()
    kv = _attention(q=nn.Linear(32, 32), kv=nn.Linear(32, 32), o=nn.Linear(32, 32))
    kv.n_heads, kv.n_kv_heads, kv.head_dim = 4, 2, 8
    mlp = _attention(gate_up=nn.Linear(32, 128), down=nn.Linear(64, 32))
    for attention, fused, out, parts in ((gpt2, "c_attn", "c_proj", (32, 32, 32)),
                                         (litgpt, "qkv", "proj", (32, 16, 16)),
                                         (kv, "kv", "o", (16, 16)), (mlp, "gate_up", "down", (64, 64))):
        model = _fused_model(attention)
        # whether the parts sit one after another or head by head, structure cannot tell: refused, naming both roles
        with pytest.raises(TensorParallelError, match=rf"h.0.{fused}\) .* its parts are known from the head counts, but"
                                                      r" not whether .* 'fused_colwise' for the first or 'colwise'"):
            derive_plan(model)
        plan = resolve_plan(model, {f"h.*.{fused}": "fused_colwise", f"h.*.{out}": "rowwise"})
        assert fused_projection(dict(model.named_modules()), plan, f"h.0.{fused}") == parts
    # each part is split by tp, head-aligned (2 key/value groups: at tp=4 each on 2 ranks); 4 query heads leave tp=8
    # out, named where the config keeps them
    model = _fused_model(litgpt)
    plan = resolve_plan(model, {"h.*.qkv": "fused_colwise", "h.*.proj": "rowwise"})
    validate_plan(model, plan, 2, 2)
    validate_plan(model, plan, 4, 4)
    with pytest.raises(TensorParallelError, match=r"tp=8 does not divide h.0.n_head=4"):
        validate_plan(model, plan, 8, 8)
    # the role on a projection whose parts no head count explains
    model = _fused_model(_attention(c_attn=nn.Linear(32, 96), c_proj=nn.Linear(32, 32)))
    plan = resolve_plan(model, {"h.*.c_attn": "fused_colwise", "h.*.c_proj": "rowwise"})
    with pytest.raises(TensorParallelError, match=r"h.0.c_attn has the tensor-parallel role 'fused_colwise', but its"
                                                  r" parts cannot be told"):
        validate_plan(model, plan, 2, 2)


def test_hugging_face_conv1d_and_litgpt_fused_projections_are_planned():
    pytest.importorskip("transformers")
    pytest.importorskip("litgpt")
    from tests.strategies.hf_models import DIM, HEADS, KV_HEADS, LAYERS, lit_causal_lm

    head_dim = DIM // HEADS
    for family, attention, fused, parts in (
            ("gpt2", "model.transformer.h.0.attn", "c_attn", (DIM, DIM, DIM)),
            ("litgpt", "model.transformer.h.0.attn", "qkv", (DIM, KV_HEADS * head_dim, KV_HEADS * head_dim))):
        model = lit_causal_lm(family)
        plan = derive_plan(model)
        validate_plan(model, plan, 2, 2)
        assert fused_projection(dict(model.named_modules()), plan, f"{attention}.{fused}") == parts
        assert plan[f"{attention}.{'c_proj' if family == 'gpt2' else 'proj'}"] == "rowwise"
    # GPT-NeoX's fused q|k|v holds each head's q, k, v together: its published plan says plain colwise
    model = lit_causal_lm("gpt_neox")
    assert derive_plan(model)["model.gpt_neox.layers.0.attention.query_key_value"] == "colwise"
    # GPT-2's MLP is Conv1D too; its root forward counts positions from inputs_embeds: sequence parallelism covers
    # the blocks only
    model = lit_causal_lm("gpt2")
    plan = derive_plan(model)
    assert (plan["model.transformer.h.0.mlp.c_fc"], plan["model.transformer.h.0.mlp.c_proj"]) == ("colwise", "rowwise")
    assert sequence_region(model, plan) == ("model.transformer.h.0", f"model.transformer.h.{LAYERS - 1}")


def test_blocks_in_two_modules_that_the_forward_hands_the_state_between_refuse_sequence_parallelism():
    """HRM's (Hierarchical Reasoning Model) blocks live in two stacks its forward runs in cycles, adding the two
    stacks' states: sequence parallelism over the blocks (cut where the first begins, gathered where the last ends)
    would hand a share of the sequence where the whole is added to it (a shape error). It is refused before training,
    naming the two modules and sequence_parallel=False; without it the model trains at tp=2 within 2.7e-5 of one
    process (a probe, not in the suite)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "HrmTextConfig"):
        pytest.skip("this transformers has no HRM")
    config = transformers.HrmTextConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                        head_dim=8, num_layers_per_stack=2, H_cycles=2, L_cycles=2,
                                        max_position_embeddings=32)
    model = transformers.AutoModelForCausalLM.from_config(config)
    plan = derive_plan(model)
    with pytest.raises(TensorParallelError, match=r"model\.H_module, model\.L_module.*sequence_parallel=False"):
        sequence_region(model, plan)


def test_a_model_without_repeated_blocks_asks_for_a_plan():
    with pytest.raises(TensorParallelError, match="no repeated blocks"):
        derive_plan(nn.Sequential(nn.Linear(4, 4)))


def test_tp_larger_than_the_world_fails_when_the_trainer_is_built():
    with pytest.raises(ValueError, match=r"tp=8 does not divide the 4 processes .* choose pp·tp in \[1, 2, 4\]"):
        ml.Trainer(strategy=ml.TensorParallelStrategy(tp=8), devices=4, accelerator="cpu")


def test_tp_name_takes_the_processes_of_a_node():
    strategy = ml.Trainer(strategy="tp", devices=4, num_nodes=1, accelerator="cpu", logger=False).strategy
    assert (strategy.layout.tp, strategy.layout.dp) == (4, 1)
    assert torch.distributed.is_available()


class _Attention(nn.Module):
    """q, k, v and an output projection, keeping its head count under ``attribute``."""

    def __init__(self, attribute="n_heads", dim=32, heads=4):
        super().__init__()
        setattr(self, attribute, heads)
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))


class _MLP(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)


class _Block(nn.Module):
    def __init__(self, attention=_Attention, mlp_inline=False, dim=32):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = attention()
        if mlp_inline:  # fc1, fc2 on the block itself
            self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        else:
            self.mlp = _MLP(dim)


def _model(**block):
    model = nn.Module()
    model.tok = nn.Embedding(64, 32)
    model.blocks = nn.ModuleList(_Block(**block) for _ in range(2))
    model.head = nn.Linear(32, 64, bias=False)
    return model


def test_an_attention_whose_head_count_meshlight_cannot_scale_is_refused():
    # each rank holds 2 of 4 heads of q, k, v: a reshape by nh=4 would silently train 4 heads half as wide
    model = _model(attention=lambda: _Attention("nh"))
    with pytest.raises(TensorParallelError, match=r"blocks.0.attn looks like attention \(3 column-parallel"
                                                  r" projections\) but keeps no head count .* \(it has nh=4\)\..*"
                                                  r" Name the count n_heads .* or store head_dim"):
        validate_plan(model, derive_plan(model), 2, 2)
    model = _model(attention=lambda: _Attention("heads"))  # a name meshlight scales: divided by tp, and a constraint
    validate_plan(model, derive_plan(model), 2, 2)
    with pytest.raises(TensorParallelError, match=r"tp=8 does not divide blocks.0.attn.heads=4"):
        validate_plan(model, derive_plan(model), 8, 8)


def test_a_column_row_group_must_have_a_module_of_its_own():
    # an MLP on the block itself beside its norms (OPT's, XGLM's): its first Linear gathers its own input
    model = _model(mlp_inline=True)
    plan = derive_plan(model)
    assert block_held_groups(model, plan) == {"blocks.0", "blocks.1"}
    validate_plan(model, plan, 2, 2)
    # beside another Linear it is not: that one would run on the share, or on the gathered input, unknown which
    for block in model.blocks:
        block.gate = nn.Linear(32, 32)
    with pytest.raises(TensorParallelError, match=r"blocks.0 \(a repeated block\) holds the tensor-parallel group"
                                                  r" blocks.0.fc1, blocks.0.fc2, and also blocks.0.ln1, blocks.0.ln2,"
                                                  r" blocks.0.gate\. .* but not beside other Linears\): move fc1, fc2"
                                                  r" into a submodule of their own"):
        validate_plan(model, {**plan, "blocks.0.gate": "replicate", "blocks.1.gate": "replicate"}, 2, 2)
    # a block that is the group alone (norm and residual outside it) is fine, and so is a style given as an object
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(2))
    validate_plan(model, derive_plan(model), 2, 2)
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    llama = LitLlama()
    plan = resolve_plan(llama, {**DICT_PLAN, "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1))})
    validate_plan(llama, plan, 2, 2)
    # a plan of its own on a Sequential: the Sequential also runs net.0
    net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    wrapper = nn.Module()
    wrapper.net = net
    plan = resolve_plan(wrapper, {"net.2": "colwise", "net.4": "rowwise"})
    with pytest.raises(TensorParallelError, match=r"net \(a module\) holds the tensor-parallel group net.2, net.4, and"
                                                  r" also net.0\."):
        validate_plan(wrapper, plan, 2, 2)
    with pytest.raises(TensorParallelError, match=r"'fc1' matches no module\. Modules that hold parameters: net.0,"
                                                  r" net.2, net.4\."):
        resolve_plan(wrapper, {"fc1": "colwise"})


def test_moe_layers_are_left_to_their_own_refusal():
    from meshlight.nn import MoEConfig

    derive_plan(GPT(GPTConfig.tiny(moe=MoEConfig(num_experts=4))))  # under tp, refused as MoE (parallelize.py)


def test_nn_multihead_attention_is_refused_with_or_without_sequence_parallelism():
    class MHA(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(32, 4, batch_first=True, bias=False)

    model = _model(attention=MHA)
    for sequence_parallel in (True, False):  # either way, the attention would not be split at all
        with pytest.raises(TensorParallelError, match=r"blocks.0.attn.mha \(MultiheadAttention\) holds parameters the"
                                                      r" automatic tensor-parallel plan cannot split: in_proj_weight"
                                                      r" \[96, 32\] \(nn.MultiheadAttention packs q, k and v"):
            validate_plan(model, derive_plan(model), 2, 2, sequence_parallel=sequence_parallel)


def test_a_layer_scale_in_a_block_is_refused_under_sequence_parallelism_only():
    model = _model()
    for block in model.blocks:
        block.scale = nn.Parameter(torch.ones(32))  # x + scale * mlp(x): each rank would train it on its share
    plan = derive_plan(model)
    with pytest.raises(TensorParallelError, match=r"blocks.0 \(_Block\) holds parameters the automatic tensor-parallel"
                                                  r" plan cannot split: scale \[32\]: under sequence parallelism each"
                                                  r" rank would train them on its share of the sequence alone\..*"
                                                  r" keep other parameters in a norm or a Linear \(or pass"
                                                  r" sequence_parallel=False\)\."):
        validate_plan(model, plan, 2, 2)
    validate_plan(model, plan, 2, 2, sequence_parallel=False)  # whole activations on every rank: same gradients


def test_a_linear_no_column_row_group_holds_is_replicated():
    model = _model()
    for block in model.blocks:
        block.gate = nn.Linear(32, 1)  # x + sigmoid(gate(x)) * mlp(ln2(x))
    plan = derive_plan(model)
    assert plan["blocks.0.gate"] == plan["blocks.1.gate"] == "replicate"
    assert (plan["blocks.0.attn.q"], plan["blocks.0.mlp.fc2"]) == ("colwise", "rowwise")
    validate_plan(model, plan, 2, 2)
    gated = LitLlama(gated=True)
    assert derive_plan(gated)["model.layers.0.gate"] == resolve_plan(gated, DICT_PLAN)["model.layers.0.gate"] \
        == "replicate"
    # a style given to a parent covers its children
    from torch.distributed.tensor.parallel import PrepareModuleInput

    for block in model.blocks:
        block.gating = nn.Sequential(nn.Linear(32, 1), nn.Sigmoid())
    assert derive_plan(model)["blocks.0.gating.0"] == "replicate"
    styled = resolve_plan(model, {"blocks.*.gating": PrepareModuleInput()})
    assert isinstance(styled["blocks.0.gating"], PrepareModuleInput) and "blocks.0.gating.0" not in styled
    # a role names one module: its Linears get "replicate" of their own (a container takes no style)
    assert resolve_plan(model, {"blocks.*.gating": "replicate"})["blocks.0.gating.0"] == "replicate"


def test_sequence_parallelism_covers_the_blocks_only_when_modules_outside_them_have_no_role():
    # Megatron-LM's region, from the token embedding's output to the LM head's input, when nothing else is outside
    for model in (GPT(GPTConfig.tiny(n_layers=2)), GPT(GPTConfig.tiny(n_layers=2, tie_embeddings=True)), LitLlama()):
        assert sequence_region(model, derive_plan(model)) is None
    # a factorized embedding (16 wide, then projected) and a transform before the head: the blocks only
    outside = LitLlama(outside=True)
    plan = derive_plan(outside)
    assert (plan["model.tok_embeddings"], plan["model.output"], plan["model.transform.2"]) == ("embedding", "head",
                                                                                                "norm")
    assert "model.project" not in plan and "model.transform.0" not in plan
    assert sequence_region(outside, plan) == ("model.layers.0", "model.layers.1")
    assert sequence_region(outside, resolve_plan(outside, DICT_PLAN)) == ("model.layers.0", "model.layers.1")
    # so do a value head, a learned token beside the embedding, and a model without an LM head
    for extra in ("value", "token", "no head"):
        model = _model()
        if extra == "value":
            model.value = nn.Linear(32, 1)
        elif extra == "token":
            model.register_parameter("cls", nn.Parameter(torch.zeros(1, 1, 32)))
        else:
            model.head = nn.Linear(32, 10)
        assert sequence_region(model, derive_plan(model)) == ("blocks.0", "blocks.1"), extra
    # a style the user gives a module outside the blocks keeps their layouts
    from torch.distributed.tensor.parallel import ColwiseParallel

    model = _model()
    model.value = nn.Linear(32, 1)
    assert sequence_region(model, resolve_plan(model, {"value": ColwiseParallel()})) is None
    model.adapter = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 32))
    # a role names one module: "replicate" on the container leaves its Linears without one
    assert sequence_region(model, resolve_plan(model, {"adapter": "replicate"})) == ("blocks.0", "blocks.1")
    # a column→row group the user places outside the blocks splits shares of the sequence: Megatron-LM's region
    group = {"adapter.0": "colwise", "adapter.2": "rowwise", "value": ColwiseParallel()}
    assert sequence_region(model, resolve_plan(model, group)) is None
    model.adapter = nn.Linear(32, 32)  # which no region suits: refused
    with pytest.raises(TensorParallelError, match=r"splits value outside the blocks \(a style, or a colwise/rowwise"
                                                  r" role\) and gives no role to adapter.weight, adapter.bias"):
        sequence_region(model, resolve_plan(model, {"value": ColwiseParallel()}))


def test_a_group_a_user_plan_leaves_out_is_refused_under_sequence_parallelism():
    # run on each rank's share of the sequence, attention would attend over that share alone
    model = _model()
    plan = resolve_plan(model, {"blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise"})
    assert not any(name.startswith("blocks.0.attn.") for name in plan)
    with pytest.raises(TensorParallelError, match=r"blocks.0.attn.q reads or writes the hidden state in a column→row"
                                                  r" group the tensor-parallel plan leaves out: .* Give the group roles"
                                                  r" \(colwise, rowwise\), give a Linear that works token by token"
                                                  r" 'replicate', or pass sequence_parallel=False\."):
        validate_plan(model, plan, 2, 2)
    validate_plan(model, plan, 2, 2, sequence_parallel=False)  # whole on every rank: the whole sequence


class _QKNormAttention(_Attention):
    def __init__(self, norm_width=8, own=0):
        super().__init__()
        self.head_dim = 8
        self.q_norm, self.k_norm = nn.RMSNorm(norm_width), nn.RMSNorm(norm_width)
        if own:  # a parameter of the attention's own: one value per head (4: attention sinks), or a temperature
            self.sinks = nn.Parameter(torch.zeros(own))


def test_a_norm_over_each_head_runs_on_the_ranks_heads_and_other_parameters_beside_a_group_are_refused():
    model = _model(attention=_QKNormAttention)  # QK-norm as Qwen3 has it: a norm as wide as one head
    plan = derive_plan(model)
    assert plan["blocks.0.attn.q_norm"] == plan["blocks.1.attn.k_norm"] == "head_norm"
    validate_plan(model, plan, 2, 2)
    # one value per head (GPT-OSS's attention sinks) is split with the heads (trained so in test_hf_models)
    model = _model(attention=lambda: _QKNormAttention(own=4))
    validate_plan(model, derive_plan(model), 2, 2)
    # a norm over all heads at once, as wide as q's output (OLMo 2's): split as that output is, its statistics
    # reduced over tp (trained so in test_hf_models)
    model = _model(attention=lambda: _QKNormAttention(norm_width=32))
    plan = derive_plan(model)
    assert plan["blocks.0.attn.q_norm"] == plan["blocks.1.attn.k_norm"] == "colwise_norm"
    validate_plan(model, plan, 2, 2)
    # from the colwise projections a user's plan names too
    roles = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
             "blocks.*.attn.proj": "rowwise"}
    resolved = resolve_plan(model, roles)
    assert resolved["blocks.0.attn.q_norm"] == resolved["blocks.1.attn.k_norm"] == "colwise_norm"
    # a norm as wide as no projection's output, a learned temperature: trained on the rank's heads alone, with or
    # without sequence parallelism
    for attention, listed in [(lambda: _QKNormAttention(norm_width=24), r"blocks.0.attn.q_norm.weight \[24\]"),
                              (lambda: _QKNormAttention(own=1), r"blocks.0.attn.sinks \[1\]")]:
        model = _model(attention=attention)
        for sequence_parallel in (True, False):
            with pytest.raises(TensorParallelError, match=r"blocks.0.attn holds the tensor-parallel group"
                                                          rf" blocks.0.attn.q, .* and also the parameters {listed}.*,"
                                                          r" which tensor parallelism does not split: .* Splitting"
                                                          r" them is not supported yet"):
                validate_plan(model, derive_plan(model), 2, 2, sequence_parallel=sequence_parallel)


def test_a_replicated_linear_runs_on_the_sequence_share_and_refuses_an_input_that_is_not_one(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from meshlight.parallel.tensor import apply_tensor_parallel

    model = nn.Module()
    model.gate, model.frozen = nn.Linear(32, 4), nn.Linear(32, 4)
    model.frozen.requires_grad_(False)
    apply_tensor_parallel(model, init_device_mesh("cpu", (1,)), {"gate": "replicate", "frozen": "replicate"})
    assert isinstance(model.gate.weight, DTensor) and model.gate.weight.placements == (Replicate(),)
    assert model.gate.weight.requires_grad and not model.frozen.weight.requires_grad  # a frozen Linear stays so
    share = torch.randn(2, 6, 32)
    out = model.gate(share)
    assert type(out) is torch.Tensor and torch.equal(out, share @ model.gate.weight.to_local().T
                                                     + model.gate.bias.to_local())
    with pytest.raises(TensorParallelError, match=r"gate \(Linear\) is left whole on every tensor-parallel rank, and"
                                                  r" it must read this rank's share of a sequence .* it was given a"
                                                  r" 2-D tensor \(2, 32\) \(a pooled or conditioning input\?\)\."
                                                  r" Give it a role in the plan"):
        model.gate(share.mean(1))  # pooled over the sequence: features, not a share of a sequence


def test_a_norm_after_the_embedding_modules_outside_the_blocks_and_post_norm_blocks_run_under_sequence_parallelism(
        one_process_group):
    # on a mesh of one rank the splits are no-ops, but the layouts are not: a DTensor met a plain tensor
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from meshlight.parallel.tensor import apply_tensor_parallel
    from tests.strategies.llama import RMSNorm
    from tests.strategies.nanogpt import NanoGPT

    embedding_norm = LitLlama()  # BLOOM's norm after the embedding: its output is a DTensor sharded over the sequence
    embedding_norm.model.tok_embeddings = nn.Sequential(embedding_norm.model.tok_embeddings, RMSNorm(64))
    # post-norm blocks (BERT's): a norm's output is the residual stream, which the MLP's output is added to
    for model in (embedding_norm.model, LitLlama(outside=True).model, NanoGPT(post_norm=True)):
        split, tokens = copy.deepcopy(model), torch.randint(0, 16, (2, 12))
        plan = derive_plan(split)
        apply_tensor_parallel(split, init_device_mesh("cpu", (1,)), plan, loss_parallel=False,
                              sequence_region=sequence_region(split, plan))
        torch.testing.assert_close(split(tokens), model(tokens))


def test_a_nanogpt_layout_finds_its_blocks_inside_the_modules_namespace_and_keeps_its_tie(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh

    from meshlight.parallel.blocks import repeated_blocks
    from meshlight.parallel.tensor import apply_tensor_parallel
    from tests.strategies.nanogpt import NanoGPT

    model = NanoGPT()  # transformer = ModuleDict(wte, wpe, h, ln_f): the blocks are h's, not the namespace's entries
    assert repeated_blocks(model) == list(model.transformer.h)
    plan = derive_plan(model)
    assert (plan["transformer.wte"], plan["lm_head"]) == ("embedding", "head")
    apply_tensor_parallel(model, init_device_mesh("cpu", (1,)), plan, sequence_region=sequence_region(model, plan))
    assert model.transformer.wte.weight is model.lm_head.weight  # one weight, sharded over the vocabulary for both


def test_a_tie_the_plan_would_shard_two_ways_is_refused_naming_both_places(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh

    from meshlight.parallel.tensor import apply_tensor_parallel
    from tests.strategies.nanogpt import NanoGPT

    model = NanoGPT()
    plan = {**derive_plan(model), "lm_head": "rowwise"}  # over its input features: the embedding's is the vocabulary
    with pytest.raises(TensorParallelError, match=r"would split one tied parameter differently where it is held:"
                                                  r" transformer.wte.weight \(DTensor \[Shard\(dim=0\)\]\),"
                                                  r" lm_head.weight \(DTensor \[Shard\(dim=1\)\]\)\. Give the"):
        apply_tensor_parallel(model, init_device_mesh("cpu", (1,)), plan, sequence_parallel=False)


def test_a_reshape_by_the_full_width_under_tensor_parallelism_gets_a_note_saying_how_to_reshape():
    from meshlight.parallel.tensor import explaining_tensor_parallel_errors

    q = torch.randn(2, 12, 16)  # this rank's half of a 32-wide q, nanoGPT reshaping by C = 32 and n_head = 4 / 2
    with pytest.raises(RuntimeError) as error, explaining_tensor_parallel_errors(2, loss_parallel=True):
        q.view(2, 12, 2, 32 // 2)
    assert error.value.__notes__ == [
        "meshlight: under tensor parallelism each rank holds 1/2 of the attention heads, and the strategy divides the"
        " head-count attributes (n_heads, num_heads, n_head, …) by tp. A reshape whose other sizes come from the full"
        " width no longer fits (nanoGPT's view(B, T, self.n_head, C // self.n_head) with C = x.size(-1)): reshape"
        " with the head size or -1, e.g. view(B, T, self.n_head, -1)."]
    with pytest.raises(RuntimeError) as error, explaining_tensor_parallel_errors(1, loss_parallel=True):
        q.view(2, 12, 2, 32 // 2)
    assert not hasattr(error.value, "__notes__")  # without tensor parallelism the error is the user's own


class _HeadsUnderAnotherName(nn.Module):
    """An attention that keeps its head count as ``nh``, a name tensor parallelism does not know, and reshapes by it:
    under tp=2 each rank's q is half as wide while ``nh`` stays whole (here: ``nh`` twice the real count, as a rank
    of tp=2 sees it)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.nh, self.hd = 2 * heads, dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, self.nh, self.hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))


def test_an_attention_whose_head_count_no_plan_divides_is_named_with_the_fix(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh

    from meshlight.parallel.tensor import apply_tensor_parallel, explaining_tensor_parallel_errors

    model = nn.Module()
    model.blocks = nn.ModuleList(nn.ModuleDict({"attn": _HeadsUnderAnotherName()}) for _ in range(2))
    plan = {f"blocks.{i}.attn.{w}": "colwise" for i in range(2) for w in ("wq", "wk", "wv")}
    plan.update({f"blocks.{i}.attn.wo": "rowwise" for i in range(2)})
    apply_tensor_parallel(model, init_device_mesh("cpu", (1,)), plan, sequence_parallel=False)
    with pytest.raises(RuntimeError) as error, explaining_tensor_parallel_errors(2, loss_parallel=False):
        model.blocks[0].attn(torch.randn(2, 6, 32))
    assert error.value.__notes__ == [
        "meshlight: under tensor parallelism each rank holds 1/2 of the attention heads, and the strategy divides the"
        " head-count attributes (n_heads, num_heads, n_head, …) by tp. blocks.0.attn has none of them, so it still"
        " reshapes by the whole model's head count: name that attribute n_heads (or num_heads, …), or reshape by -1;"
        " or give blocks.0.attn its own entry in the tensor-parallel plan (the strategy's plan=), or parallelize it"
        " yourself in configure_model()."]


def test_blocks_without_linear_layers_are_refused_naming_what_holds_their_weights():
    class Mixer(nn.Module):  # a weight of its own, multiplied by hand
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(32, 32))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mix, self.norm = Mixer(), nn.LayerNorm(32)

    model = nn.Module()
    model.h = nn.ModuleList(Block() for _ in range(2))
    message = (r"The repeated blocks \(h.0 …\) hold no linear layers \(nn.Linear, or Hugging Face's Conv1D\), which"
               r" tensor parallelism splits: their weights sit in Mixer \(h.0.mix\)\. Train this model with data or"
               r" pipeline parallelism \(tp=1\)")
    with pytest.raises(TensorParallelError, match=message):
        derive_plan(model)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gpt_neox", "mixtral", "qwen3_moe",
                                    "gpt_neox-lora"])
def test_the_automatic_plan_agrees_with_the_plan_a_hugging_face_model_publishes(family):
    """Where a model publishes its tensor-parallel plan (``base_model_tp_plan``), its column and row roles for the
    blocks' projections are the ones the structure gives; the published plan decides only what structure cannot
    tell (GPT-NeoX's fused q|k|v held head by head). Adapted by PEFT's LoRA (``-lora``), whose wrapper shows the
    model's config and base model as its own, the published names are where the model's modules truly are, as plans
    read it (its LoRA layers as their Linears)."""
    pytest.importorskip("transformers")
    from meshlight.parallel.adapters import adapters_unwrapped
    from meshlight.parallel.tensor_plan import published_roles
    from tests.strategies.hf_models import lit_causal_lm

    model = lit_causal_lm(family)
    with adapters_unwrapped(model):
        published = {name: style for name, style in published_roles(model).items() if style in ("colwise", "rowwise")}
        derived = derive_plan(model)
    assert len(published) >= 4 * 2  # each layer's attention at least (q|k|v, output)
    assert {name: derived.get(name) for name in published} == published


def test_lora_nested_on_the_experts_weights_reads_as_the_experts_and_is_put_back_as_it_was():
    """PEFT nests one LoRA layer per adapted parameter (Qwen3-MoE's experts: ``down_proj``'s around
    ``gate_up_proj``'s around the experts). Plans read the experts under the outermost layer's name; leaving the view
    puts back exactly the structure that was (before, the inner layer was swapped inside the swapped-in experts,
    which then held themselves: PEFT's get_base_layer looped for ever)."""
    pytest.importorskip("peft")
    from meshlight.parallel.adapters import adapters_unwrapped
    from meshlight.parallel.expert import is_stacked_experts
    from tests.strategies.hf_models import lit_causal_lm

    model = lit_causal_lm("qwen3_moe-lora")
    before = [(name, id(module)) for name, module in model.named_modules()]
    experts = "model.base_model.model.model.layers.0.mlp.experts"
    with adapters_unwrapped(model):
        assert is_stacked_experts(model.get_submodule(experts))
        assert not any(name.startswith(f"{experts}.") and ("base_layer" in name or ".lora_" in name)
                       for name, _ in model.named_modules())
    assert [(name, id(module)) for name, module in model.named_modules()] == before
    assert model.get_submodule(experts).get_base_layer() is model.get_submodule(f"{experts}.base_layer.base_layer")

def test_an_output_gate_registered_after_the_output_projection_is_split_with_the_heads():
    """AFMoE's attention registers its output gate (``gate_proj``, hidden → heads × head_dim, multiplied into the
    attention's output) after ``o_proj``; both read and write the hidden size, so widths cannot tell which is the
    output projection. The gate is split with the heads, ``o_proj`` by rows (as HRM's published plan, for the same
    gate, says; AFMoE's names neither). Trained under tp=2 in test_hf_models."""
    pytest.importorskip("transformers")
    from tests.strategies.hf_models import lit_causal_lm

    plan = derive_plan(lit_causal_lm("afmoe"))
    attention = "model.model.layers.1.self_attn."
    roles = {name.removeprefix(attention): role for name, role in plan.items()
             if name.startswith(attention) and role in ("colwise", "rowwise")}
    assert roles == {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "gate_proj": "colwise",
                     "o_proj": "rowwise"}


def test_a_latent_attention_keeps_its_latents_whole_and_splits_its_up_projections_by_heads():
    """DeepSeek-V3's multi-head latent attention (trained under tp in test_hf_models): the down-projections to the
    latents every head reads, and the norms over them, are whole on every rank; the up-projections make the heads."""
    pytest.importorskip("transformers")
    from tests.strategies.hf_models import lit_causal_lm

    model = lit_causal_lm("deepseek_v3")
    plan = derive_plan(model)
    attention = "model.model.layers.1.self_attn."
    roles = {name.removeprefix(attention): role for name, role in plan.items() if name.startswith(attention)}
    assert roles == {"q_a_proj": "latent", "q_a_layernorm": "latent", "kv_a_proj_with_mqa": "latent",
                     "kv_a_layernorm": "latent", "q_b_proj": "colwise", "kv_b_proj": "colwise", "o_proj": "rowwise"}
    validate_plan(model, plan, 2, 2)
    with pytest.raises(TensorParallelError, match=r"tp=3"):  # 8 heads
        validate_plan(model, plan, 3, 3)


def test_experts_held_as_a_list_stay_whole_on_every_rank_and_expert_parallelism_names_them():
    """litgpt's MoE holds its experts as a list of MLPs beside a router (trained under tp in test_hf_models): each
    expert runs on the tokens routed to it, so none is a column→row group; the router and every expert are left
    whole (under sequence parallelism: on this rank's share of the tokens). Expert parallelism splits them where it
    knows their block's forward (litgpt's, trained under ep in test_hf_models); in another block it names them."""
    pytest.importorskip("litgpt")
    from meshlight.parallel.expert import listed_experts
    from meshlight.parallel.layout import ParallelLayout
    from meshlight.parallel.parallelize import parallelize
    from meshlight.parallel.tensor_plan import moe_blocks_of
    from tests.strategies.hf_models import lit_causal_lm

    model = lit_causal_lm("litgpt_moe")
    assert list(listed_experts(model)) == [f"model.transformer.h.{i}.mlp.experts" for i in range(2)]
    assert moe_blocks_of(model) == {f"model.transformer.h.{i}.mlp" for i in range(2)}
    plan = derive_plan(model)
    moe = {name.removeprefix("model.transformer.h.0.mlp."): role for name, role in plan.items()
           if name.startswith("model.transformer.h.0.mlp.")}
    assert moe == {"gate": "replicate", **{f"experts.{e}.{linear}": "replicate" for e in range(4)
                                           for linear in ("fc_1", "fc_2", "proj")}}
    assert plan["model.transformer.h.0.attn.qkv"] == "fused_colwise"
    validate_plan(model, plan, 2, 2)
    for block in moe_blocks_of(model):  # a block of the user's own, its forward unknown
        moe = model.get_submodule(block)
        moe.__class__ = type("OwnMoE", (type(moe),), {})
    layout = ParallelLayout(dp_shard=2, ep=2, zero=3)
    with pytest.raises(ValueError, match=r"ep=2, but the model has no experts to split: .* \(model.transformer.h.0"
                                         r".mlp.experts, model.transformer.h.1.mlp.experts hold experts as a list in a"
                                         r" block whose forward meshlight does not know \(it splits the lists of"
                                         r" litgpt's LLaMAMoE\): train it with ep=1, under tensor, pipeline or data"
                                         r" parallelism\)\."):
        parallelize(model, layout, None)


def test_experts_stacked_in_a_layout_meshlight_does_not_know_are_named_as_such():
    """Experts stacked as ``[experts, …]`` weights in no layout meshlight knows (no ``num_experts``, a fused weight
    without its ``down_proj``): under sequence parallelism each rank would train them on its share; the refusal says
    what they look like, the layouts meshlight splits, and what to do."""

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 32, 64))

        def forward(self, grouped):
            return grouped

    model = _model()
    for block in model.blocks:
        block.moe = nn.Module()
        block.moe.experts = Experts()
    with pytest.raises(TensorParallelError, match=r"blocks.0.moe.experts \(Experts\) holds parameters the automatic"
                                                  r" tensor-parallel plan cannot split: gate_up_proj \[4, 32, 64\]: .*"
                                                  r"\. They look like stacked experts: meshlight splits those whose"
                                                  r" forward takes \(hidden_states, top_k_index, top_k_weights\), .*;"
                                                  r" train this one with pipeline or data parallelism, or parallelize"
                                                  r" it yourself in configure_model\(\)\."):
        validate_plan(model, derive_plan(model), 2, 2)


def test_attention_whose_output_projection_sits_in_a_sibling_module_is_refused():
    """BERT's self-attention holds query, key and value and keeps its head count; its output projection sits in a
    sibling module (BertSelfOutput). Read as a group, value would have been split as the output projection."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, is_decoder=True)
    model = transformers.BertLMHeadModel(config)
    with pytest.raises(TensorParallelError, match=r"bert.encoder.layer.0.attention.self keeps a head count"
                                                  r" \(attention\), but its column→row group would be query, key →"
                                                  r" value: its q, k, v and output projection are not in one module"):
        validate_plan(model, derive_plan(model), 2, 2)


def test_vectors_as_wide_as_a_head_are_not_split_with_the_heads_where_the_two_counts_agree():
    """DiffLlama's λ vectors are as wide as a head; with 8 heads of 8 they looked like one value per head (GPT-OSS's
    sinks) and were split with the heads, training another model. Where the counts agree only sinks are split: the
    attention is refused, naming them."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DiffLlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=8, num_key_value_heads=4)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(TensorParallelError, match=r"model.layers.0.self_attn holds the tensor-parallel group .* and"
                                                  r" also the parameters model.layers.0.self_attn.lambda_q1 \[8\]"):
        validate_plan(model, derive_plan(model), 2, 2)


def test_a_linear_attention_is_kept_whole_and_the_layers_beside_it_are_split():
    """Qwen3.5's Gated DeltaNet (a recurrence over the sequence, its q|k|v through a depthwise convolution over it) is
    one ``whole`` module, nothing inside it given a role of its own; the gated attention layer, the MLPs and the norms
    are split as Llama's are (trained at tp=2 in test_hf_models). ``Hybrid3DStrategy()`` plans it with tp=1
    unless tp is given: the cost model would price the mixers as split."""
    model = lit_causal_lm("qwen3_5")
    plan = derive_plan(model)
    mixers = ["model.model.layers.0.linear_attn"]
    assert tensor_plan.whole_mixers(model) == mixers
    assert all(plan[name] == "whole" for name in mixers)
    assert not [name for name in plan if any(name.startswith(f"{mixer}.") for mixer in mixers)]
    assert plan["model.model.layers.1.self_attn.q_proj"] == "colwise"
    assert plan["model.model.layers.1.self_attn.o_proj"] == "rowwise"
    assert plan["model.model.layers.0.mlp.down_proj"] == "rowwise"
    validate_plan(model, plan, 2, 2)
    for arguments, fixed in (({}, {"tp": 1}), ({"tp": 2}, {})):
        strategy = ml.Hybrid3DStrategy(**arguments)
        ml.Trainer(strategy=strategy, devices=arguments.get("tp", 1), accelerator="cpu", logger=False)
        strategy.connect(lit_causal_lm("qwen3_5"))
        assert {k: v for k, v in strategy._unsplittable().items() if k == "tp"} == fixed, arguments


def test_mamba_hybrids_keep_their_mixers_whole_and_split_what_is_beside_them():
    """Jamba's, Bamba's, Falcon-H1's and Granite 4's Mamba mixers are ``whole``; the hidden size is read with their
    Linears aside (a mixer widens the state before its scan: in tiny Jamba the Linears reading 128 outnumber those
    reading the hidden 64). Granite 4's shared expert's fused gate|up is split part by part (cut by ``chunk(2)``);
    Falcon-H1's attention beside its mixer in each layer as Llama's. (Trained against one process in
    test_hf_models.)"""
    for family, mixer, splits in (
            ("jamba", "model.model.layers.0.mamba", {"model.model.layers.0.feed_forward.gate_proj": "colwise",
                                                     "model.model.layers.1.self_attn.o_proj": "rowwise"}),
            ("bamba", "model.model.layers.0.mamba", {"model.model.layers.1.self_attn.q_proj": "colwise"}),
            ("falcon_h1", "model.model.layers.0.mamba", {"model.model.layers.0.self_attn.k_proj": "colwise",
                                                         "model.model.layers.0.feed_forward.down_proj": "rowwise"}),
            ("granite4", "model.model.layers.0.mamba", {"model.model.layers.0.shared_mlp.input_linear":
                                                        "fused_colwise",
                                                        "model.model.layers.0.shared_mlp.output_linear": "rowwise"})):
        model = lit_causal_lm(family)
        plan = derive_plan(model)
        assert mixer in tensor_plan.whole_mixers(model) and plan[mixer] == "whole", family
        assert not [name for name in plan if name.startswith(f"{mixer}.")], family
        assert {name: plan[name] for name in splits} == splits, family
        validate_plan(model, plan, 2, 2)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_a_sparse_attentions_key_selector_runs_whole_beside_the_latent_attention_it_picks_keys_for(family):
    """DeepSeek Sparse Attention (DeepSeek-V3.2's, GLM-5's): the lightning indexer, inside the attention, reads its
    whole input and picks each query's keys; it takes the role ``latent`` as a whole (its own projections get no
    role), so every rank's heads attend to the same keys; the latent attention around it is split as DeepSeek-V3's.
    (Trained against one process in test_hf_models.)"""
    model = lit_causal_lm(family)
    plan = derive_plan(model)
    attention = "model.model.layers.1.self_attn"
    assert plan[f"{attention}.indexer"] == "latent"
    assert not [name for name in plan if name.startswith(f"{attention}.indexer.")]
    assert {name.rpartition(".")[2]: plan[name] for name in plan if name.rpartition(".")[0] == attention} == {
        "q_a_proj": "latent", "q_a_layernorm": "latent", "kv_a_proj_with_mqa": "latent", "kv_a_layernorm": "latent",
        "q_b_proj": "colwise", "kv_b_proj": "colwise", "o_proj": "rowwise", "indexer": "latent"}
    validate_plan(model, plan, 2, 2)


def test_blocks_handed_per_layer_embeddings_are_refused_naming_data_parallelism():
    """Gemma 4's edge models (and Gemma 3n) hand every layer its slice of per-layer embeddings, computed for all of
    them at once outside the blocks, which scales a narrow projection of the block's output: the automatic plan
    refuses it before any collective (a column split would multiply half that projection by the whole input), and
    the planner keeps tp=1 for it. Gemma 4's other models (no per-layer input) are planned: on the global layer, whose
    keys are also its values, k and q split by heads and the output projection by rows."""
    with pytest.raises(TensorParallelError, match=r"model.model.layers.0 \(Gemma4TextDecoderLayer\) takes a per-layer"
                                                  r" input .*hidden_size_per_layer_input=8.*Train this model with"
                                                  r" tp=1"):
        derive_plan(lit_causal_lm("gemma4_edge"))
    model = lit_causal_lm("gemma4")
    plan = derive_plan(model)
    attention = "model.model.layers.1.self_attn"
    assert {name: plan[f"{attention}.{name}"] for name in ("q_proj", "k_proj", "o_proj")} == {
        "q_proj": "colwise", "k_proj": "colwise", "o_proj": "rowwise"}
    validate_plan(model, plan, 2, 2)


def test_a_latent_attentions_output_projection_stays_rowwise_when_it_reads_a_latents_width():
    """The Linears reading a latent (q's, k|v's) make the heads, colwise; the output projection reads the heads'
    outputs, whose width may equal a latent's rank by chance (q_lora_rank = 8 heads × v_head_dim 4): it stays the
    group's rowwise writer (it was planned colwise, and nothing in the group wrote the hidden state back; with it
    rowwise, tp=2 matches one process to 7.8e-8 in float64, checked once). A latent as wide as the hidden state
    cannot be told from the block's norm and readers by width: refused, naming plan=."""
    import transformers

    from tests.strategies.hf_models import hf_config

    def model(v_head_dim: int, q_lora_rank: int) -> nn.Module:
        config = hf_config("deepseek_v3")
        config.v_head_dim, config.q_lora_rank = v_head_dim, q_lora_rank
        return transformers.AutoModelForCausalLM.from_config(config)

    coinciding = model(4, 32)
    plan = derive_plan(coinciding)
    attention = "model.layers.1.self_attn"
    assert {name: plan[f"{attention}.{name}"] for name in ("q_a_proj", "q_b_proj", "kv_b_proj", "o_proj")} == {
        "q_a_proj": "latent", "q_b_proj": "colwise", "kv_b_proj": "colwise", "o_proj": "rowwise"}
    validate_plan(coinciding, plan, 2, 2)
    with pytest.raises(TensorParallelError, match=r"model.layers.0.self_attn is a latent attention whose latent is as"
                                                  r" wide as the hidden state \(q_lora_rank=64, hidden size 64\).*"
                                                  r"plan="):
        derive_plan(model(8, 64))
