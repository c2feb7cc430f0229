"""The layout planner: its model view matches the GPT it reads, it ranks the published layouts of large runs
among its best, bad sizes fail with a message naming the constraints, and `meshlight plan` prints a table."""

import dataclasses
import json
import re

import pytest
import torch
import yaml

from meshlight.cli import main
from meshlight.models import GPT, GPTConfig
from meshlight.nn import MoEConfig
from meshlight.parallel.planner import (
    HARDWARE,
    MODELS,
    PlanError,
    _format_rate,
    _nearest,
    best_per_layout,
    estimate,
    explain,
    fewest_devices,
    format_plan,
    model_spec_of,
    plan,
    precision_bytes,
    same_devices_hint,
)
from tests.strategies.llama import LitLlama

CPU = HARDWARE["cpu"]  # fp32: 4-byte parameters


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("gpt2", [False, True])  # Llama-like, or with biases, LayerNorm and learned positions
def test_model_view_matches_the_gpt_it_reads(moe, gpt2):
    style = dict(mlp="gelu", norm="layernorm", positions="learned", bias=True) if gpt2 else dict(
        mlp="swiglu", norm="rmsnorm", positions="rotary", bias=False)
    config = GPTConfig(vocab_size=512, max_seq_len=64, n_layers=4, dim=64, n_heads=4, n_kv_heads=2, **style,
                       moe=MoEConfig(num_experts=4, top_k=2) if moe else None, moe_every=2)
    model, spec = GPT(config), model_spec_of(GPT(config))
    assert spec.params == sum(p.numel() for p in model.parameters())
    assert spec.flops_per_token() == model.flops_per_token()


def test_model_view_from_structure_when_there_is_no_config():
    spec = model_spec_of(LitLlama(), seq_len=16)
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads) == (2, 64, 8, 4)


def test_published_layouts_rank_among_the_best():
    # Megatron-Core weak scaling on H100 (benchmarks/planner.py has all 14 published runs): the published layouts
    # among the planner's three best (119B only once ZeRO-3 over 192 nodes pays its ring latency; 462B only with
    # the projections' inputs gathered again in backward, see the next test). The runs held dp at 48 by design;
    # layouts with fewer tp ranks put more of a data-parallel group on each node, whose NICs carry its rings
    # together, and the planner ranks some of those a few percent higher: 32B's tp=8 is sixth, behind dp=192 tp=2
    # zero=2 (by 1.17×), dp=96 tp=4, and three pipelines interleaving 8 to 16 virtual stages over few microbatches,
    # each within 7% of it.
    for name, world, batch, published, within in (("megatron-7.1b", 96, 192, (48, 1, 2), 3),
                                                  ("megatron-32b", 384, 192, (48, 1, 8), 6),
                                                  ("megatron-119b", 1536, 768, (48, 4, 8), 3),
                                                  ("megatron-462b", 6144, 3072, (48, 16, 8), 3)):
        best = [c.layout[:3] for c in best_per_layout(plan(MODELS[name], HARDWARE["h100"], world, batch))]
        assert published in best[:within], (name, best[:within])
    # torchtitan's 2-D Llama 3.1 405B run (FSDP 16 × TP 8, full AC, 128 H100s at 500 W, global batch 32): among
    # the two best, beside FSDP 32 × TP 4 (whose data-parallel rings leave each node on two NICs, not one)
    best = best_per_layout(plan(MODELS["llama3-405b"], HARDWARE["h100-96gb-500w"], 128, 32))
    assert "dp=16 pp=1 tp=8 zero=3 recompute" in [c.describe() for c in best[:2]]
    assert best[0].tokens_per_second_per_device < 1.05 * best[1].tokens_per_second_per_device


def test_405b_in_2d_outruns_torchtitans_3d_layout_by_no_more_than_torchtitan_measured():
    # torchtitan ran Llama 3.1 405B on the same H100s as FSDP 16 × TP 8 on 128 GPUs (109 tokens/s per GPU, bf16)
    # and as FSDP 8 × TP 8 × PP 8 on 512 (128 with Float8, ≈ 88.6 in bf16 at its measured Float8 speedup):
    # 1.23× per GPU for 2-D, 1.45× with both in Float8. The planner ranks 2-D layouts above the 3-D one too,
    # by less than that (benchmarks/RESULTS.md).
    model, hardware = MODELS["llama3-405b"], HARDWARE["h100-96gb-500w"]
    two_d = plan(model, hardware, 128, 32, dp=16, pp=1, tp=8)[0]
    three_d = plan(model, hardware, 512, 256, dp=8, pp=8, tp=8)[0]
    ratio = two_d.tokens_per_second_per_device / three_d.tokens_per_second_per_device
    assert 1 < ratio < 109 / (128 / (942.4 / 652.4))


#: torchtitan's context-parallel Llama 3 8B runs on 8 H100s (96 GB HBM2e, 500 W cap; FSDP over dp × cp, full activation
#: checkpointing, torch.compile and Float8; one sequence per dp rank): (cp, sequence length) -> tokens/s per GPU
#: (benchmarks/llama3_h100_202412_torchtitan.md, Dec 2024)
TORCHTITAN_CONTEXT_PARALLEL = {(1, 32768): 3890, (2, 65536): 2540, (4, 131072): 1071, (8, 262144): 548}


def _torchtitan_context_parallel_estimate(cp, seq_len):
    """The planner's estimate of one of those runs, as torchtitan ran it: dp = 8/cp, ZeRO-3, full recomputation."""
    dp = 8 // cp
    return estimate(MODELS["llama3-8b"].replace(seq_len=seq_len), HARDWARE["h100-96gb-500w"], 8, dp, dp, 1, 1, 1, 3, 1,
                    1, True, cp=cp)


# torchtitan's 128K run (cp=4) reached 0.42× the tokens/s of its 64K run (cp=2); the planner, whose compute per rank
# grows 1.68× between them (its K/V exchange is 0.3% of the step), predicts 0.59×. Every rank holds 32K tokens in
# both, so the published step grew 2.37×, past the 2× that a rank's FLOPs grow by even were attention all of them,
# and the exchange, which grows faster, is too small to make up the rest. The 256K run then follows the 128K one as
# predicted. Its constants are not fitted to these runs. Float8 does not cancel entirely (it speeds the linear
# layers, not attention, which dominates at long sequences), but pricing the linear layers at torchtitan's measured
# Float8 speedup (1.445×) narrows these misses only to 1.29–1.36×. The same page's 405B runs (TP 8 × PP 8, cp 1 to 8,
# in `benchmarks/context_parallel_planner.py`, not a target) fall faster with the sequence than predicted too (256K ÷
# 32K: 0.21 published, 0.37 predicted): attention under PyTorch's ring attention cost more there than flash attention's
# FLOPs at the planner's rate.
_CP4_MISSED = pytest.mark.xfail(strict=True, reason="torchtitan's 128K run (cp=4) reached 0.42× its 64K run's"
                                                    " tokens/s; the planner predicts 0.59×")


@pytest.mark.parametrize("row, reference", [
    ((2, 65536), (1, 32768)),
    pytest.param((4, 131072), (1, 32768), marks=_CP4_MISSED),
    pytest.param((8, 262144), (1, 32768), marks=_CP4_MISSED),
    pytest.param((4, 131072), (2, 65536), marks=_CP4_MISSED),
    ((8, 262144), (4, 131072)),
])
def test_context_parallel_throughput_follows_torchtitans_runs_within_25_percent(row, reference):
    # ratios between runs, so that what the planner does not model alike in all of them (Float8, torch.compile)
    # cancels as far as it can; each (layout, sequence) as torchtitan ran it, priced with the planner's own estimate
    predicted = (_torchtitan_context_parallel_estimate(*row).tokens_per_second_per_device
                 / _torchtitan_context_parallel_estimate(*reference).tokens_per_second_per_device)
    published = TORCHTITAN_CONTEXT_PARALLEL[row] / TORCHTITAN_CONTEXT_PARALLEL[reference]
    assert predicted / published == pytest.approx(1, abs=0.25), (predicted, published)


def test_torchtitans_context_parallel_runs_fit_and_long_sequences_are_split_as_torchtitan_split_them():
    hardware = HARDWARE["h100-96gb-500w"]
    for cp, seq_len in TORCHTITAN_CONTEXT_PARALLEL:
        assert _torchtitan_context_parallel_estimate(cp, seq_len).fits, (cp, seq_len)  # torchtitan: about 84 GiB
    # given torchtitan's batch (a sequence per data rank), the planner's best layout at 128K and 256K tokens is
    # torchtitan's: the sequence split over cp ranks, recomputing every block
    for cp, seq_len in ((4, 131072), (8, 262144)):
        best = plan(MODELS["llama3-8b"].replace(seq_len=seq_len), hardware, 8, 8 // cp)[0]
        assert (best.dp, best.pp, best.tp, best.cp, best.recompute) == (8 // cp, 1, 1, cp, True), best.describe()
        assert f"tp=1 cp={cp} zero=" in best.describe()
    long = MODELS["llama3-8b"].replace(seq_len=131072)
    # one 128K sequence's activations do not fit one GPU (its fp32 logits alone need 134 GB) ...
    assert not plan(long, hardware, 8, 8, dp=8)[0].fits
    # ... and without cp the planner splits the blocks over tp instead, at more traffic: slower
    blocks, split = plan(long, hardware, 8, 2, cp=1)[0], plan(long, hardware, 8, 2)[0]
    assert blocks.fits and blocks.tp > 1 and split.cp > 1
    assert split.tokens_per_second_per_device > blocks.tokens_per_second_per_device
    # sequences of 8K tokens or fewer are split only when cp is given
    short = plan(MODELS["llama3-8b"], HARDWARE["h100"], 64, 512)
    assert {c.cp for c in short} == {1} and "cp=" not in short[0].describe()
    assert {c.cp for c in plan(MODELS["llama3-8b"], HARDWARE["h100"], 64, 512, cp=2)} == {2}


def test_a_deep_tensor_parallel_pipeline_fits_without_recomputation_as_in_megatron():
    # Megatron 462B's published layout (dp=48 pp=16 tp=8, 16 microbatches in flight on the first stage) fits
    # without recomputation because a block keeps its sequence-parallel projection inputs split and gathers them
    # again in backward, as Megatron-Core does: at tp=8 every value a block keeps is split, 16·h/8 per token.
    # Kept gathered (2·h + 14·h/8: PyTorch's autograd alone) the same layout would need recomputation.
    model, h100 = MODELS["megatron-462b"], HARDWARE["h100"]
    assert model.activation_values_per_token(8) == pytest.approx(16 * model.hidden / 8)
    kept = plan(model, h100, 6144, 3072, dp=48, pp=16, tp=8, recompute=False)[0]
    assert kept.fits, kept.describe()
    micro_batch, in_flight = 3072 // 48 // kept.microbatches, 16
    gathered_more = (2 * model.hidden - 2 * model.hidden / 8) * model.seq_len * micro_batch * h100.activation_bytes
    assert kept.memory_bytes + gathered_more * model.layers / 16 * in_flight > kept.memory_limit


def test_fixed_sizes_that_cannot_work_fail_naming_the_constraints():
    with pytest.raises(PlanError, match="tp must divide heads=64") as error:
        plan(MODELS["llama3-70b"], HARDWARE["h100"], 24, 48, tp=3)
    assert "Nearest layouts that work: dp=6 pp=1 tp=4" in str(error.value), str(error.value)
    # the searches for a device count or batch that would work stay near the value given: a global batch of
    # 10⁷ with an impossible tp tried 1.5·10⁷ batches before the bound
    tried = []
    assert _nearest(10**7, lambda n: tried.append(n) and False) == []
    assert min(tried) == 10**7 - 4096 and max(tried) == 10**7 + 4096 and len(tried) == 2 * 4096
    assert _nearest(10, lambda n: n % 4 == 0) == [8, 12]
    # cp gives each rank two of 2·cp equal chunks of the sequence; experts split over ep compose with it
    with pytest.raises(PlanError, match="2·cp·tp must divide the sequence length 8192") as error:
        plan(MODELS["llama3-8b"], HARDWARE["h100"], 24, 48, cp=3)
    assert "Nearest layouts that work: " in str(error.value)
    assert plan(MODELS["mixtral-8x7b"].replace(seq_len=32768), HARDWARE["h100"], 64, 64, cp=2, ep=2)[0].cp == 2


def test_the_schedule_virtual_stages_and_microbatches_given_are_what_it_plans_with():
    model, h100 = MODELS["llama3-70b"], HARDWARE["h100"]
    free = plan(model, h100, 64, 128, pp=4, tp=8)
    # 1F1B, and Interleaved1F1B with 2 virtual stages or any count that splits the 80 layers evenly over 4 ranks
    assert {(c.schedule, c.virtual_stages) for c in free} == {("1f1b", 1), *(("interleaved1f1b", v)
                                                                           for v in (2, 4, 5, 10, 20))}
    assert len({c.microbatches for c in free}) > 1
    for given, pairs in (({"schedule": "gpipe"}, {("gpipe", 1)}), ({"virtual_stages": 4}, {("interleaved1f1b", 4)}),
                         ({"schedule": "zbvzerobubble"}, {("zbvzerobubble", 2)})):
        assert {(c.schedule, c.virtual_stages) for c in plan(model, h100, 64, 128, pp=4, tp=8, **given)} == pairs
    assert {c.microbatches for c in plan(model, h100, 64, 128, pp=4, tp=8, microbatches=8)} == {8}
    # interleaving takes any multiple of pp microbatches (torch's rounds of pp), fewer than pp·v too, as NeMo ran
    # Llama 2 70B: 20 virtual stages on each of 4 ranks over 32 microbatches
    assert {c.microbatches for c in plan(model, h100, 64, 128, pp=4, tp=8, virtual_stages=20)} == {4, 8, 16, 32, 64}
    # the V and zero-bubble schedules take one per stage (torch's DualPipeV refuses fewer; with data parallelism the
    # zero-bubble ones lose weight gradients)
    for schedule in ("dualpipev", "zbvzerobubble", "interleavedzerobubble"):
        assert {c.microbatches for c in plan(model, h100, 64, 128, pp=4, tp=8, schedule=schedule)} == {8, 16, 32, 64}
    # GPipe runs all forwards first: its first stage holds every microbatch's activations, 1F1B's only pp of them
    one_f_one_b, gpipe = (plan(model, h100, 64, 128, pp=4, tp=8, zero=1, recompute=False, microbatches=16,
                               schedule=schedule)[0] for schedule in ("1f1b", "gpipe"))
    assert gpipe.rank_activations[0] == pytest.approx(4 * one_f_one_b.rank_activations[0])
    with pytest.raises(PlanError, match="microbatches=3 must divide a pipelined replica's batch"):
        plan(model, h100, 64, 128, pp=4, tp=8, microbatches=3)


def test_a_split_naming_where_stages_begin_fixes_the_stages_and_the_blocks_each_rank_runs():
    model, h100 = MODELS["llama3-70b"], HARDWARE["h100"]
    even = (10,) * 8
    # 8 stages in all: pp=2 × 4, pp=4 × 2 or pp=8 × 1, interleaved where a rank holds more than one; no layout
    # without a pipeline
    fixed = plan(model, h100, 64, 128, tp=8, stage_blocks=even)
    assert {(c.pp, c.schedule, c.virtual_stages) for c in fixed} == {
        (2, "interleaved1f1b", 4), (4, "interleaved1f1b", 2), (8, "1f1b", 1)}
    # with the schedule given, the pp that makes them under it; with pp given, its stages a rank
    assert {(c.pp, c.virtual_stages) for c in plan(model, h100, 64, 128, tp=8, stage_blocks=even,
                                                  schedule="gpipe")} == {(8, 1)}
    assert {(c.pp, c.virtual_stages) for c in plan(model, h100, 64, 128, tp=8, stage_blocks=even,
                                                  schedule="zbvzerobubble")} == {(4, 2)}
    assert {c.virtual_stages for c in plan(model, h100, 64, 128, pp=2, tp=8, stage_blocks=even)} == {4}
    with pytest.raises(PlanError, match="pp × virtual stages must make the split's 8 stages"):
        plan(model, h100, 64, 128, pp=4, tp=8, virtual_stages=4, stage_blocks=even)
    for bad in ((80,), (40, 39), (40, 40, 0)):
        with pytest.raises(PlanError, match=re.escape(f"stage_blocks={list(bad)}: a pipeline's stages are two or")):
            plan(model, h100, 64, 128, stage_blocks=bad)
    # an even split is priced as the planner prices one it chooses; an uneven one by its most loaded rank: 12 blocks
    # on the first of 8 ranks, where the last runs 9 beside the LM head (0.8 of a recomputed block)
    sizes = dict(dp=1, pp=8, tp=8, zero=1, recompute=True, microbatches=16, schedule="1f1b")
    plain = plan(model, h100, 64, 16, **sizes)[0]
    priced = plan(model, h100, 64, 16, stage_blocks=even, **sizes)[0]
    assert (priced.times, priced.memory_bytes, priced.stage_blocks) == (plain.times, plain.memory_bytes, even)
    heavy = plan(model, h100, 64, 16, stage_blocks=(12, 10, 10, 10, 10, 10, 9, 9), **sizes)[0]
    head = model.head_flops_per_token()
    block = (model.executed_flops_per_token() + model.recompute_flops_per_token() - head) / model.layers
    assert head / block == pytest.approx(0.8, abs=0.01)
    # (the kernels between the matmuls, priced by the blocks alone, a few percent of the step, grow by 12/10)
    assert heavy.times["compute"] / plain.times["compute"] == pytest.approx(12 / (10 + head / block), rel=0.02)
    assert heavy.activation_bytes > plain.activation_bytes  # the first rank keeps 12 blocks' inputs, not 10
    # under 1F1B stage s holds pp − s microbatches of its blocks' inputs (12 blocks first: 12 × 8 of them; 12 last:
    # 12 × 1), beside one block's while it is recomputed; the last stage also the fp32 logits and their gradient
    logits = 2 * model.seq_len * model.vocab * 4 / 8
    for stages in ((8, 10, 10, 10, 10, 10, 10, 12), (12, 10, 10, 10, 10, 10, 10, 8)):
        run = plan(model, h100, 64, 16, stage_blocks=stages, **sizes)[0]
        held = [blocks * (8 - rank) for rank, blocks in enumerate(stages)]
        per_block = (run.rank_activations[0] - run.rank_activations[1]) / (held[0] - held[1])
        recomputed = run.rank_activations[0] - per_block * held[0]
        assert run.rank_activations == pytest.approx(
            [per_block * h + recomputed + (logits if rank == 7 else 0) for rank, h in enumerate(held)])

def test_a_balanced_split_is_priced_by_the_blocks_it_gives_each_count_of_stages():
    model, h100 = MODELS["llama3-70b"], HARDWARE["h100"]
    asked = []

    def heavy_first(stages):  # a block more on the first stage, one fewer on the last; None: priced as even
        asked.append(stages)
        even = [model.layers // stages] * stages
        return (even[0] + 1, *even[1:-1], even[-1] - 1) if model.layers % stages == 0 else None

    candidates = plan(model, h100, 64, 128, tp=8, stage_blocks=heavy_first)
    counts = set(asked)
    assert len(asked) == len(counts)  # each count of stages asked once
    assert {c.pp for c in candidates} >= {1, 2, 4, 8}  # nothing fixed: no pipeline too
    for c in candidates:
        assert c.stage_blocks == (heavy_first(c.pp * c.virtual_stages) if c.pp > 1 else None)
    # priced by them: more blocks on the first rank than an even split gives it
    sizes = dict(dp=1, pp=8, tp=8, zero=1, recompute=True, microbatches=16, schedule="1f1b")
    assert (plan(model, h100, 64, 16, stage_blocks=heavy_first, **sizes)[0].times["compute"]
            > plan(model, h100, 64, 16, **sizes)[0].times["compute"])


def test_with_every_size_given_the_winner_is_explained_against_its_next_option():
    model, h100 = MODELS["llama3-70b"], HARDWARE["h100"]
    candidates = plan(model, h100, 64, 128, dp=4, pp=2, tp=8, zero=1, recompute=True, virtual_stages=2)
    winner, runner = candidates[0], candidates[1]
    assert winner.layout == runner.layout == (4, 2, 8, 1, 1)  # dp, pp, tp, ep, cp
    options = sum(c.fits for c in candidates)
    speedup = winner.tokens_per_second_per_device / runner.tokens_per_second_per_device
    assert speedup > 1.005  # more microbatches, a smaller bubble
    assert explain(candidates).startswith(
        f"{winner.describe()} wins among the {options} options that fit for dp=4 pp=2 tp=8: {speedup:.2f}×"
        f" the tokens/s of its next option ({runner.describe()}), which spends")
    # options within 0.5% of each other: level, no cost named
    level = plan(model, h100, 64, 128, dp=4, pp=2, tp=8, microbatches=32, schedule="1f1b", recompute=True)
    assert explain(level) == (f"{level[0].describe()} wins among the 3 options that fit for dp=4 pp=2 tp=8,"
                              f" level with its next option ({level[1].describe()}) to within 0.5%.")


def test_the_explanation_counts_the_layouts_that_do_not_fit():
    model, h100 = MODELS["llama3-70b"], HARDWARE["h100"]
    assert explain(plan(model, h100, 1024, 512)).endswith(" 1 other layout does not fit in memory.")
    assert explain(plan(model, h100, 64, 128)).endswith(" other layouts do not fit in memory.")


@pytest.mark.parametrize("request_, message", [
    ({"world": 0}, "world=0: a layout needs a whole number of devices"),
    ({"microbatches": 0}, "microbatches=0: a layout needs a whole number of microbatches"),
    ({"schedule": "dualpipe"}, "Unknown pipeline schedule 'dualpipe'; choose one of"),
    ({"global_batch": 0}, "global_batch=0: a layout needs a whole number of sequences"),
    ({"tp": 0}, "tp=0 is not a valid size"),
    ({"cp": 0}, "cp=0 is not a valid size"),
    ({"zero": 4}, "zero=4 is not a ZeRO stage: choose 0"),
])


def test_sizes_no_layout_could_have_fail_naming_the_value(request_, message):
    arguments = {"world": 16, "global_batch": 32, **request_}
    with pytest.raises(PlanError, match=message):
        plan(MODELS["llama3-8b"], HARDWARE["h100"], arguments.pop("world"), arguments.pop("global_batch"),
             **arguments)


def test_a_world_without_a_layout_names_the_nearest_worlds_and_batches():
    # 1000 = 8·125: no tp·pp·dp split has dp dividing 512 with pp ≤ 80
    model, h100 = MODELS["llama3-70b"], HARDWARE["h100"]
    with pytest.raises(PlanError) as error:
        plan(model, h100, 1000, 512)
    assert ("992 or 1,008 devices would have one with this batch. A global batch of 510 or 515 would on 1,000"
            " devices.") in str(error.value), str(error.value)
    for world, batch in ((992, 512), (1008, 512), (1000, 510), (1000, 515)):
        assert plan(model, h100, world, batch)


def test_nothing_fitting_is_reported_not_chosen_and_the_fewest_devices_that_fit_named(capsys):
    model, h100 = MODELS["llama3-405b"], HARDWARE["h100"]
    candidates = plan(model, h100, 8, 512)
    assert not any(c.fits for c in candidates)
    # the table shows the nearest misses: smallest memory first
    table = format_plan(candidates, top=3).splitlines()
    assert table[1].startswith(min(candidates, key=lambda c: c.memory_bytes).describe())
    fewest = fewest_devices(model, h100, 8, 512)
    # 16 nodes: on 14 (dp=1 pp=14 tp=8) the MixedPrecision callback's bf16 copies do not fit beside the fp32 state
    assert fewest.fits and fewest.world == 128, fewest.describe()

    def fits(world):
        try:
            return plan(model, h100, world, 512)[0].fits
        except PlanError:
            return False

    assert not any(fits(world) for world in range(16, 128, 8))  # whole nodes below it: none fits
    assert main(["plan", "--model", "llama3-405b", "--gpus", "8", "--global-batch", "512"]) == 1  # none fits
    assert f"Llama 3.1 405B fits from 128 devices: {fewest.describe()}" in capsys.readouterr().out
    # from one device too, though 128 is more than 64 times as many
    assert main(["plan", "--model", "llama3-405b", "--gpus", "1", "--gpu", "a100", "--json", "--top", "1"]) == 1
    assert "Llama 3.1 405B fits from 128 devices: dp=" in capsys.readouterr().err  # beside the JSON rows
    assert main(["plan", "--model", "llama3-405b", "--gpus", "8", "--global-batch", "0"]) == 2
    assert "global_batch=0: a layout needs a whole number of sequences" in capsys.readouterr().err


def test_what_would_fit_on_the_same_devices_is_named_each_change_alone():
    model, fp32 = MODELS["megatron-1.7b"], HARDWARE["h100"].replace(**precision_bytes("32-true"))
    assert not plan(model, fp32, 1, local_batch=8)[0].fits
    hint = same_devices_hint(model, fp32, 1, local_batch=8)
    changes = [('MixedPrecision("bf16")', fp32.replace(**precision_bytes("32-true", torch.bfloat16)), 8),
               ("a batch of 4 per replica and accumulate_grad_batches=2", fp32, 4),  # the largest that fits
               ("Offload(optimizer=False, activations_every_n_blocks=1)", fp32.replace(offload_activations=1.0), 8),
               ("Offload()", fp32.replace(offload_optimizer=True), 8)]
    rates = []
    for change, hardware, batch in changes:
        best = plan(model, hardware, 1, local_batch=batch)[0]
        rate = f"{_format_rate(best.tokens_per_second_per_device)} tokens/s per device)"
        assert best.fits and f"{change} as {best.describe()} (" in hint and rate in hint, (change, hint)
        rates.append((best.tokens_per_second_per_device, hint.index(change)))
    in_order = [rate for rate, _ in sorted(rates, key=lambda pair: pair[1])]
    assert in_order == sorted(in_order, reverse=True) and in_order[-1] < in_order[0]  # fastest first
    assert hint.startswith("On this device it fits with ") and hint.endswith("tokens/s per device).")
    # within what the run fixed: each remedy keeps it
    kept = same_devices_hint(model, fp32, 1, local_batch=8, fixed={"zero": 1, "recompute": False})
    layouts = [part.split(" as ")[1].split(" (")[0] for part in kept.split("; or ")]
    assert layouts and all("zero=1" in layout and "recompute" not in layout for layout in layouts), kept
    # a CPU's memory is the host's: offloading frees none of it
    assert "Offload" not in same_devices_hint(model, fp32, 1, local_batch=8, offload=False)
    assert same_devices_hint(MODELS["megatron-7.1b"], fp32, 1, local_batch=16) == ""  # nothing would
    # what the run already does stays: its gradient accumulation, its Offload callback's choices; autocast
    # (fp32 parameters) is not told to add the MixedPrecision callback, which it cannot run beside
    assert "a batch of 4 per replica and accumulate_grad_batches=6 as" in same_devices_hint(
        model, fp32, 1, local_batch=8, accumulating=3)
    halfway = same_devices_hint(model, fp32.replace(offload_activations=0.5), 1, local_batch=8)
    assert "optimizer=True in the Offload callback as" in halfway
    assert "activations_every_n_blocks=1 in the Offload callback as" in same_devices_hint(
        MODELS["llama3-70b"], fp32.replace(offload_optimizer=True), 8, local_batch=16)
    autocast = HARDWARE["h100"].replace(**precision_bytes("bf16-mixed"))
    assert "MixedPrecision" not in same_devices_hint(model, autocast, 1, local_batch=16)


def test_what_is_offloaded_must_fit_the_hosts_memory(capsys):
    model, offloaded = MODELS["llama3-405b"], HARDWARE["h100"].replace(offload_optimizer=True)
    # a node's 2 TB cannot hold 405B parameters' fp32 master copy, gradients and Adam moments (16 bytes each)
    candidates = plan(model, offloaded, 8, 512)
    assert not any(c.fits for c in candidates)
    on_device = [c for c in candidates if c.memory_bytes <= c.memory_limit]
    assert on_device and all(c.host_bytes > c.host_limit == 230.4e9 for c in on_device)  # the host refuses them
    assert "of host memory per device, of 230.4 GB usable." in format_plan(candidates)
    roomy = plan(model, offloaded.replace(host_memory=1000e9), 8, 512)[0]
    assert roomy.fits and roomy.host_bytes > 230.4e9
    assert main(["plan", "--model", "llama3-405b", "--gpus", "8", "--offload-optimizer", "--host-memory", "1000"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "host/rank" in table[1] and table[2].startswith(roomy.describe()) and table[2].endswith("yes")
    # without ZeRO every data rank keeps the whole of its stage's state on the host
    unsharded, sharded = (estimate(MODELS["llama3-70b"], offloaded, 8, 16, 2, 2, 2, 1, zero, 8, 1, True)
                          for zero in (0, 1))
    assert unsharded.host_bytes == pytest.approx(2 * sharded.host_bytes)


def test_pcie_cards_keep_tensor_parallelism_off_their_slower_links():
    # the same 64 devices over NVLink split each block over 8; over PCIe, no block is split
    model = MODELS["llama3-70b"]
    assert plan(model, HARDWARE["h100"], 64, 512)[0].tp == 8
    assert plan(model, HARDWARE["h100-pcie"], 64, 512)[0].tp == 1


def test_command_line(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "16", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "Llama 3 8B" in out and "wins" in out
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--json", "--top", "3"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3 and all(r["fits"] for r in rows)
    assert main(["plan", "--model", "llama3-70b", "--gpus", "24", "--tp", "3"]) == 2
    assert "tp must divide" in capsys.readouterr().err
    # what the run will use is fixed too: the schedule, microbatches and recomputation
    pipelined = ["plan", "--model", "llama3-70b", "--gpus", "64", "--pp", "4", "--tp", "8", "--json"]
    # (none of these fits: exit status 1, the rows still estimated)
    assert main([*pipelined, "--schedule", "gpipe", "--microbatches", "16", "--recompute", "no"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert {(r["schedule"], r["microbatches"], r["recompute"]) for r in rows} == {("gpipe", 16, False)}
    fixed = [*pipelined, "--zero", "1", "--microbatches", "16", "--recompute", "no", "--virtual-stages", "1"]
    assert main(fixed) == 1
    (gathered_again,) = json.loads(capsys.readouterr().out)
    assert main([*fixed, "--keep-gathered-inputs"]) == 1
    (kept,) = json.loads(capsys.readouterr().out)
    assert kept["layout"] == gathered_again["layout"] and kept["memory_bytes"] > gathered_again["memory_bytes"]
    # and the precision: fp32 keeps twice the bytes of bf16 per parameter copy and activation value
    assert main([*fixed, "--precision", "32-true"]) == 1
    (fp32,) = json.loads(capsys.readouterr().out)
    assert fp32["layout"] == gathered_again["layout"] and fp32["memory_bytes"] > 1.3 * gathered_again["memory_bytes"]
    # bf16 "true" precision keeps no fp32 state: 7 bytes per parameter where the MixedPrecision callback keeps 12
    # (bf16 copy, fp32 master shard, fp32 gradients and moments; ZeRO-1 over 2 ranks), most of it once blocks recompute
    recomputed = [*pipelined, "--zero", "1", "--global-batch", "32", "--microbatches", "16", "--recompute", "yes"]
    runs = {}
    for precision in ("bf16", "bf16-true"):
        assert main([*recomputed, "--precision", precision]) == 0
        (runs[precision],) = json.loads(capsys.readouterr().out)
    assert runs["bf16-true"]["memory_bytes"] < 0.7 * runs["bf16"]["memory_bytes"]
    # 405B fits no layout of 64 H100s, unless the optimizer state waits in host memory
    big = ["plan", "--model", "llama3-405b", "--gpus", "64", "--json", "--top", "1"]
    for flags, fits in (([], False), (["--offload-optimizer"], True), (["--offload-activations", "1"], False)):
        assert main([*big, *flags]) == (0 if fits else 1)
        assert json.loads(capsys.readouterr().out)[0]["fits"] is fits, flags
    with pytest.raises(SystemExit):
        main([*big, "--offload-activations", "2"])
    assert "give a share between 0 and 1" in capsys.readouterr().err


def test_command_line_says_how_to_train_the_best_layout_in_arguments_that_build(capsys):
    """The last line the table prints is the Trainer call that runs the winner: the devices on each node, the
    strategy with every size (so that nothing is planned again at fit), the accumulation, the precision,
    compression and offloading it was planned with; each call builds its strategy and callbacks."""
    import meshlight as ml
    from meshlight.callbacks import ActivationCompression, MixedPrecision, Offload

    def built(line: str) -> dict:
        call = line[line.index("Trainer("):].rpartition("), each")[0] + ")"
        return eval(call, {"Trainer": dict, "Hybrid3DStrategy": ml.Hybrid3DStrategy,  # noqa: S307 (our own output)
                           "MixedPrecision": MixedPrecision, "Offload": Offload,
                           "ActivationCompression": ActivationCompression})

    cases = (
        (["--model", "llama3-8b", "--gpus", "8"], "Trainer(devices=8, strategy=", "accumulate_grad_batches=",
         'MixedPrecision("bf16")', "ep=1"),
        (["--model", "llama3-70b", "--gpus", "64", "--pp", "4", "--precision", "bf16-mixed"],
         "Trainer(devices=8, num_nodes=8, strategy=", "schedule=", "precision='bf16-mixed'"),
        (["--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--keep-gathered-inputs"], "keep_gathered_inputs=True"),
        (["--model", "mixtral-8x7b", "--gpus", "64"], "ep=", "MixedPrecision"),
        # split experts under tp are named: left out, the strategy would fold them
        (["--model", "mixtral-8x7b", "--gpus", "64", "--expert-layout", "split", "--tp", "2", "--ep", "2"],
         "experts='split'"),
        (["--model", "llama3-8b", "--gpus", "64", "--seq", "131072"], "cp=", "MixedPrecision"),
        (["--model", "llama3-405b", "--gpus", "64", "--offload-optimizer"], "zero=", "Offload(optimizer=True)"),
        (["--model", "llama3-70b", "--gpus", "64", "--offload-activations", "0.5"],
         "Offload(optimizer=False, activations_every_n_blocks=2)"),
        (["--model", "llama3-8b", "--gpus", "8", "--compress-activations", "fp8_e4m3", "--grad-compression", "bf16"],
         "ActivationCompression('fp8_e4m3')", "grad_compression='bf16'"),
        (["--model", "llama3-8b", "--gpus", "8", "--precision", "32-true", "--float32-matmul-precision", "high"],
         "Train it (after torch.set_float32_matmul_precision('high')): Trainer(", "precision='32-true'"),
    )
    for argv, *expected in cases:
        assert main(["plan", *argv, "--top", "1"]) == 0
        line = capsys.readouterr().out.splitlines()[-1]
        assert line.startswith("Train it") and all(e in line for e in expected), line
        strategy = built(line)["strategy"]
        assert isinstance(strategy, ml.Hybrid3DStrategy) and not strategy._planning, line
        assert main(["plan", *argv, "--top", "1", "--json"]) == 0
        (row,) = json.loads(capsys.readouterr().out)  # the winner's sizes, as the table's first row
        assert all(f"{key}={row[key]}" in line for key in ("dp", "pp", "tp", "ep", "zero")), (row, line)
        assert f"recompute={row['recompute']}" in line
    # the callback offloads every n-th block: a share that is not 1/n is refused, naming the nearest
    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama3-8b", "--gpus", "8", "--offload-activations", "0.65"])
    assert "a share of 1/n: give 1, 0.5, 0.333, 0.25, … (the nearest: 0.5)" in capsys.readouterr().err


def test_command_line_splits_long_sequences_over_cp_ranks_unless_cp_is_fixed(capsys):
    long = ["plan", "--model", "llama3-8b", "--gpus", "64", "--seq", "131072"]
    assert main(long) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("Llama 3 8B (seq 131072, global batch 32) on 64 × NVIDIA H100 SXM 80GB")
    assert all(" cp=" in row for row in table[2:7]), table  # the five best layouts split the sequence
    assert main([*long, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert all(row["cp"] > 1 and f"cp={row['cp']}" in row["layout"] and row["times"]["cp"] > 0 for row in rows)
    assert main([*long, "--cp", "1", "--json"]) == 0
    assert {row["cp"] for row in json.loads(capsys.readouterr().out)} == {1}
    assert main([*long, "--cp", "3"]) == 2
    assert "2·cp·tp must divide the sequence length 131072" in capsys.readouterr().err


def test_command_line_plans_a_model_given_by_its_shape_as_it_plans_the_same_preset(capsys):
    llama = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--ffn", "14336",
             "--vocab", "128256", "--mlp", "swiglu", "--seq", "8192"]
    runs = []
    for model in (["--model", "llama3-8b"], llama):
        assert main(["plan", *model, "--gpus", "16", "--json", "--top", "4"]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0] == runs[1]
    # flags change a preset (and its name says so); device memory and peak are flags too
    assert main(["plan", "--model", "llama3-8b", "--layers", "64", "--gpus", "16", "--gpu-memory", "24",
                 "--peak-tflops", "165", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Llama 3 8B with layers=64 (seq 8192, global batch 512) on 16 × NVIDIA H100 SXM 80GB"
                          " with 24 GB, 165 TFLOP/s"), out
    assert main(["plan", "--model", "llama3-8b", "--gpus", "16", "--gpu-memory", "24", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)  # what fits, fits in 24 GB (less the planner's headroom)
    assert rows and all(r["memory_bytes"] <= 0.9 * 24e9 for r in rows if r["fits"])
    for argv, message in ((["--layers", "8"], "--hidden, --heads, --vocab missing"),
                          (["--model", "llama3-8b", "--heads", "30"], "--heads 30 must divide --hidden 4096"),
                          (["--model", "llama3-8b", "--kv-heads", "3"], "--kv-heads 3 must divide --heads 32"),
                          (["--model", "llama3-8b", "--gpu-memory", "0"], "--gpu-memory 0: give a number > 0")):
        with pytest.raises(SystemExit):
            main(["plan", *argv, "--gpus", "8"])
        assert message in capsys.readouterr().err


def test_command_line_plans_a_hugging_face_config_as_it_plans_the_same_preset(capsys, tmp_path, monkeypatch):
    """``--config``: a Hugging Face model's config.json or litgpt's model_config.yaml (or the folder holding it), the
    model built on the meta device and read as the strategies read a module: Llama 3 8B's and Mixtral 8x7B's configs
    plan as their presets do, but that each pipeline rank is priced by the blocks the strategy's split gives its
    stages at fit (a preset's are even): Llama's embedding and head outweigh a block, Mixtral's do not."""
    transformers = pytest.importorskip("transformers")
    from meshlight import cli
    from meshlight.models import model_from_config
    from meshlight.parallel.pipeline import stage_blocks_of

    shape = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8)
    transformers.LlamaConfig(**shape, vocab_size=128256).save_pretrained(tmp_path / "llama")
    transformers.MixtralConfig(**shape, vocab_size=32000, num_local_experts=8,
                               num_experts_per_tok=2).save_pretrained(tmp_path / "mixtral")
    priced = []
    monkeypatch.setattr(cli, "plan", lambda *args, **options: priced.append(options) or plan(*args, **options))
    for preset, config, seq, split in (("llama3-8b", tmp_path / "llama", "8192", (7, 9, 9, 7)),
                                       ("mixtral-8x7b", tmp_path / "mixtral" / "config.json", "4096", (8,) * 4)):
        runs = []
        for model in (["--model", preset], ["--config", str(config)]):
            assert main(["plan", *model, "--seq", seq, "--gpus", "64", "--pp", "1", "--json", "--top", "4"]) == 0
            runs.append(json.loads(capsys.readouterr().out))
        assert runs[0] == runs[1], preset
        assert "stage_blocks" not in priced[-2] and priced[-1]["stage_blocks"](4) == split
        assert stage_blocks_of(model_from_config(str(config)))(4) == split  # as Hybrid3DStrategy prices them
    # shape flags change it, as they change a preset (its split no longer applies); a path without a config fails
    # before planning
    assert main(["plan", "--config", str(tmp_path / "llama"), "--layers", "16", "--gpus", "8", "--top", "1"]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out and "stage_blocks" not in priced[-1]
    for argv, message in ((["--config", str(tmp_path / "none")], "no such file or folder"),
                          (["--config", str(tmp_path)], "no Hugging Face config there"),
                          (["--config", str(tmp_path / "llama"), "--model", "llama3-8b"], "not allowed with")):
        with pytest.raises(SystemExit):
            main(["plan", *argv, "--gpus", "8"])
        assert message in capsys.readouterr().err
    # litgpt's model_config.yaml (or its checkpoint folder): Llama 3 8B's as the preset
    litgpt = pytest.importorskip("litgpt")
    (tmp_path / "lit").mkdir()
    (tmp_path / "lit" / "model_config.yaml").write_text(
        yaml.safe_dump(dataclasses.asdict(litgpt.Config.from_name("Llama-3-8B"))))
    runs = []
    for model in (["--model", "llama3-8b"], ["--config", str(tmp_path / "lit")]):
        assert main(["plan", *model, "--seq", "8192", "--gpus", "64", "--pp", "1", "--json", "--top", "4"]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0] == runs[1] and priced[-1]["stage_blocks"](4) == (7, 9, 9, 7)
    (tmp_path / "other.yaml").write_text("n_layers: 2\n")
    with pytest.raises(SystemExit):
        main(["plan", "--config", str(tmp_path / "other.yaml"), "--gpus", "8"])
    assert "not a litgpt model config" in capsys.readouterr().err


def test_an_moe_model_is_planned_with_tp_its_experts_split_over_it_or_folded_into_ep():
    model, h100 = MODELS["mixtral-8x7b"], HARDWARE["h100"]
    with_tp = [c for c in plan(model, h100, 64, 1024) if c.tp > 1 and c.ep > 1]
    assert {c.experts for c in with_tp} == {"split", "fold"}
    assert all(c.ep % c.tp == 0 for c in with_tp if c.folded) and all(c.dp % c.ep == 0 for c in with_tp if not c.folded)
    assert {c.experts for c in plan(model, h100, 64, 1024, experts="split")} == {"split"}
    # the same sizes both ways: folded, each tp rank sends its 1/tp of the tokens, and holds twice the expert shards
    split, fold = (estimate(model, h100, 64, 1024, 32, 1, 2, 8, 1, 32, 1, False, experts=x) for x in ("split", "fold"))
    assert fold.times["ep"] < split.times["ep"] and fold.model_state_bytes > split.model_state_bytes
    assert fold.describe().startswith("dp=32 pp=1 tp=2 ep=8 (folded)")
    assert fold.strategy_arguments()["experts"] == "fold"
    # under context parallelism too (the cp ranks hold the same experts)
    long = [c for c in plan(model.replace(seq_len=32768), h100, 64, 64, cp=2, tp=2) if c.folded]
    assert long and all(c.cp == 2 and c.ep % c.tp == 0 for c in long)
    assert long[0].strategy_arguments()["cp"] == 2


def test_meshlight_plan_lists_folded_moe_layouts_and_fixes_the_expert_layout_asked(capsys):
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--tp", "2", "--top", "8"]) == 0
    assert "ep=8 (folded)" in capsys.readouterr().out
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--tp", "2", "--ep", "8", "--expert-layout",
                 "split", "--json", "--top", "3"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(row["experts"] == "split" and row["ep"] == 8 and "folded" not in row["layout"] for row in rows)


def test_ep_given_for_a_dense_model_is_refused_saying_it_has_no_experts():
    with pytest.raises(PlanError, match=r"ep=2 splits experts, and Llama 3 8B has none: leave ep out"):
        plan(MODELS["llama3-8b"], HARDWARE["h100"], 8, 64, ep=2)


def test_hybrid_3d_leaves_the_expert_layout_to_the_planner_unless_one_is_named():
    import meshlight as ml

    assert ml.Hybrid3DStrategy(experts="auto")._experts_given is None
    assert ml.Hybrid3DStrategy()._experts_given is None
    assert ml.Hybrid3DStrategy(experts="fold")._experts_given == "fold"
