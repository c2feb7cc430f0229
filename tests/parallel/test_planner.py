"""The layout planner: its model state formula is meshlight's (ZeRO on FSDP2), its model view matches the GPT it
reads, it ranks the published layouts of large runs among its best, bad sizes fail with a message naming the
constraints, and `meshlight plan` prints a table."""

import json

import pytest
import torch

from meshlight.cli import main
from meshlight.models import GPT, GPTConfig
from meshlight.nn import MoEConfig
from meshlight.parallel.planner import (
    HARDWARE,
    MODELS,
    PlanError,
    best_per_layout,
    detect_hardware,
    model_spec_of,
    model_state_bytes,
    plan,
)
from tests.strategies.llama import LitLlama

CPU = HARDWARE["cpu"]  # fp32: 4-byte parameters


@pytest.mark.parametrize("world", [2, 4])
def test_model_state_is_the_zero_formula_as_fsdp2_holds_it(world):
    psi = 1000
    # DDP 16Ψ; ZeRO-1/2 between micro-batches: the classic formula plus FSDP2's fp32 shard 4Ψ/N beside the
    # gathered parameters (benchmarks/memory.py measures exactly this); ZeRO-3 16Ψ/N.
    assert model_state_bytes(psi, world, 0, CPU) == 16 * psi
    assert model_state_bytes(psi, world, 1, CPU) == pytest.approx(8 * psi + 8 * psi / world + 4 * psi / world)
    assert model_state_bytes(psi, world, 2, CPU) == pytest.approx(4 * psi + 12 * psi / world + 4 * psi / world)
    assert model_state_bytes(psi, world, 3, CPU) == pytest.approx(16 * psi / world)
    # inside a pipeline schedule every stage keeps gathered parameters and whole gradients until its end
    for zero in (1, 2, 3):
        assert model_state_bytes(psi, world, zero, CPU, pipelined=True) == model_state_bytes(psi, world, 1, CPU)


@pytest.mark.parametrize("moe", [False, True])
def test_model_view_matches_the_gpt_it_reads(moe):
    config = GPTConfig(vocab_size=512, max_seq_len=64, n_layers=4, dim=64, n_heads=4, n_kv_heads=2, mlp="swiglu",
                       norm="rmsnorm", positions="rotary", bias=False,
                       moe=MoEConfig(num_experts=4, top_k=2) if moe else None, moe_every=2)
    model, spec = GPT(config), model_spec_of(GPT(config))
    assert spec.params == sum(p.numel() for p in model.parameters())
    assert spec.flops_per_token() == model.flops_per_token()


def test_model_view_from_structure_when_there_is_no_config():
    spec = model_spec_of(LitLlama(), seq_len=16)
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads) == (2, 64, 8, 4)


def test_published_layouts_rank_among_the_best():
    # Megatron-Core weak scaling on H100 (benchmarks/planner.py has all 13 published runs): up to 32B the
    # published tensor-parallel layout is the planner's first choice; 462B's TP8 × PP16 among its three best.
    for name, world, batch, published, within in (("megatron-7.1b", 96, 192, (48, 1, 2), 1),
                                                  ("megatron-32b", 384, 192, (48, 1, 8), 1),
                                                  ("megatron-462b", 6144, 3072, (48, 16, 8), 3)):
        best = [c.layout[:3] for c in best_per_layout(plan(MODELS[name], HARDWARE["h100"], world, batch))]
        assert published in best[:within], (name, best[:3])


def test_fixed_sizes_that_cannot_work_fail_naming_the_constraints():
    with pytest.raises(PlanError, match="tp must divide heads=64") as error:
        plan(MODELS["llama3-70b"], HARDWARE["h100"], 24, 48, tp=3)
    assert "Nearest layouts that work: dp=6 pp=1 tp=4" in str(error.value), str(error.value)


def test_nothing_fitting_is_reported_not_chosen():
    candidates = plan(MODELS["llama3-405b"], HARDWARE["h100"], 8, 8)
    assert not any(c.fits for c in candidates)


def test_cpu_hardware_shares_the_node_memory():
    assert detect_hardware(torch.device("cpu"), 4).memory < detect_hardware(torch.device("cpu"), 1).memory


def test_command_line(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "16", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "Llama 3 8B" in out and "wins" in out
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--json", "--top", "3"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3 and all(r["fits"] for r in rows)
    assert main(["plan", "--model", "llama3-70b", "--gpus", "24", "--tp", "3"]) == 2
    assert "tp must divide" in capsys.readouterr().err
