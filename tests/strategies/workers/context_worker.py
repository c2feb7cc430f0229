"""torchrun worker: context-parallel parity runs (cp alone, with tp, pp, ZeRO-3 data parallelism and expert
parallelism, and by the name "cp") on meshlight's GPT, a Llama-shaped model that slices its rotary tables by its
input's length, and Hugging Face's Llama (and GPT-OSS); a validation loss; and the refusals of what cp cannot
split."""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F

import meshlight as ml
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig
from meshlight.parallel.expert import expert_layers
from tests.strategies.hf_models import LitCausalLM, lit_causal_lm, unshifted
from tests.strategies.llama import LitLlama
from tests.strategies.parity import make_data, train

SEQ = 16  # the addition sequences (12 tokens) padded to a multiple of 2·cp for cp ≤ 4


def lit_gpt(positions: str = "learned", **config: Any) -> LitGPT:
    config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=SEQ, dim=32, n_heads=4, bias=False,
                            positions=positions, **config)
    return LitGPT(config, lr=1e-2, warmup_steps=2)


class LitLlamaLabels(LitCausalLM):
    """Hugging Face's Llama trained as its users often do: dict batches, and the model's own loss from ``labels``
    (which it shifts itself). The data's targets are turned back into such labels before the batch reaches the
    strategy; ``in_step=True`` makes them inside the step instead, from what the step is given (refused under cp)."""

    def __init__(self, in_step: bool = False) -> None:
        super().__init__("llama")
        self.in_step = in_step

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        inputs, targets = batch
        return {"input_ids": inputs, "targets": targets} if self.in_step else {"input_ids": inputs,
                                                                               "labels": unshifted(targets)}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.in_step:
            batch = {"input_ids": batch["input_ids"], "labels": unshifted(batch["targets"])}
        loss = self.model(**batch).loss
        self.log("train/loss", loss)
        return loss


# model name -> factory
MODELS: dict[str, Callable[[], pl.LightningModule]] = {
    "gpt": lit_gpt,
    "llama": functools.partial(LitLlama, seq=SEQ),
    "hf-llama": functools.partial(LitCausalLM, "llama"),
}
EXTRA_MODELS: dict[str, Callable[[], pl.LightningModule]] = {
    "gpt-rotary-gqa": functools.partial(lit_gpt, positions="rotary", n_kv_heads=2, mlp="swiglu", norm="rmsnorm"),
    "hf-llama-labels": LitLlamaLabels,
    "hf-gpt2": functools.partial(LitCausalLM, "gpt2", optimizer="sgd", lr=0.3),
    "litgpt": functools.partial(LitCausalLM, "litgpt"),  # its rotary cache sliced by length, SDPA with is_causal
    # eager attention with sinks, sliding-window layers (4 tokens: across the chunks' edges), YaRN rotary, MoE
    "hf-gpt-oss": functools.partial(LitCausalLM, "gpt_oss"),
    # a layer without rotary positions (no query temperature), an L2 QK-norm, experts each taking every token. Top-1
    # routing at AdamW's 1e-2 makes the run chaotic: a token whose best two experts score within rounding of each
    # other takes one on one layout and the other on another, and 20 steps amplify that to 6e-4 in the losses. In
    # float64 (its twin, at 1e-2) cp=2 matches one process to 7e-15 in the weights; in float32 it is trained at 3e-3
    # (5e-6)
    "hf-llama4": functools.partial(LitCausalLM, "llama4-unchunked-untempered", lr=3e-3),
    "hf-llama4-fp64": functools.partial(lit_causal_lm, "llama4-unchunked-untempered-fp64"),
}
#: parity tolerances other than 1e-4 (float64 twins: the same computation, bar their routers' float32 sigmoid)
RTOL = {"hf-llama4-fp64": 1e-6}

def lit_llama_moe(**moe: Any) -> LitLlama:
    """The Llama with a top-2 MoE of 4 experts in every block (dropless, the balancing loss on, unless ``moe`` sets
    options): under cp each layer counts its capacity and balancing loss over the whole sequence's ranks."""
    module = LitLlama(experts=4, seq=SEQ)
    for layer in expert_layers(module):
        layer.config = dataclasses.replace(layer.config, **moe)
    return module


# layout name -> (strategy factory, data-parallel size), per world size
LAYOUTS: dict[int, dict[str, tuple[Callable[[], Any], int]]] = {
    2: {"cp2": (lambda: ml.MeshStrategy(cp=2, dp_replicate=1), 1), "name-cp": (lambda: "cp", 1)},
    4: {"cp4": (lambda: ml.MeshStrategy(cp=4, dp_replicate=1), 1),
        "cp2xtp2": (lambda: ml.MeshStrategy(cp=2, tp=2, dp_replicate=1), 1),
        "cp2xpp2": (lambda: ml.MeshStrategy(cp=2, pp=2, dp_replicate=1, microbatches=2), 1),
        "cp2xdp2-zero3": (lambda: ml.ContextParallelStrategy(cp=2, zero=3), 2),
        # experts split over 2 data ranks (borrowed from the shards under ZeRO, the replicas under DDP)
        "cp2xep2-zero1": (lambda: ml.MeshStrategy(cp=2, dp_replicate=1, dp_shard=2, ep=2, zero=1), 2),
        "cp2xep2-ddp": (lambda: ml.MeshStrategy(cp=2, dp_replicate=2, ep=2, zero=0), 2),
        # whole experts, expert parallelism spanning the 2 tp ranks (folded), the cp ranks holding the same ones
        "cp2xtp2-fold-zero1": (lambda: ml.MeshStrategy(cp=2, tp=2, dp_shard=1, ep=2, zero=1, experts="fold"), 1)},
}
EXPERT_LAYOUTS = ("cp2xep2-zero1", "cp2xep2-ddp", "cp2xtp2-fold-zero1")


def runs(world: int) -> list[tuple[str, str]]:
    """(layout, model) for this world size."""
    grid = [(layout, model) for layout in LAYOUTS[world] if layout not in EXPERT_LAYOUTS for model in MODELS]
    if world == 2:
        grid += [("cp2", model) for model in EXTRA_MODELS] + [("cp2", "llama-moe-capacity"), ("cp2", "hf-mixtral-aux")]
    else:  # experts split over data ranks, under tp (each expert split over it) and folded over tp, with a capacity
        # factor; Hugging Face's stacked experts split over data ranks and folded
        grid += [("cp2xep2-zero1", "llama-moe-capacity"), ("cp2xep2-ddp", "llama-moe"), ("cp2xep2-ddp", "hf-gpt-oss"),
                 ("cp2xtp2", "llama-moe-capacity"), ("cp2xtp2", "hf-gpt-oss"),
                 ("cp2xtp2-fold-zero1", "llama-moe-capacity"), ("cp2xtp2-fold-zero1", "hf-mixtral")]
    return grid


MOE_MODELS = {"llama-moe": lit_llama_moe,
              "llama-moe-capacity": functools.partial(lit_llama_moe, capacity_factor=1.0, min_capacity=1),
              "hf-mixtral": functools.partial(LitCausalLM, "mixtral"),
              # its load-balancing loss, from the whole sequence's router logits (gathered over the cp ranks)
              "hf-mixtral-aux": functools.partial(lit_causal_lm, "mixtral-aux")}


def model_factory(name: str) -> Callable[[], pl.LightningModule]:
    return {**MODELS, **EXTRA_MODELS, **MOE_MODELS}[name]


def validation(strategy: Any = None) -> float:
    """The validation loss of GPT-tiny (untrained) on the addition data's 32 validation sequences, whole on one
    process (no ``strategy``) or split by ``strategy``."""
    pl.seed_everything(0, verbose=False)
    trainer = ml.Trainer(strategy=strategy or "auto", devices=dist.get_world_size() if strategy else 1,
                         accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    return trainer.validate(lit_gpt(), make_data(16, SEQ), verbose=False)[0]["val/loss"]


def refusals() -> dict[str, str]:
    """The error each input cp cannot split gets, before any optimizer step."""
    out = {}
    cases = {
        "length": (lit_gpt, 7),  # 14 tokens: not a multiple of 2·cp = 4
        "mask": (functools.partial(LlamaAttendingWith, _sliding_window), 8),
        "manual-attention": (functools.partial(LlamaAttendingWith, _written_out), 8),
        "labels-made-in-step": (functools.partial(LitLlamaLabels, in_step=True), 8),
        "chunked": (functools.partial(LitCausalLM, "llama4"), 8),
        "query-temperature": (functools.partial(LitCausalLM, "llama4-unchunked"), 8),
    }
    for name, (factory, multiple) in cases.items():
        try:
            train("adamw", ml.MeshStrategy(cp=2, dp_replicate=1), devices=dist.get_world_size(), data_parallel=1,
                  model=factory, pad_to_multiple_of=multiple, max_steps=1)
        except Exception as error:  # noqa: BLE001 - the message is the result
            out[name] = f"{type(error).__name__}: {error}"
        else:
            out[name] = "no error"
    return out


class LlamaAttendingWith(LitLlama):
    """The Llama with every attention's forward replaced by ``attend(attention, q, k, v)`` on its projections."""

    def __init__(self, attend: Callable[..., torch.Tensor]) -> None:
        super().__init__(seq=SEQ)
        for layer in self.model.layers:
            layer.attention.forward = functools.partial(_attention, layer.attention, attend)


def _attention(attention: Any, attend: Callable[..., torch.Tensor], x: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
    b, t, _ = x.shape
    q, k, v = (proj(x).view(b, t, -1, attention.head_dim).transpose(1, 2)
               for proj in (attention.wq, attention.wk, attention.wv))
    y = attend(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1))
    return attention.wo(y.transpose(1, 2).reshape(b, t, -1))


def _sliding_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A custom mask, which cp cannot split."""
    t = q.shape[2]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(t, t, dtype=torch.bool).tril().triu(-4))


def _written_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q·kᵀ)·v, which cp cannot see."""
    t = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")).softmax(-1) @ v


if __name__ == "__main__":
    out, world = sys.argv[1], int(sys.argv[2])
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else None
    results: dict[Any, Any] = {}
    for layout, model in runs(world):
        if only and f"{layout}/{model}" not in only:
            continue
        strategy, dp = LAYOUTS[world][layout]
        result = train("adamw", strategy(), devices=world, data_parallel=dp, model=model_factory(model),
                       pad_to_multiple_of=SEQ)
        result["layout"] = result.pop("module").trainer.strategy.layout
        results[(layout, model)] = result
    if world == 2 and not only:
        results["refusals"] = refusals()
        results["validation"] = validation(ml.MeshStrategy(cp=2, dp_replicate=1))
    if dist.get_rank() == 0:
        torch.save(results, out)
