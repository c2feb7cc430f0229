"""The planner's cost model: its model state formula is meshlight's (ZeRO on FSDP2) at every precision and
offload, offloaded activations stop growing with depth, collective latency follows NCCL's ring, and offload and
fp32 matmuls cost what the host's links and torch's matmul precision give."""

import json
import math
import types

import pytest
import torch

from meshlight.cli import main
from meshlight.parallel.cost_model import (
    _bandwidth,
    _ring_latency,
    estimate,
    host_state_bytes,
    model_state_bytes,
    precision_bytes,
)
from meshlight.parallel.planner import best_per_layout, plan
from meshlight.parallel.presets import GB, HARDWARE, MODELS, ModelSpec, detect_hardware

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


@pytest.mark.parametrize("world", [1, 4])
def test_model_state_follows_the_precision_and_what_is_offloaded(world):
    psi, block, root = 1000, 100, 50
    # bf16 "true" precision: every copy, gradient and moment in 16 bits, half of fp32's bytes whatever the stage
    bf16_true = CPU.replace(**precision_bytes("bf16-true"))
    for zero in (0, 1, 2, 3):
        for pipelined in (False, True):
            fp32 = model_state_bytes(psi, world, zero, CPU, pipelined=pipelined, block=block, root=root)
            half = model_state_bytes(psi, world, zero, bf16_true, pipelined=pipelined, block=block, root=root)
            assert half == pytest.approx(fp32 / 2)
    # MixedPrecision: FSDP2 runs even on one data rank, bf16 compute copies beside the fp32 master parameters
    mixed = CPU.replace(**precision_bytes("32-true", torch.bfloat16))
    expected = 2 * psi + 4 * psi / world + 4 * psi + 8 * psi / world  # copy, master shard, gradients, moments
    assert model_state_bytes(psi, world, 1, mixed) == pytest.approx(expected)
    # optimizer offload: the device keeps the gathered parameters, and gradients whole until they are reduced
    offload = CPU.replace(offload_optimizer=True)
    assert model_state_bytes(psi, world, 1, offload, block=block) == 8 * psi
    assert model_state_bytes(psi, world, 2, offload, block=block) == 4 * psi + 4 * block
    assert model_state_bytes(psi, world, 3, offload, block=block, root=root) == 4 * (2 * block + root) + 4 * block
    assert model_state_bytes(psi, world, 3, offload, pipelined=True) == 8 * psi


def test_frozen_parameters_keep_no_gradient_or_optimizer_state_and_skip_their_weight_gradients(capsys):
    """A LoRA fine-tune trains a small share of the parameters: the frozen rest holds its parameters (and, under
    FSDP, their master shards) alone, backward computes no weight gradient for it (a third of its matmuls' FLOPs),
    and the data-parallel reductions carry the trainable share's gradients. So Llama 3 70B, which does not fit on
    8 H100s trained whole (16 bytes a parameter: 140 GB a rank), fits with 1% of it trainable."""
    psi, world, quarter = 1000, 4, 0.25
    assert model_state_bytes(psi, 1, 0, CPU, trainable=quarter) == 4 * psi + 12 * quarter * psi
    assert model_state_bytes(psi, world, 3, CPU, trainable=quarter) == pytest.approx((4 + 12 * quarter) * psi / world)
    assert model_state_bytes(psi, world, 1, CPU, trainable=quarter) == pytest.approx(
        4 * psi + 4 * quarter * psi + (4 + 8 * quarter) * psi / world)  # gathered, whole gradients, master, moments
    model = MODELS["llama3-8b"]
    frozen = model.replace(trainable=0.0)
    assert frozen.executed_flops_per_token() == pytest.approx(
        model.executed_flops_per_token() - 2 * model.active_params)
    h100 = HARDWARE["h100"]
    whole, lora = (estimate(model.replace(trainable=share), h100, 8, 64, 8, 1, 1, 1, 3, 8, 1, False)
                   for share in (1.0, 0.01))
    assert lora.times["compute"] < whole.times["compute"] and lora.times["dp"] <= whole.times["dp"]
    assert lora.memory_bytes < whole.memory_bytes
    # under optimizer offload the host holds every master shard, and of the trainable share gradients and moments;
    # frozen shards travel in for the gathers but send no gradient out and take no host step
    assert host_state_bytes(psi, world, 3, CPU.replace(offload_optimizer=True), trainable=quarter) == pytest.approx(
        (1 + 3 * quarter) * 4 * psi / world)
    whole, lora = (estimate(model.replace(trainable=share), h100.replace(offload_optimizer=True), 8, 64, 8, 1, 1, 1,
                            3, 8, 1, False) for share in (1.0, 0.01))
    assert lora.host_bytes == pytest.approx(whole.host_bytes * (1 + 3 * 0.01) / 4)
    assert 0 < lora.times["host"] < whole.times["host"]
    for share, status in ((1, 1), (0.01, 0)):
        assert main(["plan", "--model", "llama3-70b", "--gpus", "8", "--trainable", str(share)]) == status
    capsys.readouterr()


def test_activations_offloaded_from_every_block_do_not_grow_with_depth():
    def activations(layers: int, share: float) -> float:
        model = MODELS["llama3-8b"].replace(layers=layers)
        hardware = HARDWARE["h100"].replace(offload_activations=share)
        # the first rank's, which holds the most micro-batches
        return estimate(model, hardware, 8, 64, 1, 4, 2, 1, 0, 16, 1, False).rank_activations[0]

    assert activations(64, 1.0) == pytest.approx(activations(32, 1.0))
    assert activations(32, 0.0) > 3 * activations(32, 1.0)
    # every other block: half of them kept, beside the two blocks' worth in transit that offloading all of them keeps
    assert activations(32, 0.5) == pytest.approx(activations(32, 0.0) / 2 + activations(32, 1.0))


def test_context_parallel_ranks_hold_a_share_of_the_activations_and_shard_state_as_data_ranks_do():
    # 8 GPUs, 8 sequences of 32K: dp=8, or dp=4 × cp=2 accumulating 2 micro-batches (one sequence each either way)
    model, h100 = MODELS["llama3-8b"].replace(seq_len=32768), HARDWARE["h100"]
    # what one layer's attention keeps beyond its tokens' values: the K and V it gathered over the whole sequence,
    # repeated to the query heads for the GPU's kernels (which apply the chunks' causal masks without building them)
    gathered = 2 * model.seq_len * model.heads * model.head_dim * 2

    def run(dp, cp, zero=3, recompute=False):
        return estimate(model, h100, 8, 8, dp, 1, 1, 1, zero, 8 // dp, 1, recompute, cp=cp)

    for zero in (0, 1, 2, 3):  # ZeRO shards over dp × cp; without it the cp ranks keep whole replicas, as dp's do
        assert run(4, 2, zero).model_state_bytes == run(8, 1, zero).model_state_bytes
    # each rank keeps half the tokens' values (its fp32 logits included) and what every layer gathered ...
    assert run(4, 2).activation_bytes == pytest.approx(run(8, 1).activation_bytes / 2 + model.layers * gathered)
    # ... under recomputation the block inputs, halved, and one layer's activations while it is recomputed
    assert run(4, 2, recompute=True).activation_bytes == pytest.approx(run(8, 1, recompute=True).activation_bytes / 2
                                                                       + gathered)
    # the same tokens per rank: the same compute (the causal work balanced), and gradients reduced over dp × cp
    # (ZeRO-1: once per step, however many micro-batches)
    assert run(4, 2).times["compute"] == pytest.approx(run(8, 1).times["compute"])
    assert run(4, 2, zero=1).times["dp"] == pytest.approx(run(8, 1, zero=1).times["dp"])
    assert run(8, 1).times["cp"] == 0 and "cp=" not in run(8, 1).describe() and "cp=2" in run(4, 2).describe()


@pytest.mark.parametrize("cp, tp", [(2, 1), (8, 1), (4, 2), (16, 1), (8, 2)])
def test_context_parallel_exchanges_the_whole_sequences_kv_over_the_links_cp_spans(cp, tp):
    # per layer and micro-batch: K and V all-gathered in forward, again when recomputed, their gradients
    # reduce-scattered in backward; (cp−1)/cp of the whole sequence's K/V each, two ring collectives, none hidden
    model, h100 = MODELS["llama3-8b"].replace(seq_len=131072), HARDWARE["h100"]
    world = 2 * cp * tp
    kv = 2 * model.seq_len * model.kv_heads * model.head_dim / tp * h100.activation_bytes
    # cp sits next to tp in the mesh; across nodes the group's members on a node send over their NICs together
    link = h100.intra_bandwidth if cp * tp <= 8 else min(8 // tp, cp) * h100.inter_bandwidth
    assert _bandwidth(h100, cp, tp) == link
    for recompute, exchanges in ((False, 2), (True, 3)):
        candidate = estimate(model, h100, world, 4, 2, 1, tp, 1, 3, 2, 1, recompute, cp=cp)
        expected = model.layers * 2 * exchanges * ((cp - 1) / cp * kv / link + 2 * _ring_latency(h100, cp, tp))
        assert candidate.times["cp"] == pytest.approx(expected)
    if cp * tp <= 8:  # within a node, at 128K tokens, attention's compute (the sequence's square) dwarfs it
        assert candidate.times["cp"] < 0.03 * candidate.times["compute"]


def test_collective_latency_follows_the_ring_as_nccl_models_it():
    h100 = HARDWARE["h100"]
    # a base, then one hop per ring step: 7 NVLink hops within a node; across 192 nodes (one rank each: stride
    # 8) 191 network hops; 2 ranks per node on 64 nodes: 64 NVLink and 63 network hops
    assert _ring_latency(h100, 8, 1) == pytest.approx(h100.latency + 7 * h100.hop_latency_intra)
    assert _ring_latency(h100, 192, 8) == pytest.approx(h100.latency + 191 * h100.hop_latency_inter)
    assert _ring_latency(h100, 128, 4) == pytest.approx(h100.latency + 64 * h100.hop_latency_intra
                                                        + 63 * h100.hop_latency_inter)
    assert _ring_latency(HARDWARE["cpu"], 8, 1) == HARDWARE["cpu"].latency  # gloo on one host: the base alone


def test_offload_costs_its_host_copies_beyond_compute_and_the_host_step(capsys):
    model = MODELS["megatron-1.7b"]
    h100 = HARDWARE["h100"].replace(devices_per_node=1)

    def run(hardware, dp=1, zero=2, microbatches=1, recompute=False):
        return estimate(model, hardware, dp, 8 * dp, dp, 1, 1, 1, zero, microbatches, 1, recompute)

    plain, activations = run(h100), run(h100.replace(offload_activations=1.0))
    assert plain.times["host"] == 0
    # every block's saved activations go out in forward and come back in backward, each copy hidden behind its
    # phase's compute (a third of it in forward without recomputation) as far as it goes
    moved = plain.activation_bytes - 2 * 4096 * 8 * model.vocab * 4  # less the logits, which stay
    link = moved / h100.host_bandwidth
    compute = plain.times["compute"]
    assert activations.times["host"] == pytest.approx(max(0, link - compute / 3) + max(0, link - 2 * compute / 3))
    assert activations.times["host"] > 0.5 * compute  # PCIe is ~60× slower than HBM: offload is not free
    wider = run(h100.replace(offload_activations=1.0, host_bandwidth=1e15))
    assert wider.times["host"] == 0 and wider.step_time == plain.step_time
    # under optimizer offload the host steps every parameter of its shard after backward, which nothing hides
    stepped = run(h100.replace(offload_optimizer=True, host_bandwidth=1e15))
    assert stepped.times["host"] == pytest.approx(model.params / h100.host_step_rate, rel=1e-5)  # but a norm
    # its master shard comes in for the gather and its gradient goes out: 4 bytes per parameter each way
    # on more host threads it steps faster, until the devices of a node share out its host memory bandwidth:
    # AdamW reads the master copy, the gradient and two moments and writes three back, 28 bytes per parameter
    threaded = run(h100.replace(offload_optimizer=True, host_bandwidth=1e15, host_threads=2))
    assert threaded.times["host"] == pytest.approx(stepped.times["host"] / 2, rel=1e-5)
    node = h100.replace(host_threads=64, devices_per_node=8)
    assert node.host_steps_per_second(64) == pytest.approx(0.75 * 2 * 8 * 38.4e9 / 8 / 28)  # DDR5 nodes: 461 GB/s
    assert node.host_steps_per_second(64) < 64 * h100.host_step_rate
    assert node.replace(state_bytes=2).host_steps_per_second(64) == pytest.approx(2 * node.host_steps_per_second(64))
    assert node.host_steps_per_second(2) == pytest.approx(4 * node.host_steps_per_second(64))  # 2 devices busy, not 8
    a100 = HARDWARE["a100"].replace(host_threads=64)  # DDR4 nodes: 307 GB/s
    assert a100.host_steps_per_second(8) == pytest.approx(307.2e9 / 8 / 28)
    assert h100.host_steps_per_second(8) == h100.host_step_rate  # one thread unless told or measured at fit
    assert CPU.replace(host_threads=8).host_steps_per_second(2) == math.inf  # CPU processes: no host step
    narrow = run(h100.replace(offload_optimizer=True, host_bandwidth=1e9))
    copies = 4 * model.params / 1e9
    assert narrow.times["host"] == pytest.approx(stepped.times["host"] + 2 * copies - compute, rel=1e-5)
    # ZeRO divides the host's step over the data ranks; without it every rank steps the whole model
    sharded, whole = (run(h100.replace(offload_optimizer=True, devices_per_node=8), 8, zero) for zero in (1, 0))
    assert sharded.times["host"] < whole.times["host"] / 7
    assert best_per_layout(plan(model, h100.replace(offload_optimizer=True, devices_per_node=8), 8, 64))[0].zero
    # accumulating 4 micro-batches: ZeRO-1 copies the shard in once and its gradient out once; ZeRO-2 sends the
    # gradient out after each, FSDP2 synchronously but for the last (3 exposed copies); ZeRO-3 also brings the
    # shard in again for each micro-batch's forward (3 more) and backward (4 copies less the root unit's, which
    # stays gathered from forward to backward, where ZeRO-2 had 1: 3 more, less 4 of the root's); ZeRO-0, on FSDP2
    # under offload, keeps its parameters gathered between micro-batches as ZeRO-1 does
    one, two, three, none = (run(h100.replace(offload_optimizer=True, host_bandwidth=1e9), 1, zero, 4).times["host"]
                             for zero in (1, 2, 3, 0))
    root = 4 * (model.embedding_params + model.head_params) / 1e9
    assert two == pytest.approx(one + 3 * copies, rel=1e-5)
    assert three == pytest.approx(two + 6 * copies - 4 * root, rel=1e-5)
    assert none == pytest.approx(one, rel=1e-5)
    # `meshlight plan` takes the host's link and step rate
    offloaded = ["plan", "--model", "llama3-8b", "--gpus", "8", "--offload-optimizer", "--offload-activations", "1",
                 "--zero", "1", "--tp", "1", "--pp", "1", "--recompute", "no", "--json"]
    steps = {}
    for flags in ([], ["--host-step-rate", "11"], ["--host-bandwidth", "5.44"], ["--host-threads", "2"],
                  ["--host-threads", "64"], ["--host-threads", "64", "--host-memory-bandwidth", "2000"]):
        assert main([*offloaded, *flags]) == 0
        steps[tuple(flags)] = json.loads(capsys.readouterr().out)[0]["times"]["host"]
    default, faster, narrower, two, many, wider_memory = steps.values()
    assert faster < default < narrower and wider_memory < many < two < default
    for flag in ("--host-bandwidth", "--host-threads"):
        with pytest.raises(SystemExit):
            main([*offloaded, flag, "0"])
        assert f"{flag} 0: give a number > 0" in capsys.readouterr().err
    # on CPU processes offload moves nothing and the step is the one every run takes: no cost
    assert estimate(model, CPU.replace(offload_optimizer=True, offload_activations=1.0), 2, 4, 2, 1, 1, 1, 1, 1, 1,
                    False).times["host"] == 0


def test_the_kernels_between_the_matmuls_stream_the_activations_at_the_memory_bandwidth(capsys):
    h100, model = HARDWARE["h100"], MODELS["llama3-8b"]

    def compute(hardware, spec=model, recompute=False):
        return estimate(spec, hardware, 8, 16, 8, 1, 1, 1, 3, 2, 1, recompute).times["compute"]

    matmuls = compute(h100.replace(memory_bandwidth=math.inf))
    tokens = 16 * 8192 / 8  # this rank's
    # four passes over what autograd saves (bf16: 2 bytes a value) in each of the 32 blocks; the fp32 logits' four
    streamed = tokens * (4 * model.activation_values_per_token(1) * 2 * 32 + 4 * 4 * model.vocab) / 3.35e12
    assert compute(h100) - matmuls == pytest.approx(streamed)
    assert compute(h100.replace(memory_bandwidth=3.35e12 / 2)) - matmuls == pytest.approx(2 * streamed)
    recomputed = tokens * (5 * model.activation_values_per_token(1) * 2 * 32 + 4 * 4 * model.vocab) / 3.35e12
    assert compute(h100, recompute=True) - compute(h100.replace(memory_bandwidth=math.inf), recompute=True) == (
        pytest.approx(recomputed))
    assert 0.05 < streamed / matmuls < 0.15  # Llama 3 8B: about a tenth of its matmuls' time

    def share(spec):
        return 1 - compute(h100.replace(memory_bandwidth=math.inf), spec) / compute(h100, spec)

    # the passes grow with the width and the matmuls with its square: a model a quarter as wide loses more to them
    narrow = model.replace(hidden=1024, heads=8, kv_heads=2, ffn_hidden=3584, seq_len=2048)
    assert share(narrow) > 2 * share(model.replace(seq_len=2048))
    # the command line takes another device memory's bandwidth
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--memory-bandwidth", "1675"]) == 0
    assert "NVIDIA H100 SXM 80GB with 1675 GB/s device memory" in capsys.readouterr().out


def test_a_pipeline_runs_at_its_most_loaded_ranks_pace_the_last_with_the_lm_head_or_a_fuller_first():
    # GPT-OSS 120B's shape: a 201,088-token vocabulary over 36 layers of width 2880, whose LM head's matmul weighs
    # about 3.6 layers' (Megatron-Bridge's published run splits the layers evenly, the head on the last stage)
    model = ModelSpec(36, 2880, 64, 8, 2880, vocab=201088, seq_len=4096, experts=128, top_k=4, head_size=64)
    matmuls_only = HARDWARE["h100"].replace(memory_bandwidth=math.inf)

    def compute(pp, virtual_stages=1, recompute=False):
        return estimate(model, matmuls_only, 64, 512, 64 // pp, pp, 1, 1, 1, 8 * virtual_stages,
                        virtual_stages, recompute).times["compute"]

    head = model.head_flops_per_token()
    for recompute in (False, True):  # the blocks' forward again, not the head's
        blocks = model.executed_flops_per_token() + (model.recompute_flops_per_token() if recompute else 0) - head
        assert compute(4, recompute=recompute) / compute(1, recompute=recompute) == pytest.approx(
            (blocks + 4 * head) / (blocks + head))
    # the most loaded rank's v stages of ceil(36 / (pp·v)) layers: 5 × 4 = 20 of them at pp=2 and v=5, not 36/2
    blocks = model.executed_flops_per_token() - head
    assert compute(2, 5) / compute(1) == pytest.approx(2 * (blocks * 20 / 36 + head) / (blocks + head))
    # a first stage that must hold 4 of 28 layers (Qwen3-VL's deepstack) at pp=4 × v=7: its rank runs 6 + 4 = 10
    fed = model.replace(layers=28, vocab=1000, first_stage_layers=4, experts=0)
    fed_blocks = (fed.executed_flops_per_token() - fed.head_flops_per_token()) / 28
    first_rank = estimate(fed, matmuls_only, 64, 512, 16, 4, 1, 1, 1, 28, 7, False).times["compute"]
    one_rank = estimate(fed, matmuls_only, 64, 512, 64, 1, 1, 1, 1, 1, 1, False).times["compute"]
    assert first_rank / one_rank == pytest.approx(4 * fed_blocks * 10 / fed.executed_flops_per_token())
    assert model.recompute_flops_per_token() == pytest.approx(
        2 * (model.active_params - model.head_params) + 4 * 36 * 64 * 64 * 4096)


def test_fp32_matmuls_run_at_the_rate_torchs_float32_matmul_precision_gives(capsys, monkeypatch):
    h100, model = HARDWARE["h100"], MODELS["llama3-8b"]
    matmuls_alone = {"memory_bandwidth": math.inf}  # the kernels between them streaming at no cost
    fp32 = h100.replace(**precision_bytes("32-true"))
    assert h100.compute_flops == h100.replace(**precision_bytes("bf16-mixed")).compute_flops == 989e12
    assert fp32.compute_flops == 67e12  # torch's default "highest": off the tensor cores
    assert fp32.replace(float32_matmul_precision="high").compute_flops == 989e12 / 2  # TF32
    assert CPU.compute_flops == CPU.peak_flops  # a CPU's fp32 is its peak

    def compute(hardware):
        return estimate(model, hardware, 8, 16, 8, 1, 1, 1, 3, 2, 1, True).times["compute"]

    assert compute(fp32.replace(**matmuls_alone)) == pytest.approx(compute(h100.replace(**matmuls_alone)) * 989 / 67)
    # the command line takes the setting, and the fp32 run's MFU (against the bf16 peak) shows what it costs
    rows = {}
    for setting in ("highest", "high"):
        assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--precision", "32-true", "--zero", "3", "--json",
                     "--float32-matmul-precision", setting, "--memory-bandwidth", "1e15"]) == 0
        rows[setting] = json.loads(capsys.readouterr().out)[0]
    assert rows["highest"]["times"]["compute"] == pytest.approx(rows["high"]["times"]["compute"] * 989 / 2 / 67,
                                                                rel=1e-6)
    assert rows["highest"]["mfu"] < 0.05
    # a fit reads the GPU and the process's setting
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30))
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    detected = detect_hardware(torch.device("cuda", 0), 8).replace(**precision_bytes("32-true"))
    assert detected.name == h100.name and detected.compute_flops == 989e12 / 2


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_compressed_gradients_halve_the_reduction_bytes_and_leave_the_gathers(zero):
    # 64 ranks over 8 nodes: the data-parallel traffic runs on the slower links and is exposed past backward's compute
    model, hardware = MODELS["llama3-8b"], HARDWARE["h100"]

    def dp_time(compression: float) -> float:
        candidate = estimate(model, hardware.replace(gradient_compression=compression), 64, 64, 64, 1, 1, 1, zero, 1,
                             1, False)
        return candidate.times["dp"]

    uncompressed, bf16 = dp_time(1.0), dp_time(0.5)
    assert bf16 < uncompressed
    if zero == 0:  # an all-reduce of gradients only: its bytes halve, its latency stays
        assert bf16 < 0.6 * uncompressed


def test_the_command_line_plans_compressed_reductions(capsys):
    fixed = ["plan", "--model", "llama3-8b", "--gpus", "64", "--dp", "64", "--tp", "1", "--pp", "1", "--zero", "0",
             "--json", "--top", "1"]
    runs = {}
    for flags in ([], ["--grad-compression", "bf16"]):
        main([*fixed, *flags])
        (runs[bool(flags)],) = json.loads(capsys.readouterr().out)
    assert runs[True]["step_seconds"] < runs[False]["step_seconds"]


def test_each_pipeline_rank_is_priced_with_its_own_state_and_activations():
    # Llama 3 8B over 4 stages of 8 blocks, 1F1B, 16 micro-batches of 4 sequences, tp=2
    model, hardware = MODELS["llama3-8b"], HARDWARE["h100"]
    run = estimate(model, hardware, 8, 64, 1, 4, 2, 1, 1, 16, 1, False)
    # the embedding on the first rank, the head (as large) on the last, blocks alone between
    ends = run.rank_state[0] - run.rank_state[1]
    assert ends > 0 and run.rank_state[3] - run.rank_state[1] == pytest.approx(ends)
    assert run.rank_state[1] == run.rank_state[2]
    # stage s holds 4 − s micro-batches of its blocks' activations; the last also the fp32 logits and their gradient
    per_microbatch = run.rank_activations[1] - run.rank_activations[2]
    logits = 2 * model.seq_len * 4 * model.vocab * 4 / 2
    assert run.rank_activations == pytest.approx([4 * per_microbatch, 3 * per_microbatch, 2 * per_microbatch,
                                                  per_microbatch + logits])
    # interleaving 2 stages of 4 blocks a rank, as torch's schedule runs it: rank r runs (v−1)·pp + 2·(pp−1−r) + 1
    # stage forwards before its first backward, 11, 9, 7 and 5 (the first rank's 5.5 micro-batches: Korthikanti's)
    interleaved = estimate(model, hardware, 8, 64, 1, 4, 2, 1, 1, 16, 2, False).rank_activations
    assert interleaved == pytest.approx([forwards / 2 * per_microbatch + (logits if forwards == 5 else 0)
                                         for forwards in (11, 9, 7, 5)])
    # stages of unequal blocks take their turns, a round of pp micro-batches each (torch's order): over 2 ranks and 4
    # micro-batches rank 0 (stages of 4 and 8 blocks) runs forwards of 4, 4, 8, 8, 4 blocks before its first
    # backward, 28 held, its most; rank 1 (12 and 8) runs 12, 12, 8 (32), frees an 8, then takes a 12 while the
    # other 8 still waits: 36 at its peak, not at its first backward
    def interleaved_by(stage_blocks):
        return estimate(model, hardware, 8, 64, 4, 2, 2, 1, 1, 4, 2, False, stage_blocks=stage_blocks).rank_activations

    even, uneven = interleaved_by((8, 8, 8, 8)), interleaved_by((4, 12, 8, 8))
    per_block = even[0] / 40  # 5 forwards of 8 blocks
    assert uneven[0] == pytest.approx(28 * per_block) and uneven[1] - even[1] == pytest.approx((36 - 24) * per_block)
    # the layout's peak is its most loaded rank's: here the first, without the last rank's logits
    assert run.memory_bytes == max(s + a for s, a in zip(run.rank_state, run.rank_activations))
    assert run.memory_bytes == pytest.approx(run.rank_state[0] + 4 * per_microbatch)
    # GPipe runs every forward first, the loss's included: the last rank keeps every micro-batch's fp32 logits
    gpipe = estimate(model, hardware, 8, 64, 1, 4, 2, 1, 1, 16, 1, False, schedule="gpipe").rank_activations
    assert gpipe[3] - gpipe[0] == pytest.approx((16 + 1) / 2 * logits)
    # an encoder beside the decoder is the first rank's alone
    encoded = estimate(model.replace(encoder_params=10**8), hardware, 8, 64, 1, 4, 2, 1, 1, 16, 1, False)
    assert encoded.rank_state[0] > run.rank_state[0] and encoded.rank_state[1:] == run.rank_state[1:]
    # V placement (2 stages a rank, down and back): the first and the last stage, so the embedding, the head and the
    # logits, are all the first rank's
    v = estimate(model, hardware, 8, 64, 1, 4, 2, 1, 1, 16, 2, False, schedule="zbvzerobubble")
    assert v.rank_state[0] - v.rank_state[1] == pytest.approx(2 * ends)
    assert v.rank_state[1:] == (v.rank_state[1],) * 3
    assert v.rank_activations[0] - v.rank_activations[1] == pytest.approx(logits)
    # a head tied to the embedding: the last stage holds a copy of the token embedding (meshlight's pipeline keeps
    # the two in step), without pipelining it is the embedding
    tied = model.replace(tie_embeddings=True)
    assert estimate(tied, hardware, 8, 64, 1, 4, 2, 1, 1, 16, 1, False).rank_state == run.rank_state
    whole, whole_tied = (estimate(m, hardware, 8, 64, 4, 1, 2, 1, 1, 16, 1, False) for m in (model, tied))
    assert whole_tied.model_state_bytes < whole.model_state_bytes


def test_each_pipeline_rank_holds_the_experts_of_its_own_blocks():
    """DeepSeek-V3's dense first layers (3 of 61) are the first rank's: it holds their wide dense MLPs and the experts
    of its one MoE block, the others the experts of all theirs; the most loaded rank's compute and expert exchanges
    pace the pipeline. A model read from its structure places its experts where its blocks hold them; where every
    layer holds experts, nothing moves."""
    deepseek = ModelSpec(61, 7168, 128, 128, 2048, vocab=129280, seq_len=4096, experts=256, top_k=8, shared_ffn=2048,
                         dense_ffn=18432, moe_count=58)
    assert sorted(deepseek.moe_positions_of()) == list(range(3, 61))
    hardware = HARDWARE["h100"]
    # 1024 GPUs: dp=8 × pp=16 (4 blocks a stage) × tp=8, ep=8 over the data ranks; ZeRO-1
    run = estimate(deepseek, hardware, 1024, 4096, 8, 16, 8, 8, 1, 16, 1, True)

    def state(blocks: int, moe: int, embedding: bool) -> float:
        dense = (deepseek.blocks_params(blocks, moe) + (deepseek.embedding_params if embedding else 0)) / 8
        experts = deepseek.experts * deepseek.mlp_params * moe / 64
        return (model_state_bytes(dense, 8, 1, hardware, pipelined=True)
                + model_state_bytes(experts, 1, 1, hardware, pipelined=True))

    assert run.rank_state[:2] == pytest.approx((state(4, 1, True), state(4, 4, False)))
    assert run.rank_state[0] < run.rank_state[1] == run.rank_state[2]
    # compute per token: a dense block's MLP in place of a block's router, shared expert and 8 routed experts
    dense_mlp, routed = 3 * 7168 * 18432, 7168 * 256 + 3 * 7168 * 2048 + 8 * deepseek.mlp_params
    assert deepseek.layer_flops_per_token(0) - deepseek.layer_flops_per_token(1) == 6 * (dense_mlp - routed)
    all_moe = estimate(deepseek.replace(moe_count=61), hardware, 1024, 4096, 8, 16, 8, 8, 1, 16, 1, True)
    assert all_moe.rank_state[1] == run.rank_state[1]
    # the experts' exchanges pace the pipeline on a rank of 4 MoE blocks, as when all 61 hold experts (not 58/16)
    assert run.times["ep"] == pytest.approx(all_moe.times["ep"])
    # Llama 4 Maverick's experts in every other layer: each of 4 stages of 12 layers holds 6
    maverick = MODELS["llama4-maverick"]
    assert len(set(estimate(maverick, hardware, 512, 2048, 4, 4, 8, 4, 1, 16, 1, True).rank_state[1:3])) == 1
    structured = ModelSpec(4, 64, 4, 4, 32, vocab=128, seq_len=16, experts=4, top_k=2, moe_positions=(1, 3),
                           moe_count=2)
    assert structured.moe_layers == 2 and structured.moe_positions_of() == {1, 3}
    # fewer layers than the structure placed experts in (a shape flag): the last moe_count, as before
    assert structured.replace(layers=3).moe_positions_of() == {1, 2}
    two = estimate(structured, CPU, 2, 8, 1, 2, 1, 1, 0, 4, 1, False).rank_state
    every_other = structured.replace(moe_positions=(), moe_count=0, moe_every=2)
    assert two == estimate(every_other, CPU, 2, 8, 1, 2, 1, 1, 0, 4, 1, False).rank_state
    first = estimate(structured.replace(moe_positions=(2, 3)), CPU, 2, 8, 1, 2, 1, 1, 0, 4, 1, False).rank_state
    assert first[0] < two[0] and first[1] > two[1]


def test_interleaved_activations_are_the_peak_of_torchs_own_order_of_forwards_and_backwards():
    """What ``_blocks_held`` prices under Interleaved1F1B is the most a rank holds as torch's schedule orders its
    forwards and backwards (its ``_calculate_single_rank_operations``), for even and uneven stages."""
    import random
    import types

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    from meshlight.parallel.cost_model import _blocks_held
    from meshlight.parallel.pipeline import stages_of_rank

    random.seed(0)
    for pp, v, m in ((2, 2, 4), (2, 3, 3), (3, 2, 12), (4, 2, 8), (4, 3, 6), (3, 4, 15)):
        rounds = max(1, m // pp)
        for sizes in [(4,) * (pp * v)] + [tuple(random.randint(1, 9) for _ in range(pp * v)) for _ in range(4)]:
            for rank in range(pp):
                order = types.SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds, pp_group_size=pp,
                                              _n_microbatches=m, rank=rank)
                held = peak = 0
                for action in ScheduleInterleaved1F1B._calculate_single_rank_operations(order, rank):
                    if action is not None:
                        forward = action.computation_type == _ComputationType.FORWARD
                        held += sizes[action.stage_index] * (1 if forward else -1)
                        peak = max(peak, held)
                local = [sizes[s] for s in stages_of_rank(rank, pp, v, "interleaved1f1b")]
                assert _blocks_held(rank, local, pp, m, v, "interleaved1f1b") == peak, (pp, v, m, sizes, rank)


def test_compressed_activations_count_their_smaller_bytes_and_never_more():
    model, hardware = MODELS["llama3-8b"], HARDWARE["h100"]

    def activations(**changes) -> tuple[float, float]:
        """The first rank's activations (8 micro-batches of its 4 blocks) and the last's (one, and the logits)."""
        run = estimate(model, hardware.replace(**changes), 8, 64, 1, 8, 1, 1, 0, 16, 1, False)
        return run.rank_activations[0], run.rank_activations[-1]

    (fp32, fp32_last), (fp32_bf16, fp32_bf16_last) = (activations(activation_bytes=4),
                                                      activations(activation_bytes=4, compressed_activations=1.0))
    assert fp32_bf16 == pytest.approx(fp32 / 2)
    # the last rank's fp32 logits and their gradient are not compressed
    logits = 2 * model.seq_len * 4 * model.vocab * 4
    assert fp32_last - fp32 / 8 == pytest.approx(logits) and fp32_bf16_last - fp32_bf16 / 8 == pytest.approx(logits)
    assert activations(activation_bytes=4, compressed_activations=0.5)[0] == pytest.approx(0.75 * fp32)
    assert activations(compressed_activations=1.0) == activations()  # bf16 kept as bf16
    assert activations(compressed_activations=1.0, compressed_activation_bytes=1)[0] == pytest.approx(
        activations()[0] / 2)


@pytest.mark.parametrize("size, stride, expected", [
    (8, 1, 450), (4, 2, 450),  # within a node: NVLink
    (16, 1, 400), (128, 1, 400),  # whole nodes: a ring leaves each node on its 8 NICs at once
    (16, 2, 200), (32, 4, 100), (48, 8, 50), (2, 8, 50),  # 4, 2 and 1 members per node: their NICs
])
def test_a_group_across_nodes_sends_over_its_members_nics_on_each_node(size, stride, expected):
    h100 = HARDWARE["h100"]  # 450 GB/s NVLink, 50 GB/s NIC per GPU, 8 GPUs per node
    assert _bandwidth(h100, size, stride) == expected * GB
    assert _bandwidth(h100.replace(inter_bandwidth=100 * GB), 128, 1) == 450 * GB  # never beyond NVLink
