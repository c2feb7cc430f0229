"""Hugging Face causal LMs of every dense family trained under each layout named, all in one launch (of the
processes those layouts run on); rank 0 saves each run's losses and full final weights to
``OUT/<layout>-<family>.pt`` (the checks in :data:`EXTRAS`: see their functions).

    python tests/forkrun.py 2 tests/strategies/workers/hf_worker.py OUT tp2 ddp zero3 pp2-1f1b pp2-interleaved \
        reshard-tied resume-listed resume-lora lora-dropout
    python tests/forkrun.py 4 tests/strategies/workers/hf_worker.py OUT dp2-tp2-ep2-split resume-split
    python tests/forkrun.py 8 tests/strategies/workers/hf_worker.py OUT 3d
"""

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import meshlight as ml
from meshlight.parallel.dtensors import local_tensor
from meshlight.parallel.expert import (
    StackedExpertsParallel,
    dense_experts,
    listed_experts,
    listed_experts_split,
    stacked_experts,
)
from tests.strategies import parity
from tests.strategies.hf_models import FAMILIES, MOE_FAMILIES, TP_FAMILIES, lit_causal_lm

#: families with one key/value head, trained at tp=2 (float64 where hf_models.PARITY_RTOL says why): Phi-3's,
#: Qwen3's, Llama's and litgpt's, Falcon-7B's and StarCoder's multi-query attention
KV_FEWER_THAN_TP = ("phi3-kv1", "qwen3-kv1-fp64", "llama-kv1-fp64", "litgpt-kv1-fp64", "falcon-fp64",
                    "gpt_bigcode-fp64")
#: fused q|k|v told by their config or class: Falcon's grouped (each group's q, k, v together), Persimmon's head by
#: head, OpenAI GPT's one after another (its blocks return lists)
BY_LAYOUT = ("falcon_grouped-fp64", "persimmon-fp64", "openai_gpt")
#: ALiBi's biases per head, built by the model for all heads: each rank handed its heads' (BLOOM's [batch·heads, 1,
#: keys], MPT's [heads, 1, keys], Falcon-RW's [batch, heads, 1, keys] and its attention mask [batch, heads, q, k])
ALIBI = ("bloom-fp64", "mpt", "falcon_rw")
#: MLP Linears held by the block beside its norms (the first gathering its input over the sequence itself): OPT's
#: (on the flattened tokens), XGLM's, BioGPT's
BLOCK_MLP = ("opt", "xglm", "biogpt")
#: blocks returning tuples whose first element the forward takes out (outputs[0]): BLOOM's, MPT's, Falcon's (OPT at
#: pp2-1f1b: its final norm registered before its layers, found by the chain check on its dummy_inputs; OPT-350m's
#: narrower embeddings, project_in and project_out beside them)
TUPLE_BLOCKS = ("bloom-fp64", "mpt", "falcon")
#: sequence mixers kept whole on every tp rank beside split attention and MLPs: Qwen3.5's Gated DeltaNet layers
#: (float64: hf_models.PARITY_RTOL; at tp2 its MoE too, each expert split over tp)
WHOLE_MIXER_FAMILIES = ("qwen3_5-fp64",)
#: hybrids of other sequence mixers (kept whole on every tp rank) and attention: Jamba's Mamba-1 with experts in every
#: other layer, Bamba's Mamba-2, Falcon-H1's mixer beside attention in each layer (its muP multipliers), Granite 4's
#: with experts and a shared expert (its gate|up fused) in every layer; LFM2's short convolutions (and its MoE's),
#: MiniMax's lightning attention (with experts); Kimi Linear's KDA linear attention beside a latent attention whose q
#: has no latent (float64: hf_models.PARITY_RTOL)
HYBRIDS = ("jamba", "bamba", "falcon_h1", "granite4", "lfm2", "lfm2_moe", "minimax", "kimi_linear-fp64")
#: Gemma 2 (soft-capped attention logits, eager attention), Gemma 3 (QK-norm) and Gemma 4 (k = v on its global layers,
#: their heads wider and fewer key/value heads), each with its head tied to its scaled token embedding; Gemma 4's MoE
#: (experts beside the MLP, its router's own norm and scales; in float64: hf_models.PARITY_RTOL)
GEMMA = ("gemma2", "gemma3", "gemma4", "gemma4_moe-fp64")
#: vision-language models (tests.strategies.hf_vlm), their vision encoder whole on every tp rank beside the split
#: decoder: Qwen2.5-VL (3-D rotary positions), Qwen3-VL (its deepstack features added to the hidden state between
#: decoder layers, which sequence parallelism gathers there; in float64: hf_models.PARITY_RTOL) and its MoE, LLaVA
#: (CLIP and Llama) and Gemma 3 (SigLIP, attention bidirectional over an image's tokens)
VLM = ("qwen2_5_vl", "qwen3_vl-fp64", "qwen3_vl_moe", "llava", "gemma3_vision")
#: the vision-language models pipelining splits: the encoder on the first stage, later stages skipping it and
#: counting the image tokens' places and positions from the token ids (Qwen2.5-VL's 3-D rotary positions too);
#: Idefics3's decoder reading its device from its parameters (in float64: hf_models.PARITY_RTOL), ERNIE 4.5-VL's
#: encoder registered after its decoder (Gemma 3's is LLaVA's structure), Qwen3-VL-MoE with 4 layers, its deepstack
#: adding the encoder's features after the first, which stays on the first stage with the next, and LLaVA-NeXT, whose
#: image_newline, a parameter of the model above its decoder, is the first stage's (in float64: hf_models.PARITY_RTOL)
VLM_PIPELINED = ("qwen2_5_vl", "llava", "idefics3-fp64", "ernie4_5_vl_moe", "qwen3_vl_moe-deep", "llava_next-fp64")
#: experts held as a list (litgpt's LLaMAMoE), split over ep: Mixtral's configuration, also with the gradients
#: clipped, and DeepSeek-V3's (grouped routing, a shared expert, a dense first layer)
LISTED = ("litgpt_moe", "litgpt_moe-clip", "litgpt_moe_grouped")

#: fine-tuned with PEFT's LoRA, the models' own weights frozen (hf_models.with_lora): each adapted Linear split with its
#: adapters (a column-parallel one's lora_B by rows, its lora_A whole; a row-parallel one's lora_A by columns, its
#: lora_B whole, run on lora_A's partial sums; a fused one's lora_B by rows, computing this rank's rows of each part
#: as its Linear does), the frozen norms run on the sequence's shares staying frozen: GPT-2's Conv1D projections (its
#: fused q|k|v too) as DoRA, its dropouts of probability 0 (DoRA's branch for dropout: the input multiplied by this
#: rank's rows of the weight again), Phi-3's fused q|k|v with one key/value head (each rank computing it) and fused
#: gate|up as DoRA (the magnitudes by rows, scaling this rank's rows of each part), GPT-NeoX's q|k|v held head by head
#: (as the plan it publishes says, read through PEFT's wrapper); Llama's with its embedding and head trained whole
#: beside (modules_to_save: resume-lora trains it, checkpointed); GPT-2 with rows of its embedding trained beside
#: (trainable_token_indices: on either side of where tp splits a vocabulary of 61, 31 + 30, and in its head tied to
#: it), each rank putting those it holds into its rows of the weight; Gemma 3 as DoRA, on its head too (tied to its
#: embedding, the vocabulary of 61 split 31 + 30: lora_B's rows split with the head's; each magnitude vector split
#: with its Linear's output: by rows under a column-parallel Linear and the head, whole under a row-parallel one,
#: whose weight's norms DTensor sums over tp); DoRA on Linears kept whole on every rank, their adapters and magnitudes
#: whole beside them, their gradients summed over tp: Qwen2-MoE's shared expert's gate (on the MoE block's flattened
#: tokens, run on plain values) and Gemma 4's router's projection (on the sequence's share, as DTensors); DeepSeek-V3's
#: latent attention as DoRA (its down-projections whole, its up-projections' lora_B and magnitudes by heads, run on
#: plain values; dropouts of probability 0, as GPT-2's)
LORA = ("llama-lora-saved", "gpt2-lora-dora-p0", "phi3-kv1-lora-dora", "gpt_neox-lora", "gpt2-vocab61-lora-tokens",
        "gemma3-vocab61-lora-head-dora", "qwen2_moe-lora-dora", "gemma4_moe-lora-dora", "deepseek_v3-lora-dora-p0")
#: the families data parallelism trains (FAMILIES but Mistral, Llama's structure under its own classes)
DATA_FAMILIES = tuple(family for family in FAMILIES if family != "mistral")

#: the microbatches each pipelined layout's schedule cuts a rank's batch into: a model's own load-balancing loss is
#: computed per forward call, one per microbatch (the one-process control computes it over the same pieces)
MICROBATCHES = {"pp2-1f1b": 4, "pp2-interleaved": 2, "3d": 2, "pp2-tp2": 2, "3d-moe": 2, "3d-ep2": 2, "dp2-pp2-ep2": 2}

# name -> (the strategy, processes, data-parallel replicas among them, the models it trains: lit_causal_lm's names)
LAYOUTS = {
    # GPT-2 also with a vocabulary tp does not divide (its head tied to the embedding, both split 31 + 30); GPT-NeoX's
    # fused q|k|v holds each head's q, k, v together, as its published plan says; the MoE models' attention split
    # (GPT-OSS's sinks with its heads), their routers kept whole on each rank, running on its share of the sequence,
    # and each expert split over tp (the fused gate|up part by part; GPT-OSS's interleaved gate|up by columns, its
    # output bias added once); Mixtral with its load-balancing loss, over the whole sequence's router logits (gathered
    # from the shares), added to the language-model loss by the step and (labels) by the model itself; Phi-3's fused
    # q|k|v sliced by the config's head counts and its fused gate|up, Qwen2-MoE's shared expert on the flattened
    # tokens (its gate replicated beside the router), and OLMo 2's and OLMoE's q and k norms over all heads (their
    # statistics reduced over tp; OLMo 2 also in float64, its norms torch's)
    # (and one key/value head, fewer than the ranks: each computes it, under Qwen3's norm over each head, in Phi-3's
    # fused q|k|v, litgpt's, and Llama's separate k and v); Qwen3-MoE and GPT-OSS with LoRA on their experts (PEFT's
    # target_parameters; Qwen3-MoE's stored [experts, out, in], its gate|up part by part, GPT-OSS's [experts, in,
    # out]), each rank adding the rows or columns of the update its slice of each expert takes
    "tp2": (lambda: ml.TensorParallelStrategy(tp=2), 2, 1, (*FAMILIES, "qwen2-fp64", "gpt2-vocab61", "gpt_neox",
                                                            *MOE_FAMILIES, "mixtral-aux", "mixtral-aux-labels",
                                                            *TP_FAMILIES, *KV_FEWER_THAN_TP, *BY_LAYOUT,
                                                            *ALIBI, *BLOCK_MLP, *WHOLE_MIXER_FAMILIES,
                                                            "qwen3_5_moe-fp64", *HYBRIDS, *GEMMA, *VLM, *LORA,
                                                            "qwen3_moe-lora", "gpt_oss-lora-experts")),
    # one key/value head on all 4 ranks (Qwen3), and two on 2 ranks each (Phi-3's fused q|k|v)
    "tp4": (lambda: ml.TensorParallelStrategy(tp=4), 4, 1, ("qwen3-kv1-fp64", "phi3-kv2-fp64")),
    # without sequence parallelism: DeepSeek-V3's latents' partial gradients reduced where the attention's input is,
    # litgpt's listed experts whole on every rank, each computing all the tokens, and Llama 4's shared expert's
    # output, summed over tp, added to in place by the model (in float64: hf_models.PARITY_RTOL); Apertus's learned
    # activation's scalars, their gradients summed over tp as under sequence parallelism (a mixer kept whole is left
    # as it is there: every rank computes it); ERNIE 4.5-VL, whose MoE layer takes each token's type (text or image)
    # beside the hidden state, which sequence parallelism refuses
    "tp2-no-sp": (lambda: ml.TensorParallelStrategy(tp=2, sequence_parallel=False), 2, 1,
                  ("deepseek_v3", "litgpt_moe", "llama4-fp64", "apertus", "ernie4_5_vl_moe", "llama-lora")),
    # a vocabulary tp does not divide, the logits left sharded over it for the loss (loss parallelism; GPT-2 with rows
    # of its embedding and of its head tied to it trained, the logits of those rows computed by the rank holding each;
    # Llama as DoRA on its head too, the adapter's logits as sharded as the head's, its magnitude split 31 + 30)
    "tp2-loss-parallel": (lambda: ml.TensorParallelStrategy(tp=2, loss_parallel=True), 2, 1,
                          ("llama-vocab61-fp64", "gpt2-vocab61-lora-tokens", "llama-vocab61-lora-head-dora")),
    # (Mistral is Llama's structure under its own classes: tp2 and pp2-1f1b run it; data parallelism does nothing
    # a model's classes change)
    "ddp": (lambda: "ddp", 2, 2, (*DATA_FAMILIES, "qwen2-fp64")),  # float64: hf_models.PARITY_RTOL
    "zero3": (lambda: ml.ZeroStrategy(stage=3), 2, 2, (*DATA_FAMILIES, "qwen3_vl")),
    # Llama 4's forward reads its token embedding's device from the embedding's weight on every stage; Mixtral adds
    # its load-balancing loss to its own loss, from every layer's router logits (carried down the pipeline);
    # DeepSeek-V4 and HY-V4 widen the embedding's output into hyper-connection streams, and collapse them after the
    # blocks with a head run before the final norm, registered after it: the later stage runs the forward on the
    # token ids, which DeepSeek-V4's hash-routed layer reads (in float64: hf_models.PARITY_RTOL)
    "pp2-1f1b": (lambda: ml.PipelineStrategy(pp=2, schedule="1f1b", microbatches=MICROBATCHES["pp2-1f1b"]), 2, 1,
                 (*FAMILIES, "llama4", *TUPLE_BLOCKS, "opt", "opt_narrow", "falcon_h1", "granite4",
                  "mixtral-aux-labels", "gemma3", "gemma4_moe", *VLM_PIPELINED, "deepseek_v4-fp64", "hy_v4")),
    # two virtual stages on each of the two ranks: a layer for each (the other layouts train 2-layer models), over 2
    # microbatches, fewer than pp·v (what the planner may choose); Mistral is Llama's structure under its own classes
    # (1F1B runs it)
    "pp2-interleaved": (lambda: ml.PipelineStrategy(pp=2, schedule="interleaved1f1b", virtual_stages=2,
                                                    microbatches=MICROBATCHES["pp2-interleaved"]), 2, 1,
                        tuple(f"{f}-deep" for f in FAMILIES if f != "mistral")),
    # one microbatch per stage: the schedules' microbatch counts are tested in test_pipeline.py
    # on 8 processes a run costs ~11 s (about 5 runs on 2, 2 on 4): the families whose structure all three axes meet
    # differently — Llama's, in Qwen2.5-VL's decoder (Qwen2's: Llama's with q/k/v biases; Mistral's is Llama's too) with
    # its vision encoder on the first stage, whole on its tp ranks, GPT-2's Conv1D and head tied across the first and
    # last stage, litgpt's fused grouped q|k|v (3d-ep2: its MoE's), and Qwen3-MoE's load-balancing loss per data
    # rank's part (3d-moe: from router logits gathered over the sequence's shares and carried down the pipeline)
    "3d": (lambda: ml.Hybrid3DStrategy(dp=2, pp=2, tp=2, microbatches=MICROBATCHES["3d"]), 8, 2,
           ("qwen2_5_vl", "gpt2")),
    # traits that pipelining and tensor parallelism meet together, data parallelism adding nothing of their own (the
    # same reduction over dp as the 3d runs'): OLMo 2's q and k norms over all heads; Falcon-RW's ALiBi biases handed
    # out by head on each stage, its blocks returning tuples (BLOOM's and OPT's traits beside it are their tp's or their
    # pp's alone: tp2 and pp2-1f1b); Qwen3-VL (4 layers, in float64: hf_models.PARITY_RTOL), its deepstack adding the
    # encoder's features after its first layer on the first stage, where sequence parallelism gathers the hidden state
    # for it and cuts it again; and three MoE families, ep=1, each expert split over tp (Mixtral's are split as
    # Qwen3-MoE's are): DeepSeek-V3's latent attention, its dense first layer a stage of its own; Llama 4's experts
    # that take every token (in float64, as at tp2); Granite 4's Mamba mixers whole on every tp rank (as Qwen3.5's
    # linear attention, whose float64 run cost 32 s on 8 processes), its experts beside its fused shared expert; GPT-2
    # with rows of its embedding trained, and of its head tied to it on the other stage; Gemma 3 with LoRA on its head
    # too, its embedding and head one frozen weight held by both stages (left without a gradient: AdamW decayed a zero
    # one, by 2e-3 over 20 steps); Qwen3's QK-norm with an explicit head_dim; Llama with LoRA and its embedding and
    # head trained whole beside (modules_to_save: each copy on its stage, split over tp as the original is)
    "pp2-tp2": (lambda: ml.Hybrid3DStrategy(dp=1, pp=2, tp=2, microbatches=MICROBATCHES["pp2-tp2"]), 4, 1,
                ("olmo2", "falcon_rw", "qwen3_vl-deep-fp64", "deepseek_v3", "llama4-fp64", "granite4",
                 "gpt2-vocab61-lora-tokens", "gemma3-vocab61-lora-head", "qwen3", "llama-lora-saved")),
    # litgpt's fused grouped q|k|v split over tp, and its experts held as a list spread over the tp ranks by ep
    # folded over them (each rank two whole experts of each list, each tp rank sending its share of the tokens)
    "3d-ep2": (lambda: ml.Hybrid3DStrategy(dp=2, pp=2, tp=2, ep=2, microbatches=MICROBATCHES["3d-ep2"]), 8, 2,
               ("litgpt_moe",)),
    "3d-moe": (lambda: ml.Hybrid3DStrategy(dp=2, pp=2, tp=2, ep=1, microbatches=MICROBATCHES["3d-moe"]), 8, 2,
               ("qwen3_moe-aux",)),
    # no sizes: the planner reads each config (tiny models on CPU processes: it replicates them, dp=2); Qwen3-MoE with
    # LoRA on its stacked experts too (PEFT adapts them in place; the adapters follow the experts as they are split)
    "3d-planned": (lambda: ml.Hybrid3DStrategy(), 2, 2,
                   ("llama", "litgpt", "mixtral", "llama-lora", "qwen3_moe-lora")),
    # the models' own MoE blocks, their stacked experts split over 2 ranks (ep carved out of dp=2); litgpt's listed
    # experts too, each rank keeping two of the list (also with the gradients clipped: the norm of each rank's
    # experts summed over ep); DeepSeek-V4's, its hash-routed layer's too (in float64), and HY-V4's; GPT-OSS with LoRA
    # on its experts (PEFT's target_parameters): each rank adds its experts' part of the adapters' update to them
    "ep2": (lambda: ml.MoEStrategy(ep=2), 2, 2, (*MOE_FAMILIES, "mixtral-aux", "qwen3_moe-aux", *LISTED,
                                                  "granite4", "gemma4_moe", "qwen3_vl_moe", "deepseek_v4-fp64",
                                                  "hy_v4", "gpt_oss-lora-experts")),
    # (Qwen3-MoE with its load-balancing loss, over each data rank's part, per microbatch)
    "dp2-pp2-ep2": (lambda: ml.Hybrid3DStrategy(dp=2, pp=2, tp=1, ep=2, microbatches=MICROBATCHES["dp2-pp2-ep2"]), 4,
                    2, ("mixtral", "qwen3_moe-aux", "gpt_oss", *LISTED)),
    # expert parallelism folded over tp=2 and 2 data ranks: each of the 4 ranks holds one whole expert (of a list
    # too: litgpt's); with sequence parallelism each tp rank sends its share of the tokens, without it its part of
    # the (same) tokens (litgpt's also with every step's gradients clipped)
    "dp2-tp2-ep4": (lambda: ml.Hybrid3DStrategy(dp=2, pp=1, tp=2, ep=4), 4, 2, (*MOE_FAMILIES, "litgpt_moe_grouped",
                                                                              "qwen3_vl_moe")),
    "dp2-tp2-ep4-no-sp": (lambda: ml.Hybrid3DStrategy(dp=2, pp=1, tp=2, ep=4, sequence_parallel=False), 4, 2,
                          ("mixtral", "litgpt_moe-clip")),
    # each expert split over tp=2 (the fused gate|up part by part), the experts over ep=2 data ranks: each rank runs
    # its half of 2 experts on the whole tokens of its tp group; without sequence parallelism under ZeRO-3 as well;
    # Mixtral fine-tuned with LoRA on its attention (its experts frozen, split so), Qwen3-MoE with LoRA on its experts
    # too (each rank adding the block of the update its block of the weights takes)
    "dp2-tp2-ep2-split": (lambda: ml.Hybrid3DStrategy(dp=2, pp=1, tp=2, ep=2, experts="split"), 4, 2,
                          (*MOE_FAMILIES, "mixtral-lora", "qwen3_moe-lora")),
    # a vision-language model's encoder, its parameters plain beside the decoder's tensor-parallel ones, under ZeRO-3
    # (and LoRA's frozen weights beside its adapters, sharded alike; the rows of an embedding trained beside them too)
    "dp2-tp2-zero3": (lambda: ml.Hybrid3DStrategy(dp=2, pp=1, tp=2, zero=3), 4, 2,
                      ("llava", "llama-lora-saved", "llama-lora-tokens")),
    "dp2-tp2-ep2-split-no-sp-zero3": (lambda: ml.Hybrid3DStrategy(dp=2, pp=1, tp=2, ep=2, experts="split", zero=3,
                                                                  sequence_parallel=False), 4, 2, ("mixtral",)),
}


def reshard_tied(out: Path) -> None:
    """GPT-2, its head tied to the token embedding, trained under pp=2 and under ddp: each checkpoint loads under
    the other layout (``validate(ckpt_path=…)``) into exactly the weights it was saved with."""
    results = {}
    for trained, loaded in (("pp2-1f1b", "ddp"), ("ddp", "pp2-1f1b")):
        strategy, _, replicas, _ = LAYOUTS[trained]
        path = out / f"tied-{trained}.ckpt"
        result = parity.train("adamw", strategy=strategy(), devices=2, data_parallel=replicas, save_to=path,
                              model=lambda: lit_causal_lm("gpt2"))
        save_run(out, trained, "gpt2", result)
        module = lit_causal_lm("gpt2")
        trainer = ml.Trainer(strategy=LAYOUTS[loaded][0](), devices=2, accelerator="cpu", logger=False,
                             enable_progress_bar=False, enable_model_summary=False)
        metrics = trainer.validate(module, parity.make_data(4), ckpt_path=path, verbose=False)
        results[f"{trained}->{loaded}"] = (result["weights"], parity.full_weights(module), metrics[0]["val/loss"])
    if torch.distributed.get_rank() == 0:
        torch.save(results, out / "reshard-tied.pt")


def resume_split(out: Path) -> None:
    """Mixtral trained under dp2-tp2-ep2-split, checkpointed halfway and at the end (the fused gate|up, split part by
    part, is saved as plain blocks of the whole weight); runs resumed from halfway under the same layout and under
    dp2-tp2-ep4 (experts folded); the final checkpoint loaded under ddp. Their results saved to ``resume-split.pt``:
    ``whole`` and ``folded`` (losses and weights), ``resumed`` and ``loaded`` (weights)."""
    from meshlight.callbacks import DistributedCheckpoint

    strategy, devices, replicas, _ = LAYOUTS["dp2-tp2-ep2-split"]
    model, folder = functools.partial(lit_causal_lm, "mixtral"), out / "split-checkpoints"
    checkpoint = DistributedCheckpoint(folder, every_n_train_steps=parity.STEPS // 2, keep_last_k=2, async_save=False)
    halfway, last = folder / f"step={parity.STEPS // 2:09d}", folder / f"step={parity.STEPS:09d}"
    whole = parity.train("adamw", strategy=strategy(), devices=devices, data_parallel=replicas, model=model,
                         callbacks=[checkpoint], enable_checkpointing=True)
    save_run(out, "dp2-tp2-ep2-split", "mixtral", whole)
    resumed = parity.train("adamw", strategy=strategy(), devices=devices, data_parallel=replicas, model=model,
                           ckpt_path=halfway)
    folded = parity.train("adamw", strategy=LAYOUTS["dp2-tp2-ep4"][0](), devices=devices, data_parallel=replicas,
                          model=model, ckpt_path=halfway)
    module = model()
    trainer = ml.Trainer(strategy="ddp", devices=devices, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.validate(module, parity.make_data(4), ckpt_path=last, verbose=False)
    loaded = parity.full_weights(module)
    if torch.distributed.get_rank() == 0:
        runs = {"whole": whole, "folded": folded}
        torch.save({**{name: {key: run[key] for key in ("losses", "weights")} for name, run in runs.items()},
                    "resumed": resumed["weights"], "loaded": loaded}, out / "resume-split.pt")


def resume_across(out: Path, family: str, layout: str) -> None:
    """``family`` trained under ``layout``, checkpointed halfway and at the end: resumed from halfway under
    ``layout`` and under ddp; its last checkpoint loaded under ddp; ddp's last checkpoint (of the resumed run) loaded
    under ``layout``. Saved to ``resume-<family>.pt``: ``whole`` and ``on_ddp`` (losses and weights), ``resumed``,
    ``loaded`` and ``ddp_loaded`` (weights)."""
    from meshlight.callbacks import DistributedCheckpoint

    model, folder = functools.partial(lit_causal_lm, family), out / f"{family}-checkpoints"
    strategy, devices, replicas, _ = LAYOUTS[layout]
    halfway, last = (folder / f"step={step:09d}" for step in (parity.STEPS // 2, parity.STEPS))

    def checkpoints(where: Path) -> list:
        return [DistributedCheckpoint(where, every_n_train_steps=parity.STEPS // 2, keep_last_k=2, async_save=False)]

    def loaded_under(strategy: object, path: Path) -> dict[str, torch.Tensor]:
        module = model()
        trainer = ml.Trainer(strategy=strategy, devices=devices, accelerator="cpu", logger=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.validate(module, parity.make_data(4), ckpt_path=path, verbose=False)
        return parity.full_weights(module)

    whole = parity.train("adamw", strategy=strategy(), devices=devices, data_parallel=replicas, model=model,
                         callbacks=checkpoints(folder), enable_checkpointing=True)
    save_run(out, layout, family, whole)
    resumed = parity.train("adamw", strategy=strategy(), devices=devices, data_parallel=replicas, model=model,
                           ckpt_path=halfway)
    on_ddp = parity.train("adamw", strategy="ddp", devices=devices, data_parallel=devices, model=model,
                          ckpt_path=halfway, callbacks=checkpoints(out / f"{family}-ddp"), enable_checkpointing=True)
    loaded = loaded_under("ddp", last)
    ddp_loaded = loaded_under(strategy(), out / f"{family}-ddp" / f"step={parity.STEPS:09d}")
    if torch.distributed.get_rank() == 0:
        runs = {"whole": whole, "on_ddp": on_ddp}
        torch.save({**{name: {key: run[key] for key in ("losses", "weights")} for name, run in runs.items()},
                    "resumed": resumed["weights"], "loaded": loaded, "ddp_loaded": ddp_loaded},
                   out / f"resume-{family}.pt")


def lora_dropout(out: Path) -> None:
    """Llama with LoRA dropout (0.5) trained under tp2 with sequence parallelism, whose tp ranks draw from streams
    of their own, 3 steps, and again with every block recomputed; DeepSeek-V3 so, 3 steps. Saved to
    ``lora-dropout.pt``: each rank's first dropped-values mask of Llama's column-parallel (q_proj) and row-parallel
    (o_proj) adapters and of DeepSeek-V3's latent attention's down-projection (q_a_proj) and up-projection
    (kv_b_proj), and whether Llama's two runs end on the same weights (recomputation replays the masks)."""
    from lightning.pytorch.callbacks import Callback

    from meshlight.callbacks import ActivationCheckpointing

    masks: dict[str, torch.Tensor] = {}

    def keep(key: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
            masks.setdefault(key, local_tensor(output) == 0)

        return hook

    class Masks(Callback):
        def __init__(self, projections: tuple[str, ...]) -> None:
            self.projections = projections

        def on_train_start(self, trainer: object, module: torch.nn.Module) -> None:
            layer = next(m for name, m in module.named_modules() if name.endswith("layers.0.self_attn"))
            for projection in self.projections:
                getattr(layer, projection).lora_dropout["default"].register_forward_hook(keep(projection))

    def train(family: str, *callbacks: object) -> dict:
        return parity.train("adamw", strategy=ml.TensorParallelStrategy(tp=2), devices=2, data_parallel=1,
                            model=lambda: lit_causal_lm(f"{family}-lora-drop"), callbacks=callbacks, max_steps=3)

    plain = train("llama", Masks(("q_proj", "o_proj")))
    recomputed = train("llama", ActivationCheckpointing())
    train("deepseek_v3", Masks(("q_a_proj", "kv_b_proj")))
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, masks)
    if torch.distributed.get_rank() == 0:
        same = plain["weights"].keys() == recomputed["weights"].keys() and all(
            torch.equal(plain["weights"][name], recomputed["weights"][name]) for name in plain["weights"])
        torch.save({"masks": gathered, "recompute_replays": same}, out / "lora-dropout.pt")


def local_experts(module: torch.nn.Module) -> list[tuple[int, int]]:
    """For each of the model's own MoE blocks, the experts it runs on this rank (all of them where not split over
    ep) and the parts tp splits each of them into (one whole expert's ``down_proj`` ÷ this rank's slice of it; a
    list's experts are whole)."""
    return [(forward.num_experts // forward.ranks if isinstance(forward := experts.forward, StackedExpertsParallel)
             else experts.num_experts, experts.down_proj[0].numel() // local_tensor(experts.down_proj)[0].numel())
            for experts in (*stacked_experts(module), *dense_experts(module))] + [
        (len(split.local), 1) for split in listed_experts_split(module)] + [
        (len(experts), 1) for experts in listed_experts(module).values()]


def main(out: Path, layouts: list[str]) -> None:
    trained_by_extras = {run for extra in layouts for run in TRAINED_BY_EXTRAS.get(extra, ())}
    for layout in layouts:
        if layout in EXTRAS:
            EXTRAS[layout](out)
            continue
        strategy, devices, replicas, models = LAYOUTS[layout]
        assert devices == int(os.environ["WORLD_SIZE"]), f"{layout} runs on {devices} processes"
        for family in models:
            if (layout, family) not in trained_by_extras:
                save_run(out, layout, family, parity.train("adamw", strategy=strategy(), devices=devices,
                                                           data_parallel=replicas,
                                                           model=lambda family=family: lit_causal_lm(family)))


def save_run(out: Path, layout: str, family: str, result: dict) -> None:
    """``family``'s run under ``layout`` (:func:`parity.train`'s ``result``), with the experts each rank ran
    (:func:`local_experts`, every rank's: a pipeline stage may hold no MoE block, DeepSeek-V3's dense first layer),
    saved by rank 0 as ``<layout>-<family>.pt``; a collective."""
    result = {**result}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, local_experts(result.pop("module")))
    result["local_experts"] = [experts for part in gathered for experts in part]
    if torch.distributed.get_rank() == 0:
        torch.save(result, out / f"{layout}-{family}.pt")


#: checks beside the layouts' parity runs: name -> what runs it (on as many processes as its layouts)
EXTRAS = {"reshard-tied": reshard_tied, "resume-split": resume_split,
          # litgpt's experts held as a list under ep2; LoRA adapters split with their Linears under tp2 (and the
          # embedding and head trained whole beside, their originals split with their copies)
          "resume-listed": functools.partial(resume_across, family="litgpt_moe", layout="ep2"),
          "resume-lora": functools.partial(resume_across, family="llama-lora-saved", layout="tp2"),
          "lora-dropout": lora_dropout}
#: the layouts' runs an extra trains and saves as theirs (each resumed run's uninterrupted one), not trained again
TRAINED_BY_EXTRAS = {"resume-split": [("dp2-tp2-ep2-split", "mixtral")], "resume-listed": [("ep2", "litgpt_moe")],
                     "resume-lora": [("tp2", "llama-lora-saved")], "reshard-tied": [("pp2-1f1b", "gpt2"),
                                                                                  ("ddp", "gpt2")]}

if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
