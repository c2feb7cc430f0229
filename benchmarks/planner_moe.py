"""The layout planner against published MoE training runs: its throughput for the published layout (dp, pp, tp and
ep, and the pipeline's microbatches and virtual stages as published; ZeRO stage and recomputation its own choice) ÷
the published figure (target within 25%). The cost model's constants were not set from these runs.

Sources (each row also names its GPUs, layout, sequence length and batch):

- Megatron-Core's MoE README (``megatron/core/transformer/moe/README.md``): "468 TFLOPS for Mixtral 8X7B bf16
  training" with MCore v0.9, and its reference parallel mapping for that model: 64 H100, dropless, all-to-all
  dispatcher, sequence 4096, TP 1, EP 8, PP 4 (8 layers per virtual stage: one stage per rank), micro-batch 1, global
  batch 256.
- Megatron-Bridge's performance summary (``docs/performance-summary.md``, 25.11 container, DGX-H100; token
  distribution force-balanced, dropless): Qwen3-30B-A3B on 16 GPUs in FP8 (current scaling), global batch 512,
  micro-batch 2, sequence 4096, TP 1, PP 2, VP 24, EP 8: 5,275 tokens/s per GPU; GPT-OSS 120B on 64 GPUs in BF16,
  global batch 512, micro-batch 4, sequence 4096, TP 1, PP 4, VP 1, EP 8: 5,630. FP8 rows are compared as published ÷
  1.445, torchtitan's measured Float8 speedup (see ``benchmarks/planner.py``); the planner models bf16.
- The same page's archive (``docs/performance-summary-archive.md``), 25.09 container, DGX-H100: Qwen3-30B-A3B at the
  same layout and batch with token dropping, 10,494 tokens/s per GPU — twice the 25.11 dropless figure. Its table
  names no precision; its Llama 3 8B row (725 model TFLOP/s per H100) is beyond bf16, so it is taken as FP8.

    python benchmarks/planner_moe.py      # prints JSON
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from planner import FLOAT8_SPEEDUP

_MEGATRON = "Megatron-Core MoE README (MCore v0.9: 468 TFLOPS; reference mapping of v0.8)"
_BRIDGE = "Megatron-Bridge performance summary, 25.11, DGX-H100"
_BRIDGE_2509 = "Megatron-Bridge performance summary archive, 25.09, DGX-H100"


@dataclass(frozen=True)
class MoERun:
    source: str
    model: str  # a planner preset, or a key of SHAPES
    gpus: int
    global_batch: int
    micro_batch: int
    layout: tuple[int, int, int, int]  # (dp, pp, tp, ep)
    virtual_stages: int  # pipeline stages per rank, as published
    metric: str  # "TFLOP/s/GPU" or "tokens/s/GPU"
    published: float
    note: str
    float8: bool = False
    release: str = ""  # where one model has rows from several releases of a source

    @property
    def key(self) -> str:
        return f"{self.model}-{self.release}" if self.release else self.model


#: shapes from the models' Hugging Face configs: (layers, hidden, heads, kv heads, head size, experts, top-k, expert
#: width, vocabulary)
SHAPES = {
    "qwen3-30b-a3b": ("Qwen3-30B-A3B", 48, 2048, 32, 4, 128, 128, 8, 768, 151936),
    "gpt-oss-120b": ("GPT-OSS 120B", 36, 2880, 64, 8, 64, 128, 4, 2880, 201088),
}

RUNS = [
    MoERun(_MEGATRON, "mixtral-8x7b", 64, 256, 1, (16, 4, 1, 8), 1, "TFLOP/s/GPU", 468,
           "BF16, dropless, TP 1 EP 8 PP 4, MBS 1, seq 4096"),
    MoERun(_BRIDGE, "qwen3-30b-a3b", 16, 512, 2, (8, 2, 1, 8), 24, "tokens/s/GPU", 5275,
           "FP8-CS, TP 1 PP 2 VP 24 EP 8, MBS 2, seq 4096; compared ÷ 1.445", float8=True),
    MoERun(_BRIDGE_2509, "qwen3-30b-a3b", 16, 512, 2, (8, 2, 1, 8), 24, "tokens/s/GPU", 10494,
           "FP8, token dropping, TP 1 PP 2 VP 24 EP 8, MBS 2, seq 4096; compared ÷ 1.445", float8=True,
           release="25.09"),
    MoERun(_BRIDGE, "gpt-oss-120b", 64, 512, 4, (16, 4, 1, 8), 1, "tokens/s/GPU", 5630,
           "BF16, TP 1 PP 4 VP 1 EP 8, MBS 4, seq 4096"),
]


def model_of(name: str):  # noqa: ANN201 - a ModelSpec (imported late: the JSON needs no torch at import)
    from meshlight.parallel.planner import MODELS, ModelSpec

    if name in MODELS:
        return MODELS[name]
    label, layers, hidden, heads, kv, head, experts, top_k, width, vocab = SHAPES[name]
    return ModelSpec(layers, hidden, heads, kv, width, vocab=vocab, seq_len=4096, experts=experts, top_k=top_k,
                     name=label, head_size=head)


def rows() -> list[dict]:
    from meshlight.parallel.planner import HARDWARE, plan

    out = []
    for run in RUNS:
        model, hardware = model_of(run.model), HARDWARE["h100"]
        dp, pp, tp, ep = run.layout
        microbatches = run.global_batch // dp // run.micro_batch
        chosen = plan(model, hardware, run.gpus, run.global_batch, dp=dp, pp=pp, tp=tp, ep=ep,
                      **({"microbatches": microbatches, "virtual_stages": run.virtual_stages} if pp > 1 else {}))[0]
        tokens = chosen.tokens_per_second_per_device
        predicted = tokens * model.flops_per_token() / 1e12 if run.metric == "TFLOP/s/GPU" else tokens
        bf16 = run.published / FLOAT8_SPEEDUP if run.float8 else run.published
        out.append({"source": run.source, "model": model.name, "gpus": run.gpus, "global_batch": run.global_batch,
                    "micro_batch": run.micro_batch, "seq_len": model.seq_len,
                    "published_layout": dict(zip(("dp", "pp", "tp", "ep"), run.layout)), "note": run.note,
                    "metric": run.metric, "published": run.published, "bf16_published": bf16,
                    "predicted": predicted, "ratio": predicted / bf16, "predicted_config": chosen.describe(),
                    "mfu": chosen.mfu, "fits": chosen.fits,
                    "times": {k: v / chosen.step_time for k, v in chosen.times.items() if v}})
    return out


if __name__ == "__main__":
    print(json.dumps(rows(), indent=1))
