"""GPT: shapes, causality, layout-independent initialization, sizes of the published presets, FLOPs."""

import pytest
import torch

from meshlight.models import GPT, GPTConfig
from meshlight.models.gpt import apply_rotary
from meshlight.nn import MoE, MoEConfig

LLAMA_SHAPED = dict(positions="rotary", mlp="swiglu", norm="rmsnorm", n_kv_heads=2, bias=False)


@pytest.mark.parametrize("overrides", [{}, LLAMA_SHAPED], ids=["gpt2-shaped", "llama-shaped"])
def test_logits_are_causal(overrides):
    model = GPT(GPTConfig.tiny(**overrides)).eval()
    tokens = torch.randint(0, 256, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    logits, logits_changed = model(tokens), model(changed)
    assert logits.shape == (2, 16, 256)
    torch.testing.assert_close(logits[:, :10], logits_changed[:, :10])
    assert not torch.allclose(logits[:, 10:], logits_changed[:, 10:])


def test_initialization_depends_only_on_seed_and_names():
    a, b = GPT(GPTConfig.tiny()), GPT(GPTConfig.tiny())
    with torch.device("meta"):
        c = GPT(GPTConfig.tiny())
    c.to_empty(device="cpu")
    c.init_weights()
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q) and torch.equal(p, r), name
    other_seed = GPT(GPTConfig.tiny(init_seed=1))
    assert not torch.equal(a.blocks[0].attn.wq.weight, other_seed.blocks[0].attn.wq.weight)


def test_initialization_scales_residual_projections():
    model = GPT(GPTConfig.tiny(n_layers=8, dim=256, n_heads=8))
    assert model.blocks[0].mlp.w1.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].mlp.w2.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.equal(model.norm.weight, torch.ones(256))


@pytest.mark.parametrize(
    ("preset", "millions"),
    [(GPTConfig.gpt2, 124.4), (GPTConfig.gpt2_medium, 354.9), (GPTConfig.gpt2_large, 774.0),
     (GPTConfig.gpt2_xl, 1557.6)],
)
def test_gpt2_presets_have_the_published_sizes(preset, millions):
    with torch.device("meta"):
        model = GPT(preset())
    assert model.num_params() / 1e6 == pytest.approx(millions, abs=0.1)


def test_flops_per_token_follow_the_palm_convention():
    config = GPTConfig.gpt2()
    with torch.device("meta"):
        model = GPT(config)
    non_embedding = model.num_params() - config.vocab_size * config.dim - config.max_seq_len * config.dim
    non_embedding += config.vocab_size * config.dim  # the tied head is a real matmul
    expected = 6 * non_embedding + 12 * 12 * 12 * 64 * 1024
    assert model.flops_per_token() == expected


def test_loss_ignores_unscored_positions():
    logits = torch.randn(2, 3, 5)
    targets = torch.tensor([[1, -100, 2], [-100, -100, 4]])
    scored = logits[targets != -100]
    expected = torch.nn.functional.cross_entropy(scored, targets[targets != -100])
    torch.testing.assert_close(GPT.loss(logits, targets), expected)


def test_rotary_rotation_preserves_norms():
    x = torch.randn(2, 5, 3, 8)
    model = GPT(GPTConfig.tiny(positions="rotary", dim=32, n_heads=4))
    rotated = apply_rotary(x, *model.rope(5))
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(rotated[:, 0], x[:, 0])  # position 0 is not rotated


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"dim": 30, "n_heads": 4}, "not divisible by n_heads"), ({"n_kv_heads": 3}, "must divide n_heads"),
     ({"mlp": "relu"}, "choose one of"), ({"dropout": 1.0}, "must be in")],
)
def test_invalid_configs_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig.tiny(**overrides)


def test_too_long_sequence_is_rejected():
    with pytest.raises(ValueError, match="exceeds max_seq_len=8"):
        GPT(GPTConfig.tiny(max_seq_len=8))(torch.zeros(1, 9, dtype=torch.long))


def test_moe_every_k_th_block_and_active_parameters():
    config = GPTConfig.tiny(n_layers=4, moe=MoEConfig(num_experts=8, top_k=2, hidden_dim=32), moe_every=2)
    model = GPT(config)
    assert [isinstance(block.mlp, MoE) for block in model.blocks] == [False, True, False, True]
    experts = sum(p.numel() for block in model.blocks[1::2] for p in block.mlp.experts.parameters())
    assert model.num_active_params() == model.num_params(exclude_embeddings=True) - experts * 6 // 8
    assert model.flops_per_token(64) == 6 * model.num_active_params() + 12 * 4 * 4 * 16 * 64


def test_moe_weights_depend_only_on_seed_and_names_and_materialize_from_meta():
    config = GPTConfig.tiny(moe=MoEConfig(num_experts=4, expert_bias_rate=1e-3))
    reference = GPT(config)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    model.init_weights()
    for (name, a), (_, b) in zip(reference.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name
    experts = reference.blocks[0].mlp.experts
    assert experts.w2.std() < experts.w1.std()  # the residual projection is scaled down, as mlp.w2
