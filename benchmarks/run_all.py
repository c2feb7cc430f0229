"""Run every benchmark by its documented command and rewrite benchmarks/RESULTS.md from their JSON output.

    python benchmarks/run_all.py      # = make bench
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from common import GPU_CONTEXT, GPU_CUDA_PATHS, GPU_HOST_STEP, GPU_RESULTS, GPU_RESULTS_H200

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

COMMANDS = {
    "comm": "python benchmarks/comm.py --nprocs 2 4",
    "memory": "python benchmarks/memory.py --nprocs 2 4",
    "overhead": "python benchmarks/overhead.py --nprocs 2 --rotations 2 --steps 8",  # ddp zero3 tp pipeline moe loop
    "bubble": "python benchmarks/bubble.py --nprocs 2 4 --microbatches 4 8 16",
    "balance": "python benchmarks/balance.py --steps 500 --window 20 --seeds 3 --jobs 2",
    "planner": "python benchmarks/planner.py --nprocs 4 8",
    "recompute": "python benchmarks/recompute.py --seq 128 --batch 1 --rounds 8 --steps 3",
    "profile": "python benchmarks/step_profile.py --nprocs 2 4",
    "host_step": "python benchmarks/host_step.py --params 25000000 --steps 5 --rounds 3",
    "pretrained": "python benchmarks/pretrained_load.py --nprocs 4",
    "compression": "python benchmarks/compression.py",
    "nvme": "python benchmarks/nvme_offload.py",
    "integrity": "python benchmarks/checkpoint_integrity.py",
    "context": "python benchmarks/context_parallel.py",
    "context_planner": "python benchmarks/context_parallel_planner.py",
    "planner_moe": "python benchmarks/planner_moe.py",
}
#: on a GPU machine: context parallelism's two attention methods on CUDA (written to GPU_CONTEXT)
GPU_CONTEXT_COMMAND = "python benchmarks/context_parallel.py --gpu > benchmarks/gpu_context_parallel.json"
#: on a GPU machine: fp16 loss scaling and Offload on CUDA (written to GPU_CUDA_PATHS)
GPU_CUDA_PATHS_COMMAND = "python benchmarks/cuda_paths.py > benchmarks/gpu_cuda_paths.json"
BELOW_1F1B = ("interleaved1f1b", "interleavedzerobubble", "zbvzerobubble")
#: Run on a GPU machine (`make bench` here has none): the first two write benchmarks/gpu_results.json, the
#: third its host's optimizer step (the planner's host-step figures beside the memory section)
GPU_COMMANDS = ("python benchmarks/gpu.py --section speed --rounds 2 --out benchmarks/gpu_results.json",
                "python benchmarks/gpu.py --section memory --rounds 1 --steps 10 --warmup 5"
                " --out benchmarks/gpu_results.json",
                "python benchmarks/host_step.py --params 400000000 --steps 3 --rounds 2 --optimizers AdamW"
                " > benchmarks/gpu_host_step.json")
#: how the host stepped the optimizer in GPU runs that predate gpu.py recording it
HOST_STEP_BEFORE = "torch's per-parameter loop (the run predates the fused host step)"


def run(command: str) -> object:
    args = command.split()
    args[0] = sys.executable
    started = time.perf_counter()
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"`{command}` failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    print(f"{command}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return json.loads(result.stdout)


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def spread_verdict(rounds: list[float], target: float) -> str:
    """``met`` when every round's ratio meets ``target``, ``**not met**`` when none does, else ``inconclusive``."""
    if max(rounds) <= target:
        return "met"
    return "**not met**" if min(rounds) > target else "inconclusive"


def verdict(ratio: float, target: float) -> str:
    return "met" if ratio <= target else "**not met**"


def comm_section(rows: list[dict]) -> str:
    lines = [
        "## Communication per optimizer step",
        "",
        f"Command: `{COMMANDS['comm']}` — bytes each rank sends in one training step (after warm-up), counted by",
        "instrumenting the collectives actually issued (`meshlight.parallel.CollectiveTraffic`, bandwidth-optimal",
        "cost per collective), divided by theory: 2·P·(N−1)/N for DDP, ZeRO-1 and ZeRO-2, (3·P − R)·(N−1)/N for",
        "ZeRO-3 (P = parameter bytes; R = the root unit's — embedding, head, final norm — which FSDP2 keeps",
        "gathered from forward to backward, as it does for a root by default). Target ≤ 1.05. The last rows are",
        "Lightning's `ddp` with torch's",
        "`ZeroRedundancyOptimizer`, the ZeRO-1 Lightning users have today, against the same 2·P·(N−1)/N.",
        "",
        "| strategy | N | P (bytes) | sent per rank (bytes) | theory (bytes) | ratio | target | collectives (calls) |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in (r for r in rows if not r["strategy"].startswith("tp") and r["strategy"] != "moe"):
        target = "—" if r["strategy"].startswith("lightning") else verdict(r["ratio"], 1.05)
        lines.append(f"| {r['strategy']} | {r['world']} | {r['param_bytes']:,} | {r['bytes_sent']:,.0f} | "
                     f"{r['theory_bytes']:,.0f} | {r['ratio']:.4f} | {target} | {calls(r)} |")
    lines += [
        "",
        "Tensor parallelism, tp = N (no data parallelism), 4-block GPT (dim 128, batch 4 × 64 tokens): per block,",
        "forward and backward each move two all-reduces of the activations A = B·S·H·4 bytes (or the same bytes",
        "as all-gathers + reduce-scatters with sequence parallelism), theory 4 · 2·A·(N−1)/N. With sequence",
        "parallelism meshlight by default gathers the inputs of the two projection groups again in backward",
        "instead of keeping them whole (Megatron-LM's trade: 2·h values per token and block less memory), so its",
        "theory adds 2 · A·(N−1)/N per block; `keep_gathered_inputs=True` is measured against the plain theory.",
        "Per-block bytes are measured as (step bytes with 4 blocks − with 2 blocks) / 2. The whole step is",
        "compared with (4·4 + 2) · 2·A·(N−1)/N (plus the 4 blocks' gathers again): the embedding and LM head add",
        "one such all-reduce each.",
        "",
        "| layout | N | per block (bytes) | theory (bytes) | ratio | target | whole step / theory |"
        " collectives (calls) |",
        "|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in (r for r in rows if r["strategy"].startswith("tp")):
        lines.append(f"| {r['strategy']} | {r['world']} | {r['per_block_bytes']:,.0f} | {r['per_block_theory']:,.0f} | "
                     f"{r['ratio']:.4f} | {verdict(r['ratio'], 1.05)} | {r['step_ratio']:.4f} | {calls(r)} |")
    lines += [
        "",
        "Above theory, with sequence parallelism: the all-reduce of the norms' weight gradients (their weights",
        "are replicated, their inputs sharded); in the whole step: loss parallelism's three reductions of B·S",
        "values. The two 4-byte all-reduces in every step: `self.log(..., sync_dist=True)` of the loss, and the",
        "ranks agreeing whether a SIGTERM or requeue signal arrived (in place of Lightning's per-step broadcast of",
        "rank 0's flag). On CPU, gloo implements reduce-scatter as an all-reduce internally; the table counts what",
        "the program asks for (as NCCL would move it), not gloo's internal traffic.",
        "",
        "Expert parallelism, ep = N (`MoEStrategy`), the same GPT with every MLP a mixture of 8 top-2 experts,",
        "T = 4 × 64 tokens per rank: per MoE layer, dispatch and combine each move T·k·D·(ep−1)/ep elements",
        "forward and the same backward; theory = layers · 4 · T·k·D·(ep−1)/ep · 4 bytes. Measured: all the",
        "all_to_all bytes a rank sends to other ranks in the step, the per-expert count exchanges included.",
        "",
        "| layout | N | MoE layers | all_to_all sent (bytes) | theory (bytes) | ratio | target | calls |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in (r for r in rows if r["strategy"] == "moe"):
        layout = r.get("layout", f"ep={r['ep']}")
        lines.append(f"| {layout} | {r['world']} | {r['moe_layers']} | {r['all_to_all_bytes']:,.0f} | "
                     f"{r['theory_bytes']:,.0f} | {r['ratio']:.4f} | {verdict(r['ratio'], 1.05)} | "
                     f"{r['all_to_all_calls']} |")
    lines += [
        "",
        "The token exchanges move exactly what routing sends off-rank; the ratio departs from 1 by how far the",
        "routing of this step is from uniform (tokens an expert on the rank itself receives never leave it). Under",
        "tp=2 each tp rank routes its replica's whole T tokens: with each expert split over tp, every tp rank sends",
        "all T (theory as above: twice the bytes of the folded layout for the same tokens); folded over the tp ranks",
        "(`experts=\"auto\"` where ep is a multiple of tp), each sends its T/tp, and theory counts T/tp.",
    ]
    return "\n".join(lines)


def balance_section(rows: list[dict]) -> str:
    seeds, steps, window = len(rows[0]["runs"]), rows[0]["steps"], rows[0]["window"]
    lines = [
        "## Expert balance (mixture of experts)",
        "",
        f"Command: `{COMMANDS['balance']}` — the demo task (addition, the example's 2-block dim-128 GPT with",
        "every MLP a mixture of 8 top-2 experts, batch 64; one process per run, two runs side by side with one",
        f"thread each) trained for {steps} steps; an expert's load is the token assignments routed to it over the last",
        f"{window} steps. Figure: max / mean load of the worst layer (1.0 = perfect balance) for each of {seeds} seeds",
        "(routing is chaotic: one seed's figure moves with float rounding, e.g. with the number of threads), their",
        "median, and the median of the mean over the window's steps of each step's own max / mean. Target: MoE's",
        "defaults keep every seed ≤ 1.2; the other rows take a part away or change it.",
        "",
        "| balancing | options over the defaults | seeds | worst max/mean (median) | per-step max/mean | final loss"
        " | target |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        options = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["options"].items())
        per_seed = ", ".join(f"{run['worst']:.3f}" for run in r["runs"])
        target = verdict(r["worst_seed"], 1.2) if r["variant"] == "defaults" else "—"
        lines.append(f"| {r['variant']} | {options or '—'} | {per_seed} | {r['worst']:.3f} | "
                     f"{r['mean_step_imbalance']:.3f} | {r['final_loss']:.3f} | {target} |")
    lines += [
        "",
        "The defaults: the auxiliary loss (coefficient 1e-2) per sequence (`balance=\"sequence\"`; `\"global\"`",
        "counts `f` over every data-parallel rank's micro-batch), and the aux-loss-free expert bias moved after",
        "every step by rate·(mean − load)/mean (`expert_bias_update=\"proportional\"`, rate 1e-2): the full rate for",
        "an idle expert, little for one near its share, so the biases settle instead of stepping past balance. The",
        "bias must move about as fast as the router learns (learning rate 3e-3 here): DeepSeek-V3's 1e-3 lags it over",
        "a run this short. Alone, the aux loss does not balance the demo over the batch or per sequence (12 tokens",
        "each here, a weak and noisy signal); beside the bias, either form does. Single steps stay less balanced",
        "than the window (per-step max/mean above the window's). The final loss is one batch's, noisy from seed to",
        "seed.",
    ]
    return "\n".join(lines)


def planner_section(result: dict) -> str:
    rows = result["published"]
    lines = [
        "## Layout planner against published runs",
        "",
        f"Command: `{COMMANDS['planner']}` — the planner's predicted throughput for the published layout (dp, pp,",
        "tp fixed; ZeRO stage, microbatches, virtual stages and recomputation its own choice) ÷ the published",
        "figure (target 0.75–1.25), and where the published layout ranks among the planner's layouts that fit",
        "(target: top 3). Sources: Megatron-Core's weak-scaling table (r0.8.0, H100, seq 4096) and torchtitan's",
        "Llama 3 benchmarks (the Aug 2024 405B table, Dec 2024 and the Jun 2025 async-TP table, H100 96 GB at 500 W,",
        "seq 8192); see the script's docstring. The planner predicts bf16; the one Float8-only figure (405B on 512",
        "GPUs) is divided by torchtitan's own measured Float8 speedup (1.445×) before the ratio is taken.",
        "",
        "| source | model | GPUs | published layout | metric | published | predicted | ratio | rank | planner's best |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        layout = "dp={dp} pp={pp} tp={tp}".format(**r["published_layout"]) + (f" ({r['note']})" if r["note"] else "")
        ratio_ok = "" if 0.75 <= r["ratio"] <= 1.25 else " **not met**"
        rank_ok = "" if r["rank"] is not None and r["rank"] <= 3 else " **not met**"
        published = f"{r['published']:,}" + (f" (bf16 ≈ {r['bf16_published']:,.1f})"
                                             if r["bf16_published"] != r["published"] else "")
        lines.append(f"| {r['source']} | {r['model']} | {r['gpus']} | {layout} | {r['metric']} | {published} |"
                     f" {r['predicted']:,.1f} | {r['ratio']:.3f}{ratio_ok} | {r['rank'] or '—'}{rank_ok} |"
                     f" {r['best'][0]} |")
    within = sum(0.75 <= r["ratio"] <= 1.25 for r in rows)
    top3 = sum(r["rank"] is not None and r["rank"] <= 3 for r in rows)
    ratios = result["torchtitan_405b_2d_over_3d"]
    two_d = next(r for r in rows if "405" in r["model"] and r["gpus"] == 128)
    lines += ["", f"Within 25%: {within} of {len(rows)}; published layout in the top 3: {top3} of {len(rows)}."]
    for r in (r for r in rows if r["rank"] is None or r["rank"] > 3):
        lines += [
            "",
            f"{r['model']}: the planner ranks `{r['best'][0]}` first, at {r['best_over_published_layout']:.2f}× the"
            " tokens/s it predicts for the published layout."
            + (" torchtitan's own runs of this model point the same way: its 2-D run on the same H100s (FSDP 16 × TP"
               f" 8 on 128 GPUs, the row above, where the planner ranks it {two_d['rank']}) reached"
               f" {ratios['published_float8']:.2f}× the tokens/s per GPU of this 3-D run, both with Float8 and async"
               f" TP, and {ratios['published_bf16']:.2f}× in bf16 (the 3-D figure ÷ 1.445); the planner predicts"
               f" {ratios['predicted']:.2f}× for the two bf16 runs. A 2-D run moves the same ZeRO-3 bytes per GPU"
               " whatever its dp, and at 512 GPUs it has twice the sequences per rank to hide them behind, so"
               " torchtitan's figures put 2-D layouts above this one, as the planner does. No published 405B run"
               f" settles the planner's third, `{r['best'][2]}`, against it."
               if "405" in r["model"] else "")
        ]
    lines += [
        "",
        "The planner models meshlight's engines (ZeRO-2/3 are options; under pipelining PyTorch's schedules keep",
        "parameters gathered and gradients whole until the schedule ends, so ZeRO-2/3 save no memory there); it",
        "often prefers a larger dp with ZeRO where Megatron's weak-scaling runs held dp at 48 by design, and its",
        "top layouts lie within a few percent of each other.",
        "",
        "Memory, same command: the planner's model-state estimate for the most loaded stage ÷ the peak bytes",
        "meshlight holds inside a step (max over ranks; sampled before every module's forward and before every FSDP",
        "unit's post-backward — its gradients whole, the next unit's gather in flight — through the two micro-batches",
        "of an accumulation window), 8-block GPT-tiny on CPU processes, AdamW: fp32, `precision=\"bf16-true\"` (16-bit",
        "gradients and moments too), and the `Offload` callback's optimizer offload (counted: what FSDP2's CPU offload",
        "policy does not keep in host memory — gathered parameters, whole gradients, gather buffers). Target within"
        " 10%.",
        "",
        "| layout | run | processes | measured (bytes) | planner (bytes) | ratio | target |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in result["memory"]:
        ok = "met" if abs(r["ratio"] - 1) <= 0.10 else "**not met**"
        lines.append(f"| {r['layout']} | {r['run']} | {r['world']} | {r['measured_bytes']:,.0f} |"
                     f" {r['predicted_bytes']:,.0f} | {r['ratio']:.3f} | {ok} |")
    return "\n".join(lines + one_gpu_lines(result.get("one_gpu")))


def one_gpu_lines(one: Optional[dict]) -> list[str]:
    """The planner beside one GPU's measured step time and peak memory (gpu.py's memory section)."""
    if one is None:
        return []
    lines = [
        "",
        f"One GPU, same command: the planner's step time and memory beside `{one['command']}` on the"
        f" {one['device']} ({one['date']}; dp=1 zero=2, the MixedPrecision callback, the same model and batch;",
        "measured peak memory against the planner's per-rank estimate). Offload's estimate counts its host copies"
        f" at {one['host_bandwidth'] / 1e9:.1f} GB/s each way, beyond the compute of their phase, and the host's step"
        f" at {one['host_step_rate'] / 1e9:.2f} billion parameters/s per thread, on the run's threads, up to"
        f" {one['host_memory_bandwidth'] / 1e9:.0f} GB/s of host memory traffic (fused AdamW, 28 bytes per parameter)"
        + (f": that machine's host, `{GPU_COMMANDS[2]}` (below)." if one["host_measured"] else ": the preset's."),
        "",
        "| variant | measured step (s) | planner step (s) | of which offload (s) | ratio | measured peak (GB) |"
        " planner (GB) | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for r in one["rows"]:
        comparable = not r["variant"].endswith("offload optimizer") or r["host_step"] is not None
        ratio = f"{r['predicted_step'] / r['measured_step']:.2f}" if comparable else "—"
        threads = f" ({r['host_threads']} host threads)" if r.get("host_threads") else ""
        lines.append(f"| {r['variant']}{threads} | {r['measured_step']:.3f} | {r['predicted_step']:.3f} |"
                     f" {r['host_seconds']:.3f} | {ratio} | {r['measured_peak_bytes'] / 1e9:.1f} |"
                     f" {r['predicted_bytes'] / 1e9:.1f} | {r['predicted_bytes'] / r['measured_peak_bytes']:.2f} |")
        if not comparable:
            notes.append(f"`{r['variant']}` was measured before the fused host step (the host stepped with torch's"
                         " per-parameter loop), so its step is not the one the planner estimates: no ratio until a"
                         " GPU run measures it.")
    return lines + ([""] + notes if notes else [])


def recompute_section(result: dict) -> str:
    lines = [
        "## Activation checkpointing",
        "",
        f"Command: `{COMMANDS['recompute']}` — {result['model']}, sequence {result['seq']}, batch {result['batch']},",
        f"one process ({result['threads']} threads): bytes autograd keeps for backward when the forward ends",
        "(parameters excluded) and forward+backward time (median of interleaved rounds, each the mean of",
        f"{result.get('steps', 1)} steps of every variant), each ÷ no recomputation; the time ratio is the median over",
        "rounds of the ratio within a round, beside the lowest and highest. Targets for recomputing every block:",
        "activations ≤ 0.50 and time ≤ 1.40 in every round (met); the time over 1.40 in every round or the",
        "activations over 0.50: not met; rounds on both sides of 1.40: inconclusive.",
        "",
        "| recompute | activation bytes | ÷ none | step (s) | ÷ none | rounds | target |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for r in result["rows"]:
        target = "—"
        if r["recompute"] == "every block":
            target = spread_verdict(r["time_ratio_range"], 1.4) if r["activation_ratio"] <= 0.5 else "**not met**"
        lines.append(f"| {r['recompute']} | {r['activation_bytes']:,} | {r['activation_ratio']:.3f} |"
                     f" {r['step_seconds']:.3f} | {r['time_ratio']:.3f} |"
                     f" {r['time_ratio_range'][0]:.3f}–{r['time_ratio_range'][1]:.3f} | {target} |")
    lines += ["", "What stays with every block recomputed is mostly the LM head's logits and their softmax"
              " (sequence × 50,304 vocabulary), outside the blocks."]
    return "\n".join(lines)


def host_step_section(result: dict, on_gpu_host: Optional[dict] = None) -> str:
    lines = [
        "## The host's optimizer step under optimizer offload",
        "",
        f"Command: `{COMMANDS['host_step']}` — one process: seconds per optimizer step over",
        f"{result['params']:,} host parameters with torch's default for host tensors (its per-parameter loop) and with",
        "the fused host kernel that optimizer offload from an accelerator gives the groups left to that default",
        "(`fuse_host_steps`), median of interleaved rounds; on one thread (each rank under torchrun's",
        "`OMP_NUM_THREADS=1`) and on every core here. The last columns: the fused kernel's parameters per second, and",
        "the largest difference between the two implementations' parameters after the steps.",
        "",
        *_host_step_rows(result),
    ]
    if on_gpu_host:
        cores = max(r["threads"] for r in on_gpu_host["rows"])
        lines += ["", f"The host of the GPU machine below ({cores} cores), command `{GPU_COMMANDS[2]}`"
                  f" ({on_gpu_host['params']:,} parameters: more than its caches hold). The planner's host step is one"
                  " thread's rate times the threads, up to the memory bandwidth the most threads reach (28 bytes per"
                  " parameter).", "", *_host_step_rows(on_gpu_host)]
    return "\n".join(lines)


def _host_step_rows(result: dict) -> list[str]:
    lines = ["| optimizer | threads | default (s) | fused (s) | speedup | fused (parameters/s) | max difference |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['optimizer']} | {r['threads']} | {r['default_seconds']:.4f} | {r['fused_seconds']:.4f} |"
                     f" {r['speedup']:.2f}× | {r['fused_params_per_second'] / 1e9:.2f} billion |"
                     f" {r['max_abs_difference']:.1e} |")
    return lines


def profile_section(rows: list[dict]) -> str:
    lines = [
        "## Where a step's time goes",
        "",
        f"Command: `{COMMANDS['profile']}` — `torch.profiler` over optimizer steps 4–6 on rank 0 (the overhead",
        "benchmark's model; 3d = pp 2 × tp 2 on 4 processes, the others on 2): self CPU time per step and the three",
        "operators with the most self time, as shares of all operators' self time.",
        "",
        "| strategy | processes | self CPU s/step | top 1 | top 2 | top 3 |",
        "|---|---:|---:|---|---|---|",
    ]
    for r in rows:
        tops = " | ".join(f"`{t['op']}` {t['share']:.0%}" for t in r["top"])
        lines.append(f"| {r['strategy']} | {r['world']} | {r['self_cpu_seconds_per_step']:.3f} | {tops} |")
    lines += [
        "",
        "Reading: ddp/ZeRO are the matmuls (the engines' compute). Under tensor parallelism the largest share is",
        "waiting for its collectives (`wait_tensor`) and DTensor's Python dispatch (`PythonSubclass`) — PyTorch's",
        "costs. Lightning runs the training step inside `optimizer.step`'s closure, so `Optimizer.step#AdamW.step`",
        "self time is what no operator covers inside the step: under pipelining, the schedule's Python and its",
        "point-to-point waits, and AdamW's per-parameter loop — torch's default on CPU. On CUDA torch picks its",
        "foreach kernels by default, and `AdamW(foreach=True)` runs under every meshlight layout (ddp, zero1–3,",
        "tp, pipeline, moe and 3d checked): the optimizer's implementation is the user's `configure_optimizers`",
        "choice, the same in the hand-written comparisons.",
        "",
        "Cut from ours, found with this command (the design notes keep the before-and-after figures of those",
        "runs): under tensor parallelism at dp = 1, AdamW re-reduced the sequence-parallel norms' partial gradients",
        "in each of its ops; they are reduced once per step since. Under ZeRO-3 meshlight resharded the root unit",
        "(embedding, head, final norm) after forward and gathered it again for the backward that follows at once:",
        "one all-gather per step more than the hand-written `fully_shard` loop, found by diffing the two loops'",
        "profiled steps (gather counts per FSDP unit); the root stays gathered since (the communication table's",
        "zero3 rows count its gathers).",
    ]
    return "\n".join(lines)


def calls(row: dict) -> str:
    return ", ".join(f"{kind} ×{int(v['calls'])}" for kind, v in sorted(row["by_collective"].items()))


def memory_section(rows: list[dict]) -> str:
    lines = [
        "## Model-state memory per rank",
        "",
        f"Command: `{COMMANDS['memory']}` — bytes of the storages holding this rank's parameters (gathered and",
        "sharded copies), gradients and AdamW state, each storage once, FSDP padding included, divided by the",
        "ZeRO formula for fp32 AdamW: DDP 16Ψ, ZeRO-1 8Ψ+8Ψ/N, ZeRO-2 4Ψ+12Ψ/N, ZeRO-3 16Ψ/N (Ψ = parameters).",
        "`after_step` is the issue's metric (target ≤ 1.05); `mid_accumulation` is after the first micro-batch of",
        "`accumulate_grad_batches=2`, when ZeRO-1/2 hold their gathered parameters (and ZeRO-1 its full gradients).",
        "",
        "| strategy | N | moment | Ψ | measured (bytes) | formula (bytes) | ratio | target |"
        " params / grads / optimizer (bytes) |",
        "|---|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for r in (r for r in rows if r["strategy"] != "tp"):
        b = r["breakdown"]
        target = verdict(r["ratio"], 1.05) if r["moment"] == "after_step" else "—"
        lines.append(f"| {r['strategy']} | {r['world']} | {r['moment']} | {r['parameters']:,} | "
                     f"{r['measured_bytes']:,} | "
                     f"{r['formula_bytes']:,.0f} | {r['ratio']:.4f} | {target} | "
                     f"{b['parameters']:,} / {b['gradients']:,} / {b['optimizer']:,} |")
    lines += [
        "",
        "ZeRO-1/2 are below their formulas after a step because FSDP2 frees the gathered parameters after",
        "backward in every stage (they are re-gathered by the next forward: the same bytes moved). Between",
        "micro-batches they exceed the formula by exactly 4Ψ/N: FSDP2 keeps each rank's fp32 shard next to the",
        "gathered parameters, where Megatron's distributed optimizer aliases the two. DDP meets 16Ψ because",
        "meshlight makes gradients views of DDP's communication buckets (`gradient_as_bucket_view=True`); with",
        "PyTorch's default (`False`) DDP keeps the buckets in addition to the gradients (not measured here).",
        "",
        "Tensor parallelism, tp = N: this rank's bytes of the weight matrices tensor parallelism shards (blocks'",
        "Linears, token embedding, LM head), and of their gradients after the last step, each divided by their",
        "total / N (row-parallel biases stay replicated).",
        "",
        "| layout | N | this rank (bytes) | total (bytes) | ratio | this rank's gradients (bytes) | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in (r for r in rows if r["strategy"] == "tp"):
        lines.append(f"| tp | {r['world']} | {r['sharded_layer_bytes']:,} | {r['total_sharded_layer_bytes']:,} | "
                     f"{r['ratio']:.4f} | {r['sharded_layer_gradient_bytes']:,} | {r['gradient_ratio']:.4f} |")
    return "\n".join(lines)


def pretrained_section(rows: list[dict]) -> str:
    model, largest = rows[0]["model_bytes"], rows[0]["largest_tensor_bytes"]
    lines = [
        "## Memory of loading pretrained weights",
        "",
        f"Command: `{COMMANDS['pretrained']}` — `PretrainedWeights` loading a `save_pretrained` Llama of"
        f" {model:,} bytes",
        f"(fp32; its largest tensor {largest:,} bytes) into the model built on the meta device in `configure_model`",
        "under ZeRO-3: each rank's anonymous resident memory (`RssAnon`, which leaves out safetensors' memory-mapped",
        "file pages) sampled every millisecond during the load, its growth beside the rank's shard (allocated during",
        "the load, from the meta device). The claim: a rank holds its shard plus at most about one tensor, never the",
        "whole model (growth / (shard + largest tensor) ≤ 1).",
        "",
        "| N | rank | shard (bytes) | growth during the load (bytes) | growth / shard | growth / (shard + largest) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['world']} | {r['rank']} | {r['shard_bytes']:,} | {r['growth_bytes']:,} | "
                     f"{r['growth_bytes'] / r['shard_bytes']:.3f} | {r['growth_over_shard_plus_largest']:.3f} |")
    return "\n".join(lines)


def compression_section(result: dict) -> str:
    lines = [
        "## Compression: gradient reductions, saved activations",
        "",
        f"Command: `{COMMANDS['compression']}` — the bytes each rank sends per optimizer step (after warm-up) in",
        "gradient reductions (all-reduces, reduce-scatters) with `grad_compression` over the uncompressed run's, and",
        "the weight all-gathers' share of the compressed step (not compressed); 2 processes, the 4-block dim-128 GPT,",
        "1 or 2 micro-batches per step. Targets: bf16 ≤ 0.52×, PowerSGD at rank 4 ≤ 0.1×.",
        "",
        "| strategy | micro-batches | compression | reduction bytes | uncompressed | ratio | all-gather share |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in result["traffic"]:
        lines.append(f"| {r['strategy']} | {r['micro_batches']} | {r['compression']} | {r['reduction_bytes']:,.0f}"
                     f" | {r['uncompressed_reduction_bytes']:,.0f} | {r['reduction_ratio']:.3f}"
                     f" | {r['gather_share']:.2f} |")
    lines += [
        "",
        "Saved activations (`ActivationCompression`, every block): the bytes autograd keeps in one forward of the",
        "same GPT (fp32, 4 × 64 tokens), each tensor once, against uncompressed; outside the blocks (embeddings, final",
        "norm, logits) stays fp32. Target for bf16: ≤ 0.55×.",
        "",
        "| dtype | uncompressed (bytes) | outside the blocks | inside, compressed | ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in result["activations"]:
        lines.append(f"| {r['dtype']} | {r['uncompressed_bytes']:,} | {r['outside_blocks_bytes']:,} | "
                     f"{r['compressed_blocks_bytes']:,} | {r['ratio']:.3f} |")
    runs = result["convergence"]
    steps = sorted({int(step) for r in runs for step in r["loss_curve"]})
    lines += [
        "",
        "The demo task (`examples/train_gpt.py`'s defaults: 2-digit sums, 2 blocks of dim 128, 64 sequences per rank,",
        "learning rate 3e-3, 500 steps) under ddp on 2 processes, per seed: the answer accuracy after 500 steps",
        "(target ≥ 90% with bf16 gradients and PowerSGD) and the logged training loss every 50 steps. PowerSGD runs",
        "with `GradientCompression(\"powersgd\")`'s defaults (rank 4, after 50 plain steps).",
        "",
        "| variant | seed | accuracy | " + " | ".join(f"loss @{step}" for step in steps) + " |",
        "|---|---:|---:|" + "---:|" * len(steps),
    ]
    for r in runs:
        curve = " | ".join(f"{r['loss_curve'][str(step)]:.3f}" for step in steps)
        lines.append(f"| {r['variant']} | {r['seed']} | {r['answer_accuracy']:.1%} | {curve} |")
    return "\n".join(lines)


def nvme_section(result: dict) -> str:
    lines = [
        "## Optimizer state on disk",
        "",
        f"Command: `{COMMANDS['nvme']}` — one process, 32 Linear blocks of 2048² (134M parameters, AdamW keeping",
        "1.07 GB of moments), 5 steps under `Offload()` (state in host memory) and `Offload(\"nvme\", path=...)`, each",
        "in a fresh process: peak resident memory (`ru_maxrss`) and the median step time after the first. glibc keeps",
        "freed blocks of up to 32 MB resident by default; `Offload(\"nvme\")` has large blocks mapped on their own",
        "(`return_large_blocks`). The first pair runs both variants that way, so the fall is the state's alone",
        "(target: ≥ 0.8× the state); the second runs the host variant with glibc's defaults, as a run without the",
        "callback.",
        "Step times are this CPU's, where forward and backward are short beside the disk's reads and writes.",
        "",
        "| malloc | host: peak RSS | nvme: peak RSS | fall / state | host step (s) | nvme step (s) | nvme / host |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for malloc, r in result.items():
        host, nvme = r["runs"]
        lines.append(f"| {malloc} | {host['peak_rss_bytes'] / 2**30:.2f} GiB | {nvme['peak_rss_bytes'] / 2**30:.2f} GiB"
                     f" | {r['rss_fall_over_state']:.2f} | {host['step_seconds']:.2f} | {nvme['step_seconds']:.2f} |"
                     f" {r['step_time_nvme_over_host']:.2f} |")
    return "\n".join(lines)


def integrity_section(r: dict) -> str:
    return "\n".join([
        "## Checkpoint checksums",
        "",
        f"Command: `{COMMANDS['integrity']}` — one process saving {r['checkpoint_bytes']:,} bytes (a model of"
        f" {r['params']:,} fp32 parameters and AdamW's two moments) with `save_checkpoint`, {r['rounds']} times with"
        " checksums and as many without, interleaved (median seconds); the time spent recording the checksums,",
        "timed in each save, over the median save without them (target: < 10%); and checking every file of one",
        "checkpoint, as the ranks of a resume do between them before reading it.",
        "",
        "| save without (s) | save with (s) | recording the checksums (s) | share of a save | checking (s) |",
        "|---:|---:|---:|---:|---:|",
        f"| {r['save_seconds_without']:.3f} | {r['save_seconds_with_checksums']:.3f} |"
        f" {r['checksum_seconds_per_save']:.3f} | {r['checksum_share_of_a_save']:.1%} | {r['check_seconds']:.3f} |",
    ])


def overhead_section(rows: list[dict]) -> str:
    lines = [
        "## Step-time overhead per strategy",
        "",
        f"Command: `{COMMANDS['overhead']}` — median wall time per training step of a 4-block GPT (dim 192, seq",
        "128, batch 8 per data replica, AdamW; moe: 4 experts per block) on 2 CPU processes, written by hand in",
        "plain PyTorch on the same engines, with Lightning's built-in strategy where one exists, and with",
        "`meshlight.Trainer`. Hand-written on PyTorch's APIs alone (the script imports nothing of meshlight's",
        "parallelism): `DistributedDataParallel`; `fully_shard` per block and root; a torchtitan-style",
        "`parallelize_module` plan (sequence-parallel norms, loss parallelism); the GPT split by hand into",
        "`PipelineStage` + `Schedule1F1B` (4 microbatches); experts distributed over ep 2 with a hand-written",
        "all-to-all dispatch, the dense weights under `fully_shard` (ZeRO-1). Each variant's first three losses are",
        "in the JSON (`first_losses`): the hand-written ones equal meshlight's. Lightning: `DDPStrategy`;",
        "`ModelParallelStrategy` with the same `fully_shard` calls or TP plan in `configure_model`. Variants",
        "interleaved in one launch per strategy: a round runs each once, back to",
        f"back ({rows[0]['steps_per_round']} measured steps), in an order that rotates until each has run first"
        f" {rows[0]['rotations']} times.",
        "meshlight and the hand-written loops turn Python's automatic garbage collection off while training and",
        "collect every 50 steps (as torchtitan does); Lightning keeps the automatic one. Milliseconds are medians",
        "over all measured steps; a ratio is the median over rounds of the two variants' ratio within a round",
        "(paired in time, so drift cancels), and beside it the lowest and highest round's ratio: the noise of",
        "this machine; then the ratio of the two variants' lower deciles over all their measured steps (p10):",
        "load from outside the benchmark only adds time, so the fastest tenth of steps is what each variant",
        "costs on a quiet machine, while a per-step cost of ours is in every step. A verdict is `met` when every",
        "round's ratio meets the target, `not met` when none does, and `inconclusive` when the rounds straddle it:",
        "this machine's spread is then larger than the margin (the p10 ratio says which side a quiet machine takes).",
        "",
        "| strategy | PyTorch (ms) | Lightning (ms) | meshlight (ms) | meshlight ÷ PyTorch (≤ 1.05) | rounds · p10 |"
        " meshlight ÷ Lightning (≤ 1.02) | rounds · p10 | Lightning ÷ PyTorch |",
        "|---|---:|---:|---:|---|---|---|---|---:|",
    ]
    loop = next((r for r in rows if r["strategy"] == "loop"), None)
    for r in (r for r in rows if r["strategy"] != "loop"):
        median = r["median_step_seconds"]
        lightning = f"{1000 * median['lightning']:.1f}" if "lightning" in median else "—"
        cells = []
        for name, target in (("meshlight_over_pytorch", 1.05), ("meshlight_over_lightning", 1.02)):
            if name not in r:
                cells += ["— (none in Lightning)", "—"]
                continue
            rounds, quiet = r["round_ratios"][name], r["lower_decile_ratios"][name]
            cells += [f"{r[name]:.3f}: {spread_verdict(rounds, target)}",
                      f"{min(rounds):.3f}–{max(rounds):.3f} · {quiet:.3f}"]
        lightning_loop = f"{r['lightning_over_pytorch']:.3f}" if "lightning_over_pytorch" in r else "—"
        lines.append(f"| {r['strategy']} | {1000 * median['pytorch']:.1f} | {lightning} |"
                     f" {1000 * median['meshlight']:.1f} | {' | '.join(cells)} | {lightning_loop} |")
    if loop is not None:
        ms = {variant: 1000 * seconds for variant, seconds in loop["median_step_seconds"].items()}
        extra = ms["meshlight"] - ms["pytorch"]
        steps = [1000 * r["median_step_seconds"]["pytorch"] for r in rows if r["strategy"] != "loop"]
        lines += [
            "",
            "The loops' own cost, from the `loop` rows of the same command (ddp on a 1-block GPT of dim 16, a step",
            f"that is almost all loop): {ms['pytorch']:.1f} ms per step written by hand, {ms['lightning']:.1f} ms"
            f" through Lightning, {ms['meshlight']:.1f} ms through meshlight:",
            f"meshlight's loop costs {extra:.1f} ms per step more than the hand-written one,"
            f" {100 * extra / max(steps):.1f}–{100 * extra / min(steps):.1f}% of the steps above.",
        ]
        above = [r["strategy"] for r in rows if r["strategy"] != "loop"
                 and min(r["round_ratios"]["meshlight_over_pytorch"]) > 1.05]
        if above:
            lines.append(f"Above 1.05 × PyTorch in every round: {', '.join(above)}; more than the loop's cost and this"
                         " machine's noise.")
        lines.append(f"{'Other ratios' if above else 'Ratios'} further from 1 than the loop's share move with the"
                     " machine's load: see each row's spread over rounds.")
    lines += [
        "",
        "Besides Lightning's loop, meshlight's pipeline step runs outside the schedule: the capture of the stage-0",
        "inputs (the user's `training_step` up to the pipelined module), a broadcast of the loss and logged values",
        "from the last stage to every stage (a collective the hand-written loop does without: it all-reduces the",
        "last stage's loss directly), and their replay through `self.log(..., sync_dist=True)`.",
        "",
        "Under tensor parallelism meshlight and the hand-written loop reduce the sequence-parallel norms' partial",
        "gradients once per step, where Lightning leaves DTensor re-reducing them in each optimizer op (three",
        "all-reduces per norm parameter with AdamW). The hand-written plan keeps the gathered inputs of the",
        "attention and MLP projections for backward (torchtitan's way); meshlight by default keeps this rank's share",
        "and gathers it again (`keep_gathered_inputs=False`: less memory, one all-gather more per projection group",
        "in backward).",
    ]
    return "\n".join(lines)


def bubble_section(rows: list[dict]) -> str:
    lines = [
        "## Pipeline bubble",
        "",
        f"Command: `{COMMANDS['bubble']}` — fraction of a training step a rank is not computing a stage (1 − busy /",
        "step, busy timed around each stage's forward / backward / weight-gradient calls, step ending when the",
        "last rank is done), mean over ranks, for an 8-block chain split by meshlight and run by each schedule.",
        "Compute is simulated (each block sleeps 4 ms forward, 4 ms input gradient, 4 ms weight gradient) so",
        "that 4 processes on 2 cores behave like 4 devices. Theory: GPipe, 1F1B (p−1)/(m+p−1); Interleaved1F1B",
        "(p−1)/(v·m+p−1). Targets: GPipe and 1F1B within 0.05 of theory; interleaved and zero-bubble below 1F1B.",
        "",
        "| schedule | p | m | v | bubble | theory | target |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    reference = {(r["p"], r["m"]): r["bubble"] for r in rows if r["schedule"] == "1f1b"}
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['schedule']} | {r['p']} | {r['m']} | {r['v']} | — | — |"
                         f" not run: needs m ≥ {2 * r['p']} |")
            continue
        theory = f"{r['theory']:.3f}" if r["theory"] is not None else "—"
        if r["schedule"] in ("gpipe", "1f1b"):
            gap = abs(r["bubble"] - r["theory"])
            target = f"gap {gap:.3f} ≤ 0.05: {verdict(gap, 0.05)}"
        elif r["schedule"] in BELOW_1F1B:
            below = r["bubble"] < reference[(r["p"], r["m"])]
            target = f"below 1F1B ({reference[(r['p'], r['m'])]:.3f}): {'met' if below else '**not met**'}"
        else:
            target = "—"
        lines.append(f"| {r['schedule']} | {r['p']} | {r['m']} | {r['v']} | {r['bubble']:.3f} | {theory} | {target} |")
    return "\n".join(lines)


def context_section(result: dict, gpu: Optional[dict]) -> str:
    """Context parallelism: saved bytes per rank against the whole sequence's (and the CUDA runs, when recorded)."""
    lines = ["## Context parallelism: memory per rank, and the attention methods on CUDA", "",
             f"Command: `{COMMANDS['context']}`. A GQA GPT (kv heads = heads / 4) runs one training forward on 2"
             " sequences, whole on one rank and split over cp ranks (all-gather-K/V attention); bytes of the tensors"
             " autograd saves for backward, per rank (each storage once, parameters left out). Backward keeps the"
             " gathered K/V (`kv share`: their part of the cp run's bytes).", "",
             "| cp | tokens | cp=1 (MB) | per rank at cp (MB) | ratio | target | kv share |",
             "|---:|---:|---:|---:|---:|---|---:|"]
    for row in result["memory"]:
        per_rank = max(row["cp_bytes_per_rank"])
        lines.append(f"| {row['cp']} | {row['seq']:,} | {row['cp1_bytes'] / 1e6:.1f} | {per_rank / 1e6:.1f} |"
                     f" {row['ratio']:.3f} | ≤ 0.35 ({verdict(row['ratio'], 0.35)}) | {row['kv_share']:.1%} |")
    lines.append("")
    if gpu is None:
        lines.append(f"On CUDA (`{GPU_CONTEXT_COMMAND}`): not recorded yet.")
        return "\n".join(lines)
    run = gpu["gpu"]
    lines += [f"On CUDA (`{GPU_CONTEXT_COMMAND}`): {run['device']}, torch {run['torch']}; a GPT of {run['layers']}"
              f" blocks 1024 wide (16 heads, 4 key/value heads), one sequence of {run['seq']:,} tokens, fp32, whole on"
              f" one rank and split over {run['ranks']} ranks sharing the one GPU (gloo; their times contend, so a"
              " step ratio above 1 is expected there). The whole-sequence run is the model's own SDPA call, which for"
              " fp32 grouped-query attention falls back to the kernel that builds every score, so the peak ratio"
              " overstates what cp saves against a flash-kernel run. `ring` passes K/V between the ranks with c10d"
              " all-gathers in this benchmark (gloo cannot run torch's functional collectives on CUDA tensors); its"
              " kernels and merging are torch's.", "",
              "| attention | loss vs whole (rel.) | grad norm vs whole (rel.) | step / whole | peak memory / whole |",
              "|---|---:|---:|---:|---:|"]
    for method in ("allgather", "ring"):
        compared = run.get(f"{method}_vs_whole")
        if compared is None:
            rows = run.get(method)
            error = rows.get("error") if isinstance(rows, dict) else next(
                (r.get("error") for r in rows if "error" in r), "no result")
            lines.append(f"| {method} | failed: {error} | | | |")
            continue
        lines.append(f"| {method} | {compared['loss_rel']:.1e} | {compared['grad_norm_rel']:.1e} |"
                     f" {compared['step_ratio']:.2f} | {compared['peak_ratio']:.2f} |")
    return "\n".join(lines)


def planner_out_of_sample_section(result: dict) -> str:
    """The planner against published runs its constants were not set from (``benchmarks/planner.py``'s
    ``out_of_sample``)."""
    rows = result["out_of_sample"]
    within = sum(abs(row["ratio"] - 1) <= 0.25 for row in rows)
    chosen = [row for row in rows if row["chosen_as_fastest"]]
    top3 = sum(row["rank"] <= 3 for row in chosen)
    lines = ["## Layout planner out of sample", "",
             f"Command: `{COMMANDS['planner']}` (its `out_of_sample` part; `python benchmarks/planner.py --nprocs`"
             " prints the published comparisons alone). Runs the planner's constants were not set from: every"
             " amp_bf16 row at sequence 2048 of llm-foundry's MPT tables (H100 and A100; FSDP, so the layout was not"
             " chosen against others) and NeMo 24.12's FP8 Llama 2 and GPT-3 175B rows (compared ÷ 1.445, the"
             " in-sample table's Float8 factor; layouts tuned for speed). The planner fixes each published (dp, pp,"
             " tp) and chooses the rest. Target: within 25%; a layout chosen as the fastest among its three best.",
             "", f"Within 25%: {within} of {len(rows)} ({'met' if within == len(rows) else '**not met**'})."
             f" Chosen layouts among the planner's three best: {top3} of {len(chosen)}. (NeMo's table is taken as"
             " H100s from its FP8 throughput; the page read did not name the system.)", "",
             "| source | model | GPUs | layout | tokens/s/GPU published (bf16) | predicted | ratio | within 25%"
             " | rank |", "|---|---|---:|---|---:|---:|---:|---|---|"]
    for row in rows:
        layout = " ".join(f"{k}={v}" for k, v in row["published_layout"].items())
        rank = str(row["rank"]) if row["chosen_as_fastest"] else "—"
        lines.append(f"| {row['source'].split(' ')[0]} | {row['model']} | {row['gpus']} | {layout} |"
                     f" {row['bf16_published']:,.0f} | {row['predicted']:,.0f} | {row['ratio']:.3f} |"
                     f" {'yes' if abs(row['ratio'] - 1) <= 0.25 else '**no**'} | {rank} |")
    lines += ["", "The misses are runs that reached 55–62% MFU, under-predicted: llm-foundry's MPT 30B on A100s with "
              "recomputation, and NeMo's FP8 GPT-3 175B on 512 GPUs (either its FP8 gains more than torchtitan's "
              "Float8 factor, or half the peak is too little for its matmuls). The A100 rows sit low as a group, the "
              "H100 ones high. No constant was changed to fit these runs. Four changes of the model since these "
              "runs were added, each from first principles: the step counts the matmul of an LM head tied to the "
              "embedding (the MFU convention leaves it out, its weight being the embedding's), which over-predicted "
              "every small tied model before; a data-parallel group spanning nodes sends over all its members' NICs "
              "on each node at once, as NCCL's rings run a channel per NIC (a group of whole 8-GPU nodes at eight "
              "NICs' rate, not one's), which had under-predicted ZeRO-3 between nodes (MPT 13B and 70B on more than "
              "one node); and the kernels between the matmuls (norms, activations, residual adds, the loss) stream "
              "the activations at the device memory's datasheet bandwidth, four passes over what autograd saves, "
              "whose share of the step grows as the model narrows: it had over-predicted the narrow models (MPT 760M "
              "and 13B at 2 sequences per GPU were misses); and a pipeline runs at its most loaded rank's pace, the "
              "last, whose LM head's matmul runs beside its even share of the layers, while the search considers "
              "every virtual-stage count that splits the layers evenly over any multiple of pp microbatches (torch's "
              "and Megatron's requirement; NeMo's runs interleave 6 to 20 stages a rank), which had ranked NeMo's "
              "Llama 2 13B layout sixth, priced as plain 1F1B."]
    return "\n".join(lines)


def context_planner_section(result: dict) -> str:
    """The planner's context-parallel throughput ratios against torchtitan's published runs."""
    lines = ["## Layout planner against torchtitan's context-parallel runs", "",
             f"Command: `{COMMANDS['context_planner']}`. torchtitan (Dec 2024): Llama 3 8B on 8 H100s (96 GB, 500 W),"
             " FSDP over dp × cp, full activation checkpointing, compile and Float8, one sequence per data rank. Each"
             " run priced by the planner as torchtitan ran it (dp = 8/cp, ZeRO-3, recompute, bf16); ratios compared,"
             " target within 25% of the published ratio. No planner constant was set from these runs.", "",
             "| run | published tokens/s/GPU | predicted | planner memory (GiB) | K/V exchange | planner's best |",
             "|---|---:|---:|---:|---:|---|"]
    for run in result["runs"]:
        lines.append(f"| cp={run['cp']}, {run['seq_len'] // 1024}K | {run['published']:,} | {run['predicted']:,.0f} |"
                     f" {run['memory_gib']:.1f} | {run['kv_exchange_share']:.1%} | {run['planner_best']} |")
    lines += _context_planner_ratios(result["ratios"], target=True)
    lines += ["", _step_growth(result["runs"])]
    if "runs_405b" in result:
        lines += ["", "Beside them, not a target: the same page's Table 6, Llama 3.1 405B on 512 H100s, TP 8 × PP 8"
                  " (1F1B, 8 microbatches of one sequence), FSDP 8/cp, compile, Float8 and async TP, priced as"
                  " torchtitan ran it (ZeRO-3, recompute).", "",
                  "| run | published tokens/s/GPU | predicted | planner memory (GiB) | K/V exchange |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| cp={run['cp']}, {run['seq_len'] // 1024}K | {run['published']:,} | {run['predicted']:,.1f} |"
                  f" {run['memory_gib']:.1f} | {run['kv_exchange_share']:.1%} |" for run in result["runs_405b"]]
        lines += _context_planner_ratios(result["ratios_405b"], target=False)
    return "\n".join(lines)


def _step_growth(runs: list[dict]) -> str:
    """How the published step time grows from run to run where every rank holds the same tokens, against the most
    that a cost growing with the sequence allows."""
    if len({run["seq_len"] // run["cp"] for run in runs}) != 1:
        return ""
    pairs = list(zip(runs, runs[1:]))
    growth = ", ".join(f"{before['published'] / after['published']:.2f}× from {before['seq_len'] // 1024}K to"
                       f" {after['seq_len'] // 1024}K" for before, after in pairs)
    longer = max(after["seq_len"] / before["seq_len"] for before, after in pairs)
    exchange = max(run["kv_exchange_share"] for run in runs)
    most = max(before["published"] / after["published"] for before, after in pairs)
    return (f"Every rank holds {runs[0]['seq_len'] // runs[0]['cp']:,} tokens of a sequence in each run, so the"
            f" published step time grows as its tokens/s fall: {growth}. A rank's FLOPs grow at most as the sequence"
            f" ({longer:g}× each time, were attention all of them); its K/V exchange grows faster but is at most"
            f" {exchange:.1%} of the planner's step. A step growing {most:.2f}× is more than compute and the exchange"
            " explain, and is where the misses above come from.")


def _context_planner_ratios(ratios: list[dict], target: bool) -> list[str]:
    """The table of published and predicted ratios between context-parallel runs."""
    lines = ["", "| ratio | published | predicted | predicted / published | with Float8 linear layers |"
             + (" target |" if target else ""), "|---|---:|---:|---:|---:|" + ("---|" if target else "")]
    for ratio in ratios:
        met = f" within 25% ({'met' if ratio['within_25_percent'] else '**not met**'}) |" if target else ""
        lines.append(f"| {ratio['run']} ÷ {ratio['over']} | {ratio['published']:.3f} | {ratio['predicted']:.3f} |"
                     f" {ratio['predicted_over_published']:.2f} | {ratio['float8_linear_over_published']:.2f} |"
                     + met)
    return lines


def gpu_section(result: object, title: str = "One GPU: MFU, overhead against a plain PyTorch loop, recomputation"
                " and offload") -> str:
    """The single-accelerator figures, from the JSON the `GPU_COMMANDS` wrote on a GPU machine (None: not yet)."""
    lines = [f"## {title}", ""]
    if not isinstance(result, dict):
        return "\n".join(lines + [
            f"Commands (on a GPU machine): `{GPU_COMMANDS[0]}` and `{GPU_COMMANDS[1]}`, then `make bench` formats the",
            "file here. **Not measured yet**: no GPU has been lent to this project's sessions. The script runs on",
            "CPU with `--smoke` (a test keeps it working): 1.02B-parameter GPT, sequence 2048, bf16, per-block",
            "`torch.compile`, through `meshlight.Trainer` and as a hand-written loop; targets MFU ≥ 50% (H100/H200)",
            "and meshlight ≤ 1.03 × the plain loop.",
        ])
    model = result["model"]
    lines += [
        f"{result['device']}, torch {result['torch']} (CUDA {result['cuda']}), lightning {result['lightning']},"
        f" {result['date']}. GPT with {model['params']:,} parameters ({model['non_embedding_params']:,} without"
        f" embeddings; {model['layers']} blocks of {model['dim']}, {model['heads']} heads), sequence {model['seq']},"
        f" batch {model['batch']}, bf16, per-block compile. Step time = mean over the measured steps after the"
        f" warm-up (compilation) steps, median of interleaved rounds. MFU = {model['flops_per_token']:,} FLOPs per"
        f" token (torchtitan's convention) × tokens/s ÷ {result['peak_flops'] / 1e12:.0f} TFLOP/s dense bf16.",
        "",
    ]
    for run in result["sections"].values():
        lines += [
            f"Command: `{run['command']}` ({run['steps']} steps after {run['warmup']}, {run['rounds']}"
            f" round{'s' if run['rounds'] != 1 else ''}, backend {run['backend']}; every run a process of its own"
            + (f"; measured {run['date']}" if "date" in run else "") + ")",
            "",
            "| variant | step (s) | rounds (s) | tokens/s | MFU | peak memory (GB) | resident after a step (GB) |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, r in run["variants"].items():
            rounds = " / ".join(f"{seconds:.3f}" for seconds in r["rounds"])
            lines.append(f"| {name} | {r['step_seconds']:.3f} | {rounds} | {r['tokens_per_second']:,.0f} |"
                         f" {r['mfu']:.1%} | {r['peak_bytes'] / 1e9:.2f} | {r['resident_bytes'] / 1e9:.2f} |")
        notes = [f"Under `{name}` the host stepped AdamW with {r.get('host_step', HOST_STEP_BEFORE)}"
                 + (f" on {r['host_threads']} threads." if "host_threads" in r else ".")
                 for name, r in run["variants"].items() if "offload optimizer" in name]
        lines += ["", *notes, ""] if notes else [""]
    lines += ["| ratio | value | target |", "|---|---:|---|"]
    targets = {"meshlight / plain autocast": 1.03, "meshlight / plain fsdp2": 1.03,
               "meshlight bf16 norms / plain fsdp2": 1.03, "recompute: peak activations / none": 0.5,
               "recompute: step / none": 1.4}
    for name, value in result["ratios"].items():
        shown = "—" if value is None else f"{value:.3f}"
        target = "—"
        if name in targets and value is not None:
            target = f"≤ {targets[name]} ({verdict(value, targets[name])})"
        elif "removed / optimizer state" in name and value is not None:
            target = f"≥ 1 ({'met' if value >= 1 else '**not met**'})"
        lines.append(f"| {name} | {shown} | {target} |")
    speed = result["sections"].get("speed", {}).get("variants", {})
    through = [f"{name} {row['mfu']:.1%}" for name, row in speed.items() if name.startswith("meshlight")]
    if through:
        best = max(row["mfu"] for name, row in speed.items() if name.startswith("meshlight"))
        lines += ["", f"MFU through meshlight: {', '.join(through)} (target ≥ 50%:"
                  f" {'met' if best >= 0.5 else '**not met**'})."]
    return "\n".join(lines)


def cuda_paths_section(result: Optional[dict]) -> list[str]:
    """fp16 loss scaling and Offload run on CUDA (``benchmarks/cuda_paths.py``), when recorded."""
    if result is None:
        return []
    lines = ["## CUDA-only paths: fp16 loss scaling, offload streams", "",
             f"Command (on a GPU machine): `{GPU_CUDA_PATHS_COMMAND}`. {result['device']}, torch {result['torch']}:"
             " a GPT (4 blocks 512 wide, sequence 512, batch 8) trains 30 steps on one device through"
             " `meshlight.Trainer`; each run's losses against the fp32 run's. On a model this small"
             f" {_small_model_surprises(result['runs'])} (the 1B model's memory section shows offload's savings at"
             " scale).", "",
             "| run | largest loss difference vs fp32 (rel.) | step (ms) | peak GPU memory (GB) | fp16 scale at end |",
             "|---|---:|---:|---:|---:|"]
    for row in result["runs"]:
        if "error" in row:
            lines.append(f"| {row['run']} | failed: {row['error']} | | | |")
            continue
        scale = f"{row['fp16_scale']:.0f}" if row["fp16_scale"] is not None else "—"
        lines.append(f"| {row['run']} | {row['max_relative_loss_difference']:.1e} | {1000 * row['step_seconds']:.1f} |"
                     f" {row['peak_bytes'] / 1e9:.2f} | {scale} |")
    return ["\n".join(lines)]


def latest_gpu_speed(result: Optional[dict]) -> list[str]:
    """The speed section measured again on another device (an H200), beside the full run above."""
    if result is None:
        return []
    return [gpu_section(result, f"One GPU again: the speed section on an {result['device']}")]


def _recorded(path: Path) -> Optional[dict]:
    """What a GPU machine's command wrote into the repository (None: not recorded)."""
    return json.loads(path.read_text()) if path.exists() else None


def _small_model_surprises(runs: list[dict]) -> str:
    """What the CUDA-paths table shows but does not explain yet, from its rows: offload peaking above fp32, fp16
    stepping slower than fp32."""
    rows = {row["run"]: row for row in runs if "error" not in row}
    fp32 = rows.get("fp32")
    if fp32 is None:
        return "the fp32 run failed, so nothing is compared"
    higher = [name for name, row in rows.items()
              if "offload" in name.lower() and row["peak_bytes"] > fp32["peak_bytes"]]
    said = []
    if higher:
        said.append(f"the {' and '.join(higher)} runs peaked higher than fp32")
    if "fp16" in rows and rows["fp16"]["step_seconds"] > fp32["step_seconds"]:
        said.append(f"fp16 stepped {rows['fp16']['step_seconds'] / fp32['step_seconds']:.1f}× as long as fp32")
    return ("; ".join(said) + ", not explained yet") if said else "nothing stood out against fp32"


def planner_moe_section(rows: list[dict]) -> str:
    """The planner's throughput for published MoE runs' layouts against the published figures."""
    met = sum(0.75 <= row["ratio"] <= 1.25 for row in rows)
    lines = ["## Layout planner against published MoE runs", "",
             f"Command: `{COMMANDS['planner_moe']}` — the planner's throughput for each published layout (dp, pp, tp"
             " and ep, the microbatches and virtual stages as published; ZeRO stage and recomputation its own"
             " choice) ÷ the published figure, target within 25%; the sources and their settings are in the script's"
             " docstring. FP8 runs are compared at torchtitan's Float8 speedup (÷ 1.445). No planner constant was set"
             " from these runs.", "",
             "| source | model | GPUs | layout | seq | global batch (micro) | published | predicted | ratio | planner"
             " MFU | expert all-to-all | target |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        layout = " ".join(f"{k}={v}" for k, v in row["published_layout"].items())
        ok = 0.75 <= row["ratio"] <= 1.25
        lines.append(f"| {row['source']} | {row['model']} | {row['gpus']} | {layout} | {row['seq_len']} |"
                     f" {row['global_batch']} ({row['micro_batch']}) | {row['published']:,} {row['metric']}"
                     f" ({row['note']}) | {row['predicted']:,.0f} | {row['ratio']:.2f} | {row['mfu']:.1%} |"
                     f" {row['times'].get('ep', 0):.1%} | {'met' if ok else '**not met**'} |")
    lines += ["", f"Within 25%: {met} of {len(rows)}."]
    if len({row["model"] for row in rows}) < len(rows):
        lines += ["", "Rows of one model are the same model, layout and batch published by two releases of the same"
                  " page (the earlier dropping tokens over capacity, the later dropless): the spread between them is"
                  " the published figures' own."]
    return "\n".join(lines)


def main() -> None:
    import lightning
    import torch

    comm, memory, overhead = run(COMMANDS["comm"]), run(COMMANDS["memory"]), run(COMMANDS["overhead"])
    bubble, balance, planner = run(COMMANDS["bubble"]), run(COMMANDS["balance"]), run(COMMANDS["planner"])
    recompute, profile, host_step = run(COMMANDS["recompute"]), run(COMMANDS["profile"]), run(COMMANDS["host_step"])
    pretrained, compression, nvme = run(COMMANDS["pretrained"]), run(COMMANDS["compression"]), run(COMMANDS["nvme"])
    integrity, context = run(COMMANDS["integrity"]), run(COMMANDS["context"])
    context_planner, planner_moe = run(COMMANDS["context_planner"]), run(COMMANDS["planner_moe"])
    header = "\n".join([
        "# Benchmark results",
        "",
        "Written by `make bench` (`python benchmarks/run_all.py`), which runs each command below and formats its",
        "JSON output; every figure comes from the command beside it. CPU figures are ratios or byte counts, not",
        "absolute speeds: only ratios measured side by side in one run carry over to other machines.",
        "",
        f"- Date: {datetime.date.today().isoformat()}",
        f"- Machine: {cpu_model()}, {os.cpu_count()} CPU cores, no GPU; gloo backend",
        f"- Versions: Python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}",
    ])
    sections = [header, comm_section(comm), memory_section(memory), pretrained_section(pretrained),
                integrity_section(integrity),
                overhead_section(overhead), bubble_section(bubble),
                balance_section(balance), planner_section(planner), planner_out_of_sample_section(planner),
                recompute_section(recompute),
                host_step_section(host_step, _recorded(GPU_HOST_STEP)), compression_section(compression),
                nvme_section(nvme), context_section(context, _recorded(GPU_CONTEXT)),
                context_planner_section(context_planner), planner_moe_section(planner_moe), profile_section(profile),
                gpu_section(_recorded(GPU_RESULTS)), *latest_gpu_speed(_recorded(GPU_RESULTS_H200)),
                *cuda_paths_section(_recorded(GPU_CUDA_PATHS))]
    text = "\n\n".join(sections) + "\n"
    (HERE / "RESULTS.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
