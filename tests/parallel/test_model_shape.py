"""A model's shape is read in one place: head counts from the attributes attention keeps them under, else from
``head_dim`` and the projections' widths; the planner and tensor parallelism then accept the same tp."""

import pytest
from torch import nn

from meshlight.models import GPT, GPTConfig
from meshlight.parallel.model_shape import ModelShape, ModelShapeError, attention_heads, model_shape
from meshlight.parallel.planner import HARDWARE, PlanError, model_spec_of, plan
from meshlight.parallel.tensor_plan import TensorParallelError, derive_plan, validate_plan
from tests.strategies.llama import LitLlama
from tests.strategies.nanogpt import NanoGPT

LLAMA = ModelShape(blocks=2, hidden=64, heads=8, kv_heads=4, head_dim=8, mlp_width=128, vocab=16, gated_mlp=True)


def test_head_counts_come_from_attributes_or_from_head_dim_and_the_projections():
    assert model_shape(LitLlama()) == LLAMA  # n_heads, n_kv_heads
    # Hugging Face's Llama keeps only head_dim: q is 8 heads of 8 wide, k and v 4
    assert model_shape(LitLlama(head_dim_only=True, layers=4)) == ModelShape(**{**vars(LLAMA), "blocks": 4})
    gpt = GPT(GPTConfig.tiny(n_layers=3, dim=64, n_heads=4, n_kv_heads=2))  # meshlight's GPT: head_dim only too
    assert model_shape(gpt) == ModelShape(blocks=3, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp_width=256,
                                          vocab=256, gated_mlp=False)
    nano = model_shape(NanoGPT())  # n_head alone: as many key/value heads, each hidden / n_head wide
    assert (nano.heads, nano.kv_heads, nano.head_dim) == (4, 4, 8)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gpt2", "litgpt", "phi3"])
def test_models_from_hugging_face_and_litgpt_read_as_their_configs_say(family):
    """Models we did not write: the shape their config states (GPT-2's Conv1D and litgpt's fused q|k|v hide the heads
    from the structure; Phi-3's fused gate|up is gated, though its q|k|v is as wide as the MLP), for the planner
    too."""
    pytest.importorskip("transformers")
    from tests.strategies import hf_models

    module = hf_models.lit_causal_lm(family)
    kv_heads = hf_models.HEADS if family == "gpt2" else hf_models.KV_HEADS
    gpt2 = family == "gpt2"  # GELU's one projection into the MLP width, not SwiGLU's two; the head tied
    assert model_shape(module) == ModelShape(
        blocks=hf_models.LAYERS, hidden=hf_models.DIM, heads=hf_models.HEADS, kv_heads=kv_heads,
        head_dim=hf_models.DIM // hf_models.HEADS, mlp_width=hf_models.HIDDEN, vocab=hf_models.VOCAB,
        gated_mlp=not gpt2, tied_head=gpt2)
    spec = model_spec_of(module)
    assert (spec.layers, spec.heads, spec.kv_heads, spec.ffn_hidden, spec.vocab, spec.swiglu, spec.tie_embeddings) == (
        hf_models.LAYERS, hf_models.HEADS, kv_heads, hf_models.HIDDEN, hf_models.VOCAB, not gpt2, gpt2)


@pytest.mark.parametrize("family", ["llama", "litgpt", "gpt2", "nanogpt", "phi3", "opt", "xglm", "biogpt", "bloom",
                                    "mpt"])
def test_the_planner_counts_a_models_parameters_as_its_structure_holds_them(family):
    """A head tied to the token embedding is one weight, counted once, and GPT-2's MLP has two matrices, not
    SwiGLU's three (both were missed: GPT-2's tiny model was planned at 1.15× its parameters, now 0.93×). What the
    structure does not tell the planner (GPT-2's biases and learned positions) stays out: within 8% there, exact for
    the Llamas. OPT and XGLM name their MLP's width ``ffn_dim`` (read, where four times the hidden size was assumed:
    1.8× their parameters); BLOOM's and MPT's configs name none: their widest projection outside attention."""
    pytest.importorskip("transformers")
    from tests.strategies import hf_models

    module = NanoGPT() if family == "nanogpt" else hf_models.lit_causal_lm(family)
    held = sum(p.numel() for p in module.parameters())  # a shared parameter once
    exact = family in ("llama", "litgpt", "phi3")
    assert model_spec_of(module).params == pytest.approx(held, rel=0 if exact else 0.08)


def test_experts_and_their_width_come_from_the_moe_layers():
    shape = model_shape(LitLlama(experts=8))
    assert (shape.experts, shape.top_k, shape.moe_layers, shape.mlp_width) == (8, 2, 2, 64)


def test_a_module_naming_neither_head_count_nor_head_dim_has_no_heads():
    attention = nn.Module()
    attention.q, attention.k, attention.o = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 32)
    assert attention_heads(attention, 32) is None
    attention.head_size = 8
    assert attention_heads(attention, 32) == (4, 2)
    attention.num_heads = 2  # an attribute wins over the widths; key/value heads still from k
    assert attention_heads(attention, 32) == (2, 2)
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128)) for _ in range(2))
    shape = model_shape(model)
    assert (shape.heads, shape.kv_heads, shape.head_dim, shape.mlp_width) == (None, None, None, 512)
    assert model_spec_of(model).heads == 2  # the planner's guess: heads 64 wide
    with pytest.raises(ModelShapeError, match="Sequential has no repeated blocks"):
        model_shape(nn.Sequential(nn.Linear(4, 4)))


@pytest.mark.parametrize("model", [LitLlama, lambda: LitLlama(head_dim_only=True, layers=4), NanoGPT],
                         ids=["attributes", "head_dim", "nanogpt"])
def test_the_planner_and_tensor_parallelism_accept_the_same_tp(model):
    module = model()
    spec, plan_ = model_spec_of(module, seq_len=12), derive_plan(module)
    verdicts = {tp: (_planned(spec, tp), _accepted(module, plan_, tp)) for tp in (2, 4, 8)}
    # key/value heads split over tp, or (fewer than tp, a divisor of it) one on each rank
    held = {tp: spec.heads % tp == 0 and (spec.kv_heads % tp == 0 or tp % spec.kv_heads == 0) for tp in (2, 4, 8)}
    assert verdicts == {tp: 2 * (held[tp],) for tp in (2, 4, 8)}
    assert verdicts[2] == (True, True)


def _planned(spec, tp):
    try:
        return plan(spec, HARDWARE["cpu"], 2 * tp, local_batch=8, tp=tp, pp=1)[0].tp == tp
    except PlanError:
        return False


def _accepted(module, plan_, tp):
    try:
        validate_plan(module, plan_, tp, 2 * tp)
    except TensorParallelError:
        return False
    return True


def test_a_llama_keeping_only_head_dim_is_planned_with_its_heads_under_3d_sizes():
    # it read as 1 head before: "tp must divide heads=1, kv_heads=1"
    spec = model_spec_of(LitLlama(head_dim_only=True, layers=4), seq_len=12)
    assert (spec.heads, spec.kv_heads) == (8, 4)
    best = plan(spec, HARDWARE["cpu"], 8, local_batch=2, dp=2, pp=2, tp=2)[0]
    assert (best.dp, best.pp, best.tp) == (2, 2, 2)
    module = LitLlama(head_dim_only=True)
    with pytest.raises(TensorParallelError, match=r"tp=16 does not divide heads of model.layers.0.attention.wq=8;"
                                                  r" choose tp in \[1, 2, 4, 8\]"):
        validate_plan(module, derive_plan(module), 16, 16)


def test_an_attention_keeping_only_its_kv_heads_reads_its_query_heads_from_its_config():
    """Phi-3's attention keeps num_key_value_heads and head_dim, its query count only in the config: its fused q|k|v
    (128 wide: 8 query heads of 8, 4 key and 4 value heads) is those three parts, not two halves; an attention whose
    counts explain neither is no fused gate|up either."""
    from types import SimpleNamespace

    from meshlight.parallel.model_shape import fused_parts

    attention = nn.Module()
    attention.qkv_proj, attention.o_proj = nn.Linear(64, 128), nn.Linear(64, 64)
    attention.num_key_value_heads, attention.head_dim = 4, 8
    attention.config = SimpleNamespace(num_attention_heads=8, num_key_value_heads=4)
    assert attention_heads(attention, 64) == (8, 4)
    assert fused_parts(attention, 128, 64, 64) == (64, 32, 32)
    attention.config = None  # 16 "heads" of 8 read from the fused width: the counts explain nothing
    assert fused_parts(attention, 128, 64, 64) is None
    mlp = nn.Module()
    mlp.gate_up_proj, mlp.down_proj = nn.Linear(64, 256), nn.Linear(128, 64)
    assert fused_parts(mlp, 256, 128, 64) == (128, 128)


def test_a_shared_expert_is_counted_as_every_tokens_mlp_beside_the_routed_ones():
    """Qwen2-MoE's shared expert (its width stated as shared_expert_intermediate_size) and DeepSeek's (n_shared_experts
    of the routed experts' width): dense parameters and FLOPs every token pays, which the planner counted as none.
    Qwen2-MoE's tiny model: within 0.3% (what the planner leaves out: q/k/v biases, the shared expert's gate)."""
    transformers = pytest.importorskip("transformers")
    from tests.strategies import hf_models

    module = hf_models.lit_causal_lm("qwen2_moe")
    assert model_shape(module).shared_mlp_width == hf_models.HIDDEN
    spec = model_spec_of(module)
    assert spec.params == pytest.approx(sum(p.numel() for p in module.parameters()), rel=3e-3)
    assert spec.active_params - spec.replace(shared_ffn=0).active_params == spec.moe_layers * 3 * spec.hidden * (
        hf_models.HIDDEN)
    deepseek = transformers.DeepseekV3Config(
        vocab_size=16, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2,
        n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, max_position_embeddings=64, pad_token_id=None, bos_token_id=0, eos_token_id=1)
    shape = model_shape(transformers.AutoModelForCausalLM.from_config(deepseek))
    assert (shape.experts, shape.mlp_width, shape.shared_mlp_width) == (4, 32, 64)


@pytest.mark.parametrize("family", ["llama4", "ernie4_5_moe"])
def test_an_moe_models_dense_layers_and_a_shared_expert_its_config_does_not_state_are_counted(family):
    """Llama 4 and ERNIE 4.5 (their tiny models: a dense first layer, then an MoE one) hold dense layers twice as wide
    as an expert, which the planner counted as MoE layers; Llama 4's shared expert is stated by no config field and
    read from its MoE block. Their parameters come out exactly, but for ERNIE's router's score correction (one value
    per expert)."""
    pytest.importorskip("transformers")
    from tests.strategies import hf_models

    module = hf_models.lit_causal_lm(family)
    shape = model_shape(module)
    assert (shape.blocks, shape.moe_layers, shape.mlp_width, shape.dense_mlp_width) == (2, 1, hf_models.HIDDEN // 2,
                                                                                         hf_models.HIDDEN)
    assert shape.moe_positions == (1,) and model_spec_of(module).moe_positions_of() == {1}  # (the planner's stages)
    assert shape.shared_mlp_width > 0
    assert model_spec_of(module).params == pytest.approx(sum(p.numel() for p in module.parameters()), abs=4)


def test_the_llama_4_presets_hold_their_published_parameter_counts():
    """Scout: 109B parameters (its text model 108B), Maverick 400B, both 17B active (embedding and head with it):
    Maverick's experts in every other layer, the dense layers between them twice as wide."""
    from meshlight.parallel.presets import MODELS

    for name, total in (("llama4-scout", 108e9), ("llama4-maverick", 400e9)):
        spec = MODELS[name]
        assert spec.params == pytest.approx(total, rel=0.01)
        assert spec.active_params + spec.embedding_params == pytest.approx(17.2e9, rel=0.01)  # (the head is in)
    assert MODELS["llama4-maverick"].moe_layers == 24


def test_an_mlp_holding_the_models_config_is_not_read_as_attention():
    """GLM-4's MLP keeps the model's config, whose head counts explain a fused k|v as wide as the MLP's output
    projection (2 × 4 key/value heads × 8 = 64, the hidden size): only a projection of the hidden state can be a
    fused q|k|v or k|v, so the MLP keeps its own (no) counts and its fused gate|up splits as two halves."""
    pytest.importorskip("transformers")
    from meshlight.parallel.model_shape import count_holder
    from tests.strategies import hf_models

    module = hf_models.lit_causal_lm("glm4")
    mlp = module.model.model.layers[0].mlp
    assert count_holder(mlp) is mlp
    assert derive_plan(module)["model.model.layers.0.mlp.gate_up_proj"] == "fused_colwise"
    attention = module.model.model.layers[0].self_attn
    assert count_holder(attention) is attention  # Hugging Face's attention keeps its head_dim itself


def test_a_config_that_refuses_to_state_a_per_layer_value_states_none():
    """transformers' configs of models whose layers differ (Gemma 4's) raise for a per-layer value such as head_dim
    read from the whole model's config: the planner and tensor parallelism then read the layers' own modules."""
    from meshlight.parallel.model_shape import head_dim_of, stated_attribute

    class PerLayerConfig:
        num_attention_heads = 8

        @property
        def head_dim(self):
            raise RuntimeError("'head_dim' is a per-layer attribute and may vary across layers")

    assert stated_attribute(PerLayerConfig(), "head_dim") is None
    assert head_dim_of(PerLayerConfig(), own=True) is None


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl_moe", "llava", "gemma3_vision"])
def test_a_vision_language_models_decoder_is_told_from_its_vision_encoder(family):
    """A vision-language model holds two lists of blocks: its vision encoder's, narrower, and its decoder's, which the
    token embedding feeds. The decoder's are the model's blocks for the planner (its text config's shape), tensor
    parallelism (roles for the decoder's Linears alone: the encoder runs whole on every rank) and pipelining (the
    decoder's blocks cut into stages); context parallelism refuses the model before training, naming the encoder and
    cp=1."""
    pytest.importorskip("transformers")
    from meshlight.parallel.context import ContextParallelError, check_no_encoder
    from meshlight.parallel.model_shape import decoder_blocks, encoder_blocks
    from meshlight.parallel.pipeline import find_pipelined_module
    from meshlight.parallel.tensor_plan import model_plan
    from tests.strategies import hf_models, hf_vlm

    module = hf_vlm.lit_vlm(family)
    encoder = {"qwen2_5_vl": "model.model.visual.blocks", "qwen3_vl_moe": "model.model.visual.blocks",
               "llava": "model.model.vision_tower.encoder.layers",
               "gemma3_vision": "model.model.vision_tower.encoder.layers"}[family]
    # (Qwen3-VL's deepstack mergers, a list of modules of one kind, are blocks too)
    deepstack = ["model.model.visual.deepstack_merger_list"] if family == "qwen3_vl_moe" else []
    assert encoder_blocks(module) == [encoder, *deepstack]
    layers = module.model.model.language_model.layers
    assert decoder_blocks(module) == list(layers)
    shape = model_shape(module)
    assert (shape.blocks, shape.hidden, shape.heads, shape.kv_heads, shape.vocab) == (
        hf_models.LAYERS, hf_models.DIM, hf_models.HEADS, hf_models.KV_HEADS, hf_vlm.VOCAB)
    assert shape.experts == (4 if family == "qwen3_vl_moe" else 0)
    # the planner holds the encoder's parameters whole on every tp rank: LLaVA's (a Llama decoder) counted exactly
    held = sum(p.numel() for p in module.parameters())
    outside = sum(p.numel() for name, p in module.named_parameters() if "language_model" not in name
                  and not name.startswith("model.lm_head"))
    assert shape.encoder_params == outside > 0
    spec = model_spec_of(module)
    assert spec.params == pytest.approx(held, rel=0 if family == "llava" else 0.08)
    assert spec.active_params == model_spec_of(module.model.model.language_model).active_params
    plan = model_plan(module)
    assert plan and not [name for name in plan if name.startswith(encoder.rsplit(".", 1)[0])]
    assert plan["model.model.language_model.layers.0.self_attn.o_proj"] == "rowwise"
    with pytest.raises(ContextParallelError, match=rf"holds blocks beside its decoder's \({encoder}.*Context"
                                                   r" parallelism splits the token sequence.*train it with cp=1"):
        check_no_encoder(module)
    # pipelining cuts the decoder's blocks (its encoder on the first stage; where the decoder adds the encoder's
    # features after its first layers, Qwen3-VL's deepstack, the first stage holds them and the next)
    assert find_pipelined_module(module)[0::2] == ("model.model.language_model", "layers")
    assert shape.first_stage_blocks == (2 if family == "qwen3_vl_moe" else 1)
    # one list of blocks, or two of one width as near the token embedding (an encoder-decoder's): all of them
    assert decoder_blocks(module.model.model.language_model) == list(layers)
    assert encoder_blocks(module.model.model.language_model) == []


def test_an_moe_layer_routing_by_token_type_is_refused_under_sequence_parallelism_alone():
    """ERNIE 4.5-VL's MoE layer takes each token's type (text or image, which picks its experts) beside the hidden
    state: under sequence parallelism it would meet the whole sequence's types beside a share's tokens, so tp with
    sequence parallelism refuses it before training, naming the layer and sequence_parallel=False — the layout its
    parity run trains under (tests/strategies/test_hf_models.py: tp2-no-sp)."""
    pytest.importorskip("transformers")
    from meshlight.parallel.tensor_plan import TensorParallelError, model_plan, validate_plan
    from tests.strategies import hf_vlm

    module = hf_vlm.lit_vlm("ernie4_5_vl_moe")
    plan = model_plan(module)
    with pytest.raises(TensorParallelError, match=r"model.model.language_model.layers.1.mlp \(Ernie4_5_VLMoeMoeBlock\)"
                                                  r" takes moe_mm_token_type_ids beside its hidden state.*Pass"
                                                  r" sequence_parallel=False"):
        validate_plan(module, plan, 2, 2)
    validate_plan(module, plan, 2, 2, sequence_parallel=False)
