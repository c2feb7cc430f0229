"""The layout planner against published large-scale runs: predicted throughput of the published layout ÷ the
published figure (target within 25%), and the rank of the published (dp, pp, tp) among the planner's layouts
(target: among the best three).

Sources: Megatron-Core's weak-scaling table (README `images/model_table.png`, r0.8.0, H100, seq 4096, vocabulary
131,072, TFLOP/s per GPU) and torchtitan's Llama 3 benchmarks on H100 96 GB capped at 500 W, seq 8192, tokens/s
per GPU: `benchmarks/llama3_h100_202412_torchtitan.md` (Dec 2024; T1/T3 eager bf16 FSDP rows) and
`benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md` (Jun 2025; 70B FSDP 32 × TP 8, compile, full AC, bf16
vanilla TP: 597.3); and its 2-D Llama 3.1 405B run on 128 of the same GPUs (`docs/performance.md` from PR #554,
Aug 2024: FSDP 16 × TP 8, local batch 2, global batch 32, full AC, bf16: 109 tokens/s per GPU; 177 with Float8,
185 with Float8 and async TP). The 405B 3-D run (Dec 2024, Table 5) was published only with Float8: it is
compared as published ÷ 1.445, torchtitan's own measured Float8-tensorwise speedup on the same hardware (70B with
async TP, 942.4 / 652.4, Jun 2025 table), and the row says so. The planner models bf16 and fixes the published dp,
pp and tp and chooses the rest (ZeRO stage, microbatches, virtual stages, recomputation) for the prediction.

Also, on CPU processes, the planner's per-rank model-state estimate (most loaded pipeline stage) ÷ the peak
bytes meshlight actually holds inside a step (max over ranks, sampled before every module's forward and every
FSDP unit's post-backward through the two micro-batches of an accumulation window) for the 3-D layouts of the
parity tests in fp32, some in bf16-true, and layouts with and without pipelining under the Offload callback's
optimizer offload (what is not in host memory), 8-block GPT-tiny (target within 10%).

Out of sample (``OUT_OF_SAMPLE``, not used to set the cost model's constants): every amp_bf16 row at sequence 2048
of llm-foundry's MPT tables on H100 80GB and A100 80GB (FSDP FULL_SHARD; the runs' layout is pure data parallelism,
not chosen among others), and NeMo 24.12's FP8 Llama 2 and GPT-3 175B pre-training rows on H100 without context
parallelism (layouts tuned for speed: the published one should be among the planner's three best), compared as
published ÷ 1.445 like the Float8 row above.

    python benchmarks/planner.py [--nprocs 4 8]      # prints JSON
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from common import GPU_HOST_STEP, GPU_RESULTS

if TYPE_CHECKING:
    from meshlight.parallel.planner import Candidate, Hardware, ModelSpec

#: torchtitan's measured Float8 (tensorwise) speedup over bf16, 70B on 256 H100 with async TP (Jun 2025 table)
FLOAT8_SPEEDUP = 942.4 / 652.4

# (source, preset, hardware, GPUs, global batch, (dp, pp, tp), metric, published value, note)
PUBLISHED = [
    ("Megatron-Core weak scaling", "megatron-1.7b", "h100", 48, 192, (48, 1, 1), "TFLOP/s/GPU", 408.8, ""),
    ("Megatron-Core weak scaling", "megatron-7.1b", "h100", 96, 192, (48, 1, 2), "TFLOP/s/GPU", 465.9, ""),
    ("Megatron-Core weak scaling", "megatron-16b", "h100", 192, 192, (48, 1, 4), "TFLOP/s/GPU", 489.1, ""),
    ("Megatron-Core weak scaling", "megatron-32b", "h100", 384, 192, (48, 1, 8), "TFLOP/s/GPU", 459.6, ""),
    ("Megatron-Core weak scaling", "megatron-70b", "h100", 768, 384, (48, 2, 8), "TFLOP/s/GPU", 419.7, ""),
    ("Megatron-Core weak scaling", "megatron-119b", "h100", 1536, 768, (48, 4, 8), "TFLOP/s/GPU", 420.5, ""),
    ("Megatron-Core weak scaling", "megatron-177b", "h100", 2304, 1152, (48, 6, 8), "TFLOP/s/GPU", 432.8, ""),
    ("Megatron-Core weak scaling", "megatron-314b", "h100", 3072, 1536, (48, 8, 8), "TFLOP/s/GPU", 474.4, ""),
    ("Megatron-Core weak scaling", "megatron-462b", "h100", 6144, 3072, (48, 16, 8), "TFLOP/s/GPU", 459.9, ""),
    ("torchtitan Llama 3 (T1)", "llama3-8b", "h100-96gb-500w", 8, 16, (8, 1, 1), "tokens/s/GPU", 5762, "FSDP, SAC"),
    ("torchtitan Llama 3 (T3)", "llama3-8b", "h100-96gb-500w", 128, 256, (128, 1, 1), "tokens/s/GPU", 5605, "FSDP"),
    ("torchtitan async TP (Jun 2025)", "llama3-70b", "h100-96gb-500w", 256, 512, (32, 1, 8), "tokens/s/GPU", 597.3,
     "FSDP×TP, compile, full AC, bf16"),
    ("torchtitan Llama 3.1 (Aug 2024)", "llama3-405b", "h100-96gb-500w", 128, 32, (16, 1, 8), "tokens/s/GPU", 109,
     "FSDP×TP, full AC, bf16"),
    ("torchtitan Llama 3 (T5)", "llama3-405b", "h100-96gb-500w", 512, 256, (8, 8, 8), "tokens/s/GPU", 128,
     "FSDP×TP×PP, Interleaved1F1B, Float8: compared ÷ 1.445"),
]


#: MPT's shapes as llm-foundry's ``scripts/train/yamls/pretrain/mpt-*.yaml`` give them (GELU MLP 4·d wide, LayerNorm
#: without biases, tied embeddings, vocabulary 50,368; learned positions in the benchmark runs, whose NumParams grow
#: by seq·d with the sequence): size -> (layers, d_model, heads)
MPT = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12), "1b": (24, 2048, 16),
       "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 64), "70b": (80, 8192, 64)}
#: Llama 2's shapes (vocabulary 32,000): size -> (layers, hidden, heads, kv heads, MLP width)
LLAMA2 = {"7b": (32, 4096, 32, 32, 11008), "13b": (40, 5120, 40, 40, 13824), "70b": (80, 8192, 64, 8, 28672)}


@dataclass(frozen=True)
class PublishedRun:
    """One published training run the cost model's constants were not set from, in tokens/s per GPU."""

    source: str
    model: str  # "mpt-7b", "llama2-70b", or a planner preset
    seq_len: int
    hardware: str  # a planner preset
    gpus: int
    global_batch: int  # sequences per optimizer step
    layout: tuple[int, int, int]  # (dp, pp, tp)
    published: float
    note: str
    chosen_as_fastest: bool = False  # the run's layout was tuned for speed among others
    float8: bool = False  # compared as published ÷ FLOAT8_SPEEDUP

    @property
    def bf16_published(self) -> float:
        return self.published / FLOAT8_SPEEDUP if self.float8 else self.published


_FOUNDRY = "llm-foundry scripts/train/benchmarking/README.md"
_NEMO = "NeMo 24.12 performance_summary (DGX H100, FP8)"


def _foundry(hardware: str, size: str, gpus: int, micro: int, accumulate: int, recompute: bool,
             published: float) -> PublishedRun:
    """An llm-foundry MPT row at sequence 2048: FSDP FULL_SHARD over every GPU, amp_bf16 with bf16 parameters."""
    note = f"FSDP FULL_SHARD, amp_bf16, micro-batch {micro} × accumulate {accumulate}" + (", AC" if recompute else "")
    return PublishedRun(f"{_FOUNDRY} ({hardware.upper()} 80GB)", f"mpt-{size}", 2048, hardware, gpus,
                        gpus * micro * accumulate, (gpus, 1, 1), published, note)


OUT_OF_SAMPLE = [
    # llm-foundry "H100 80GB BF16": every row at sequence 2048
    _foundry("h100", "70b", 64, 8, 4, True, 1039), _foundry("h100", "70b", 32, 2, 16, True, 882),
    _foundry("h100", "30b", 32, 14, 3, True, 2308), _foundry("h100", "30b", 16, 10, 3, True, 2263),
    _foundry("h100", "30b", 8, 3, 21, True, 2002),
    _foundry("h100", "13b", 64, 2, 1, False, 4800), _foundry("h100", "13b", 32, 2, 1, False, 4811),
    _foundry("h100", "13b", 16, 2, 1, False, 4767), _foundry("h100", "13b", 8, 2, 1, False, 4792),
    _foundry("h100", "7b", 8, 6, 1, False, 10643),
    _foundry("h100", "3b", 64, 6, 3, False, 22525), _foundry("h100", "3b", 32, 6, 3, False, 23021),
    _foundry("h100", "3b", 16, 10, 3, False, 24142),
    _foundry("h100", "1b", 64, 20, 1, False, 44402), _foundry("h100", "1b", 32, 20, 1, False, 45130),
    _foundry("h100", "1b", 16, 20, 1, False, 46037), _foundry("h100", "1b", 8, 14, 1, False, 45455),
    _foundry("h100", "760m", 32, 24, 1, False, 67971), _foundry("h100", "760m", 16, 24, 1, False, 68551),
    _foundry("h100", "760m", 8, 24, 2, False, 63147),
    # llm-foundry "A100 80GB with 1600 Gbps node-node interconnect (RoCE)": every amp_bf16 row at sequence 2048
    _foundry("a100", "30b", 8, 3, 21, True, 916), _foundry("a100", "13b", 8, 2, 3, False, 2262),
    _foundry("a100", "7b", 8, 6, 2, False, 4641), _foundry("a100", "3b", 8, 10, 2, False, 10811),
    _foundry("a100", "1b", 8, 14, 4, False, 20513), _foundry("a100", "760m", 8, 24, 2, False, 32434),
    _foundry("a100", "350m", 8, 32, 2, False, 58782), _foundry("a100", "125m", 8, 40, 2, False, 142830),
    _foundry("a100", "125m", 8, 32, 2, False, 141737),
    # NeMo 24.12 pre-training (Megatron-Core, FP8): the rows without context parallelism
    PublishedRun(_NEMO, "llama2-7b", 4096, "h100", 8, 128, (8, 1, 1), 16934, "TP 1 PP 1, MBS 1", True, True),
    PublishedRun(_NEMO, "llama2-13b", 4096, "h100", 16, 128, (4, 4, 1), 8715, "TP 1 PP 4 VP 10, MBS 1", True, True),
    PublishedRun(_NEMO, "llama2-70b", 4096, "h100", 64, 128, (4, 4, 4), 1728, "TP 4 PP 4 VP 20, MBS 1", True, True),
    PublishedRun(_NEMO, "gpt3-175b", 2048, "h100", 128, 256, (4, 8, 4), 716, "TP 4 PP 8 VP 6, MBS 1", True, True),
    PublishedRun(_NEMO, "gpt3-175b", 2048, "h100", 512, 2048, (16, 8, 4), 825, "TP 4 PP 8 VP 6, MBS 2", True, True),
]


#: tokens/s per GPU of torchtitan's 2-D (FSDP 16 × TP 8, 128 GPUs, Aug 2024) and 3-D (FSDP 8 × TP 8 × PP 8,
#: Interleaved1F1B, 512 GPUs, Dec 2024 Table 5) Llama 3.1 405B runs on the same H100s, both with Float8 and async TP
TORCHTITAN_405B_FLOAT8 = {"2-D": 185, "3-D": 128}

#: world -> (dp, pp, tp, zero, Lightning precision, optimizer offloaded): the parity tests' 3-D layouts in fp32,
#: bf16 "true" precision (16-bit state), and the Offload callback's optimizer offload, with and without pipelining
CPU_RUNS = {
    4: [(1, 2, 2, 1, "32-true", False), (1, 2, 2, 3, "32-true", False), (2, 2, 1, 1, "32-true", False),
        (2, 2, 1, 3, "32-true", False), (2, 2, 1, 1, "bf16-true", False), (2, 2, 1, 1, "32-true", True),
        (4, 1, 1, 1, "32-true", True), (4, 1, 1, 2, "32-true", True), (4, 1, 1, 3, "32-true", True)],
    8: [(2, 2, 2, 1, "32-true", False), (2, 2, 2, 3, "32-true", False), (2, 2, 2, 1, "bf16-true", False),
        (2, 2, 2, 3, "32-true", True)],
}


def worker() -> None:
    import os

    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    import meshlight as ml
    from meshlight.callbacks import Offload
    from meshlight.demos import AdditionDataModule, LitGPT
    from meshlight.models import GPTConfig
    from meshlight.parallel.planner import HARDWARE, estimate, model_spec_of, precision_bytes

    from common import measuring_trainer_options, model_state_bytes, report

    class Probe(Callback):
        """Peak model-state bytes inside the schedule of step 2, sampled before every module's forward (when
        earlier micro-batches' gradients and the parameters a stage has gathered are all held) and before every
        FSDP unit's post-backward (its gradients whole, not yet reduce-scattered; the next unit prefetched).
        Under optimizer offload (``on_device``) only what is not in host memory."""

        def __init__(self, on_device: bool) -> None:
            self.bytes, self.handles, self.on_device = 0, [], on_device

        def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: object) -> None:
            if trainer.global_step == 1 and not self.handles:
                def sample(*_: object) -> None:
                    held = model_state_bytes(trainer, module, leave_out_host=self.on_device)
                    self.bytes = max(self.bytes, sum(held.values()))

                post_backward = FSDPParamGroup.post_backward

                def sampled_post_backward(group: FSDPParamGroup, *args: object) -> object:
                    sample()
                    return post_backward(group, *args)

                FSDPParamGroup.post_backward = sampled_post_backward  # instrumentation for this step only
                self.handles = [m.register_forward_pre_hook(sample, prepend=True)
                                for m in trainer.strategy.model.modules()]
                self.restore = lambda: setattr(FSDPParamGroup, "post_backward", post_backward)

        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: object) -> None:
            if trainer.global_step == 2:
                for handle in self.handles:
                    handle.remove()
                self.restore()

    world = int(os.environ["WORLD_SIZE"])
    config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=32, n_layers=8, bias=False)
    rows = []
    for dp, pp, tp, zero, precision, offload in CPU_RUNS[world]:
        pl.seed_everything(0, verbose=False)
        module, probe = LitGPT(config), Probe(on_device=offload)
        strategy = ml.Hybrid3DStrategy(dp=dp, pp=pp, tp=tp, zero=zero, microbatches=4 if pp > 1 else None)
        callbacks = [probe, *([Offload(optimizer=True, pin_memory=False)] if offload else [])]
        trainer = ml.Trainer(strategy=strategy, precision=precision,
                             **measuring_trainer_options(world, 2, callbacks, accumulate_grad_batches=2))
        trainer.fit(module, AdditionDataModule(3, batch_size=8, train_size=256))
        measured = torch.tensor(float(probe.bytes))
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        hardware = HARDWARE["cpu"].replace(**precision_bytes(precision), offload_optimizer=offload)
        predicted = estimate(model_spec_of(LitGPT(config)), hardware, world, 8 * dp, dp, pp, tp, 1, zero, 4, 1, False)
        run = " ".join([*([precision] if precision != "32-true" else []), *(["optimizer offload"] if offload else [])])
        rows.append({"layout": f"dp={dp} pp={pp} tp={tp} zero={zero}", "run": run or "fp32", "world": world,
                     "measured_bytes": measured.item(), "predicted_bytes": predicted.model_state_bytes,
                     "ratio": predicted.model_state_bytes / measured.item()})
    report(rows)


def planned_layout(model: ModelSpec, hardware: Hardware, gpus: int, batch: int,
                   layout: tuple[int, int, int]) -> tuple[Candidate, list[Candidate], Optional[int]]:
    """The planner's best candidate with the published (dp, pp, tp) fixed, its best fitting candidate of every
    layout, fastest first, and the published layout's rank among them (None: it does not fit)."""
    from meshlight.parallel.planner import best_per_layout, plan

    ranked = [c for c in best_per_layout(plan(model, hardware, gpus, batch)) if c.fits]
    layouts = [c.layout[:3] for c in ranked]
    dp, pp, tp = layout
    chosen = plan(model, hardware, gpus, batch, dp=dp, pp=pp, tp=tp)[0]
    return chosen, ranked, layouts.index(layout) + 1 if layout in layouts else None


def published() -> list[dict]:
    from meshlight.parallel.planner import HARDWARE, MODELS

    rows = []
    for source, preset, device, gpus, batch, (dp, pp, tp), metric, published, note in PUBLISHED:
        model, hardware = MODELS[preset], HARDWARE[device]
        chosen, ranked, rank = planned_layout(model, hardware, gpus, batch, (dp, pp, tp))
        tokens = chosen.tokens_per_second_per_device
        predicted = tokens * model.flops_per_token() / 1e12 if metric == "TFLOP/s/GPU" else tokens
        bf16_published = published / FLOAT8_SPEEDUP if "Float8" in note else published
        rows.append({
            "source": source, "model": model.name, "hardware": hardware.name, "gpus": gpus, "global_batch": batch,
            "published_layout": {"dp": dp, "pp": pp, "tp": tp}, "note": note, "metric": metric,
            "published": published, "bf16_published": bf16_published, "predicted": predicted,
            "ratio": predicted / bf16_published,
            "predicted_config": chosen.describe(), "fits": chosen.fits, "rank": rank,
            "best": [c.describe() for c in ranked[:3]],
            "best_over_published_layout": ranked[0].tokens_per_second_per_device / tokens,
        })
    return rows


def out_of_sample_model(name: str, seq_len: int) -> ModelSpec:
    """The planner's view of an :data:`OUT_OF_SAMPLE` run's model."""
    from meshlight.parallel.planner import MODELS, ModelSpec

    family, size = name.split("-", 1)
    if family == "mpt":
        layers, hidden, heads = MPT[size]
        return ModelSpec(layers, hidden, heads, heads, 4 * hidden, vocab=50368, seq_len=seq_len, swiglu=False,
                         tie_embeddings=True, name=f"MPT {size.upper()}", rmsnorm=False, positions=seq_len)
    if family == "llama2":
        return ModelSpec(*LLAMA2[size], vocab=32000, seq_len=seq_len, name=f"Llama 2 {size.upper()}")
    return MODELS[name].replace(seq_len=seq_len)


def out_of_sample() -> list[dict]:
    """Each :data:`OUT_OF_SAMPLE` run: the planner's tokens/s per GPU for its (dp, pp, tp), the rest its own choice, ÷
    the published figure (bf16: Float8 ones ÷ :data:`FLOAT8_SPEEDUP`), and the rank of that layout among the
    planner's layouts that fit."""
    from meshlight.parallel.planner import HARDWARE

    rows = []
    for run in OUT_OF_SAMPLE:
        model, hardware = out_of_sample_model(run.model, run.seq_len), HARDWARE[run.hardware]
        chosen, ranked, rank = planned_layout(model, hardware, run.gpus, run.global_batch, run.layout)
        dp, pp, tp = run.layout
        rows.append({
            "source": run.source, "model": model.name, "seq_len": run.seq_len, "hardware": hardware.name,
            "gpus": run.gpus, "global_batch": run.global_batch, "published_layout": {"dp": dp, "pp": pp, "tp": tp},
            "note": run.note, "float8": run.float8, "published": run.published,
            "bf16_published": run.bf16_published, "predicted": chosen.tokens_per_second_per_device,
            "ratio": chosen.tokens_per_second_per_device / run.bf16_published,
            "predicted_config": chosen.describe(), "fits": chosen.fits,
            "chosen_as_fastest": run.chosen_as_fastest,
            "rank": rank, "best": [c.describe() for c in ranked[:3]],
        })
    return rows


#: gpu.py's memory-section variants: the change each makes to the planner's view of the run
ONE_GPU_VARIANTS = {"meshlight": ({}, False), "meshlight recompute": ({}, True),
                    "meshlight offload optimizer": ({"offload_optimizer": True}, False),
                    "meshlight offload activations": ({"offload_activations": 1.0}, False)}


def one_gpu(results: Path = GPU_RESULTS, host_step: Path = GPU_HOST_STEP) -> Optional[dict]:
    """The planner's step time and memory for ``benchmarks/gpu.py``'s memory section (one GPU, zero2, the
    MixedPrecision callback) beside what that run measured — None without a recorded run on a device with a
    preset. Offload's estimate includes its host copies and the host's optimizer step, with that machine's host
    as ``host_step`` measured it (fused AdamW: one thread's rate, and all its cores' as the memory bandwidth the
    step reaches there) on the threads the run stepped with."""
    if not results.exists():
        return None
    import torch
    from gpu import model_config

    from meshlight.parallel.planner import ModelSpec, estimate, precision_bytes, preset_named

    recorded = json.loads(results.read_text())
    memory, preset = recorded["sections"].get("memory"), preset_named(recorded["device"])
    if memory is None or preset is None:
        return None
    shape = recorded["model"]
    model = ModelSpec.from_gpt_config(model_config(shape["seq"]), shape["seq"])
    hardware = preset.replace(devices_per_node=1, **precision_bytes("32-true", torch.bfloat16), **_host(host_step))
    rows = []
    for variant, measured in memory["variants"].items():
        changes, recompute = ONE_GPU_VARIANTS[variant]
        if "host_threads" in measured:
            changes = {**changes, "host_threads": measured["host_threads"]}
        predicted = estimate(model, hardware.replace(**changes), 1, shape["batch"], 1, 1, 1, 1, 2, 1, 1, recompute)
        rows.append({"variant": variant, "measured_step": measured["step_seconds"],
                     "predicted_step": predicted.step_time, "host_seconds": predicted.times["host"],
                     "measured_peak_bytes": measured["peak_bytes"], "predicted_bytes": predicted.memory_bytes,
                     "host_step": measured.get("host_step") if "offload optimizer" in variant else None,
                     "host_threads": measured.get("host_threads")})
    return {"device": recorded["device"], "date": recorded["date"], "command": memory["command"],
            "host_bandwidth": hardware.host_bandwidth, "host_step_rate": hardware.host_step_rate,
            "host_memory_bandwidth": hardware.host_memory_bandwidth,
            "host_measured": host_step.exists(), "rows": rows}


def _host(host_step: Path) -> dict[str, float]:
    """The planner's host-step figures from ``host_step.py``'s fused AdamW rows on the GPU machine's host (none
    recorded: the preset's): one thread's rate, and the memory bandwidth the most threads reached (7 fp32 values
    per parameter)."""
    if not host_step.exists():
        return {}
    rows = [r for r in json.loads(host_step.read_text())["rows"] if r["optimizer"] == "AdamW"]
    one, most = min(rows, key=lambda r: r["threads"]), max(rows, key=lambda r: r["threads"])
    return {"host_step_rate": one["fused_params_per_second"],
            "host_memory_bandwidth": 7 * 4 * most["fused_params_per_second"]}


def torchtitan_405b_2d_over_3d(rows: list[dict]) -> dict[str, float]:
    """torchtitan's 2-D Llama 3.1 405B run ÷ its 3-D run in tokens/s per GPU: as published with Float8 and async TP
    (both measured), as published in bf16 (the 3-D figure ÷ the Float8 speedup), and as the planner predicts them
    (``rows``: :func:`published`)."""
    two_d, three_d = (next(r for r in rows if r["model"] == "Llama 3.1 405B" and r["published_layout"]["pp"] == pp)
                      for pp in (1, 8))
    return {"published_float8": TORCHTITAN_405B_FLOAT8["2-D"] / TORCHTITAN_405B_FLOAT8["3-D"],
            "published_bf16": two_d["bf16_published"] / three_d["bf16_published"],
            "predicted": two_d["predicted"] / three_d["predicted"]}


def main() -> None:
    import argparse

    from common import launch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, nargs="*", default=[4, 8])
    args = parser.parse_args()
    memory, rows = [row for n in args.nprocs for row in launch(__file__, n)], published()
    print(json.dumps({"published": rows, "torchtitan_405b_2d_over_3d": torchtitan_405b_2d_over_3d(rows),
                      "out_of_sample": out_of_sample(), "memory": memory, "one_gpu": one_gpu()}, indent=1))


if __name__ == "__main__":
    from common import is_worker

    worker() if is_worker() else main()
