"""Tensor parallelism reproduces single-process training — tp=2 on 2 processes, tp=4 and tp=2 × dp=2 on 4,
with and without sequence parallelism, for meshlight's GPT (also with its embedding and LM head tied: one weight,
sharded over the vocabulary for both), a GPT-2 laid out as nanoGPT lays it out (a ModuleDict namespace around the
blocks, tied weights, learned positions) and a Llama-shaped LightningModule under the
automatic plan, a dict plan and its own configure_model(), the Llama with a gate Linear no column→row group holds
(left whole: under sequence parallelism it reads each rank's share, and its gradient is summed over the shares), the
Llama with a norm over each head of q and k (each rank normalizes its heads; the gradients are summed), the
Llama with modules outside its blocks that no role describes (a factorized embedding's projection, a transform
before the LM head: sequence parallelism covers the blocks only, the rest runs on the whole sequence), and
Adafactor over tp × dp shards — shards its
layers to 1/tp per rank, reduces partial-sum gradients once per step, and keeps dropout consistent."""

import functools
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Shard

from tests.launch import torchrun
from tests.strategies.llama import LitLlama, LitLlamaParallelizedByUser
from tests.strategies.parity import VARIANTS, assert_parity, train
from tests.strategies.workers import bad_tp_worker, tensor_worker

WORKER = Path(tensor_worker.__file__)
RUNS = [(world, run) for world in (2, 4) for run in tensor_worker.runs(world)]


@pytest.fixture(scope="module")
def controls() -> dict:
    out = {}
    for model, (factory, _) in tensor_worker.MODELS.items():
        out[(model, "adamw")] = train("adamw", model=LitLlama if factory is LitLlamaParallelizedByUser else factory)
    out[("gpt", "clip")] = train("clip", model=tensor_worker.lit_gpt)
    adafactor_gpt = functools.partial(tensor_worker.lit_gpt, **VARIANTS["adafactor"][0])
    out[("gpt", "adafactor")] = train("adafactor", model=adafactor_gpt)
    for variant in ("adamw-foreach", "adamw-single"):
        out[("gpt", variant)] = train(variant, model=functools.partial(tensor_worker.lit_gpt, **VARIANTS[variant][0]))
    return out


@pytest.fixture(scope="module")
def distributed(tmp_path_factory) -> dict:
    results = {}
    for world in (2, 4):
        out = tmp_path_factory.mktemp("tensor") / f"{world}.pt"
        torchrun(WORKER, world, str(out), str(world))
        results[world] = torch.load(out, weights_only=False)
    return results


@pytest.mark.parametrize(("world", "run"), RUNS, ids=[f"{w}proc-{r[0]}-{r[1]}-{'sp' if r[2] else 'nosp'}-{r[3]}"
                                                       for w, r in RUNS])
def test_tensor_parallel_matches_single_process_training(distributed, controls, world, run):
    layout, model, sequence_parallel, variant = run
    assert_parity(distributed[world][run], controls[(model, variant)])


@pytest.mark.parametrize(("world", "run"), RUNS, ids=[f"{w}proc-{r[0]}-{r[1]}-{'sp' if r[2] else 'nosp'}-{r[3]}"
                                                       for w, r in RUNS])
def test_no_gradient_is_a_partial_sum_when_the_optimizer_steps(distributed, world, run):
    result = distributed[world][run]
    assert len(result["partial_gradients"]) == 20 and not any(result["partial_gradients"])
    # each rank's gradient holds its parameter's values (the vocabulary-sharded embedding's: its rows alone; also
    # asserted by every parity check)
    assert len(result["gradients_unlike_parameters"]) == 20 and not any(result["gradients_unlike_parameters"])
    if run[3] == "adafactor":  # the norms of all parameters, then of all updates: 3 all-reduces each (those
        # sharded over dp and tp, those over dp only); the rest DTensor's, for the factored moments. With one
        # norm per parameter the step issued 88 (32 more than now).
        assert result["step_collectives"] == [56] * 20
    elif run[3] != "clip":  # then the optimizer reduces nothing: its step is local (clipping sums norms)
        assert result["step_collectives"] == [0] * 20


def test_partial_gradients_are_reduced_as_dtensor_would_in_one_all_reduce_per_dtype_and_reduction(distributed):
    # cases: sum fp32 (two shapes), average fp32, sum fp64
    assert distributed[2]["partial_gradient_reduction"] == {"equal": True, "replicated": True, "all_reduce_calls": 3}


def test_the_vocabulary_parallel_embedding_gives_each_rank_its_rows_gradient_and_keeps_the_padding_row_still(
        distributed):
    # 9 rows over tp=2 (5 + 4), the padding row (6) on the second rank: the output and each rank's rows of the
    # gradient are exactly the whole embedding's, placed as the weight (torch's row-parallel style: the whole
    # vocabulary's, replicated)
    for rank, result in enumerate(distributed[2]["vocab_embedding"]):
        assert result == {"output": True, "placements": (Shard(0),), "gradient": True, "padding_row_zero": True}, rank


def test_a_norm_over_a_colwise_output_reduces_its_statistics_over_tp_and_refuses_another_width(distributed):
    # OLMo 2's q and k norms over all heads (trained under tp in test_hf_models): each rank's share of the output, its
    # vectors sharded alike, equals the whole norm's in float64 — torch's LayerNorm and RMSNorm run op by op
    result = distributed[2]["colwise_norms"]
    for name, (plain_output, difference) in result["differences"].items():
        assert plain_output and difference < 1e-12, (name, difference)
    assert re.fullmatch(r"norm \(ElementwiseRMSNorm\) is a norm as wide as a column-parallel projection's output"
                        r" beside it \(16\), which tensor parallelism splits so: it must read this rank's 1/2 of"
                        r" that output, \[\.\.\., 8\], and it was given a 3-D tensor \(2, 3, 16\)\. A norm of the"
                        r" module's input .* belongs outside the module that holds the projections .*",
                        result["refusal"]), result["refusal"]


def test_a_learned_activation_between_the_projections_sums_its_gradient_over_tp_and_refuses_another_input(
        distributed):
    # Apertus's xIELU (trained under tp in test_hf_models): each rank's scalar gradient is its hidden units' part
    result = distributed[2]["interior"]
    assert result["difference"] < 1e-12, result["difference"]
    assert re.fullmatch(r"1 \(LearnedScale\) holds parameters beside a tensor-parallel group, so meshlight takes it"
                        r" for a module between the group's projections \(a learned activation\): it must read this"
                        r" rank's 12 of the 24 hidden units the output projection reads, \[\.\.\., 12\], and it was"
                        r" given a 3-D tensor \(2, 3, 16\)\. Give it a role .*", result["refusal"]), result["refusal"]
    assert re.fullmatch(r"1 has the role 'interior' .* but the model holds no 'rowwise' projection beside it .*",
                        result["no_writer"]), result["no_writer"]


@pytest.mark.parametrize("keep", [False, True], ids=["gathered-again", "kept-gathered"])
@pytest.mark.parametrize("name", list(tensor_worker.ACTIVATION_CONFIGS))
def test_the_planners_activation_memory_is_what_autograd_saves_per_block(distributed, name, keep):
    # by default the column-parallel projections' inputs are kept as this rank's share and gathered again in
    # backward; with keep_gathered_inputs they stay whole
    from meshlight.parallel.planner import ModelSpec

    for tp in (1, 2):
        if tp == 1:
            measured, config = tensor_worker.saved_activation_values(name, 1)
        else:
            measured = distributed[2]["saved_activations"][(name, keep)]
        spec = ModelSpec.from_gpt_config(config).replace(keep_gathered_inputs=keep)
        predicted = spec.activation_values_per_token(tp) / config.dim
        # the formula leaves out what is per token and head rather than per value (norm scales, softmax sums)
        assert predicted == pytest.approx(measured, rel=0.02), (tp, predicted, measured)


@pytest.mark.parametrize("name", list(tensor_worker.ACTIVATION_CONFIGS))
def test_the_planners_bytes_per_activation_value_are_what_autograd_saves_under_each_precision(name):
    # per token: the growth from 2 to 4 sequences (autocast also saves each weight's bf16 cast, once per forward)
    from meshlight.parallel.planner import AUTOCAST_ACTIVATION_BYTES, ModelSpec

    for autocast, bytes_per_value, tolerance in ((False, 4, 0.02), (True, AUTOCAST_ACTIVATION_BYTES, 0.1)):
        ((_, two), config), ((_, four), _) = (tensor_worker.saved_activations(name, sequences=n, autocast=autocast)
                                              for n in (2, 4))
        measured = (four - two) / (2 * 64 * config.dim)
        predicted = ModelSpec.from_gpt_config(config).activation_values_per_token(1) / config.dim * bytes_per_value
        assert measured <= predicted * 1.02 and predicted == pytest.approx(measured, rel=tolerance), (
            autocast, predicted, measured)


def test_clipping_engages_in_the_clipped_control(controls):
    assert max(controls[("gpt", "clip")]["grad_norms"]) > 1.0


@pytest.mark.parametrize(("world", "tp"), [(2, 2), (4, 4)])
def test_each_rank_holds_one_tp_th_of_the_sharded_layers(distributed, world, tp):
    measured = [r["sharded_fraction"] for key, r in distributed[world].items() if isinstance(key, tuple)
                and "sharded_fraction" in r]
    assert measured and all(fraction == pytest.approx(1 / tp) for fractions in measured for fraction in fractions)


def test_dropout_agrees_across_tensor_ranks_and_differs_across_data_ranks(distributed):
    outputs = distributed[4]["dropout"]  # ranks 0, 1 hold data-parallel replica 0; ranks 2, 3 replica 1
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[2], outputs[3])
    assert not torch.allclose(outputs[0], outputs[2])


def test_dropout_agrees_outside_the_blocks_and_differs_inside_them_when_sequence_parallelism_covers_only_them(
        distributed):
    # outside, the activations are whole on every tp rank: separate streams (as when the embedding hands on shares)
    # drew different masks, and the replicated weights drifted apart (0.22 after 20 steps, in a probe); inside, each
    # rank holds other tokens, whose masks must not repeat; recomputation replays a block's masks
    assert distributed[2]["blocks_only_dropout"] == {"outside_weights_agree": True, "block_draws_differ": True,
                                                     "outside_draws_agree": True, "recompute_replays": True}


def test_a_synced_sum_counts_each_data_replica_once_and_decisions_are_taken_over_the_world(distributed):
    # tp2 × dp2, 4 sequences per replica: 8 in a step, not 16 (each tensor-parallel rank's copy counted)
    assert distributed[4]["synced_sums"] == [{"sequences": 8.0, "any": True, "all": False}] * 4


def test_a_plain_auxiliary_loss_added_to_the_loss_parallel_loss_fails_saying_what_to_call(distributed):
    error, *notes = distributed[2]["mixed_tensor_notes"]
    assert error == "aten.mul.Tensor got mixed torch.Tensor and DTensor"
    assert "Call loss.full_tensor() (or logits.full_tensor()) before combining them with plain tensors" in notes[0]
    assert "give it a role in the tensor-parallel plan (the strategy's plan= or tp_plan=)" in notes[1]
    assert len(notes) == 2


def test_a_tp_that_does_not_divide_the_heads_fails_on_every_rank_before_training():
    result = torchrun(Path(bad_tp_worker.__file__), 2, timeout=120, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "training started" not in output
    for rank in (0, 1):
        assert f"[rank{rank}]: meshlight.parallel.tensor_plan.TensorParallelError: tp=2 does not divide" in output
    assert "choose tp in [1]" in output
