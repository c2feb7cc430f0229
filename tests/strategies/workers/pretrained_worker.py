"""Hugging Face weights in and out under each layout named, all in one launch: every family in ``FOLDERS``' folders
(written by ``save_pretrained``) is loaded by the PretrainedWeights callback, trained, saved as a meshlight
checkpoint, and exported back (``export_pretrained``); rank 0 saves the losses and the exported model's logits on
:data:`PROBE` to ``OUT/<layout>-<family>.pt``.

    python tests/forkrun.py 2 tests/strategies/workers/pretrained_worker.py OUT FOLDERS zero3 zero3-meta tp2 pp2 \
        litgpt-files
    python tests/forkrun.py 8 tests/strategies/workers/pretrained_worker.py OUT FOLDERS 3d
"""

import os
import sys
from pathlib import Path
from typing import Any

import torch

import meshlight as ml
from meshlight.demos import LitGPT
from meshlight.models import GPT, GPTConfig
from meshlight.parallel.pretrained import export_pretrained
from tests.strategies import parity
from tests.strategies.hf_models import attention_implementation, lit_causal_lm, with_lora
from tests.strategies.hf_vlm import family_of, image_inputs

# GPT-2: Conv1D, a fused q|k|v split for tp, its head tied to the embedding; gpt: meshlight's GPT in a Llama
# configuration, loading a Llama folder and exported as one (its q and k rows reordered for Llama's rotary channels)
FAMILIES = ("llama", "gpt2", "gpt")
#: meshlight's GPT with a Llama equivalent: 4 blocks, grouped-query attention, RMSNorm, SwiGLU, rotary, no biases
GPT_LLAMA = GPTConfig.tiny(vocab_size=16, max_seq_len=64, dim=64, n_layers=4, n_heads=8, n_kv_heads=4, bias=False,
                           norm="rmsnorm", mlp="swiglu", positions="rotary")
#: name -> (the strategy, processes, data-parallel replicas among them)
LAYOUTS = {
    "zero3": (lambda: ml.ZeroStrategy(stage=3), 2, 2),
    # the model built on the meta device in configure_model: each rank allocates its shards, the files fill them
    "zero3-meta": (lambda: ml.ZeroStrategy(stage=3), 2, 2),
    "tp2": (lambda: ml.TensorParallelStrategy(tp=2), 2, 1),
    "pp2": (lambda: ml.PipelineStrategy(pp=2, schedule="1f1b", microbatches=4), 2, 1),
    "3d": (lambda: ml.Hybrid3DStrategy(dp=2, pp=2, tp=2, microbatches=2), 8, 2),
}


def families(layout: str) -> tuple[str, ...]:
    """The families trained under ``layout``: every one, but on 8 processes (a run there costs ~9 on 2) GPT-2 (its
    head tied across the first and last stage, read from the embedding's key) and meshlight's GPT from a Llama folder
    (HF Llama's weights load under 3d as GPT-2's do); under zero3 and tp2 Mixtral too, whose files hold each expert
    apart: ZeRO-3 splits the stacked experts by experts, tp each expert (the fused gate|up part by part); under tp2
    GPT-OSS as well (its sinks split with the heads, its transposed experts by columns and rows), OLMo 2 (its q and k
    norms split as q and k are), DeepSeek-V3 (its latents' projections and norms whole, its up-projections by
    heads), Llama 4 (its experts stored stacked and transposed, each split over tp, the fused gate|up part by
    part), Falcon-7B's multi-query layout (its one key/value head, a part of the fused q|k|v, on every rank) and
    LLaVA (its files under the older names transformers renames on loading; its vision encoder whole on every rank)."""
    if LAYOUTS[layout][1] == 8:
        return ("gpt2", "gpt")
    tp2 = (*FAMILIES, "mixtral", "gpt_oss", "olmo2", "deepseek_v3", "llama4", "falcon", "llava")
    return {"zero3": (*FAMILIES, "mixtral"), "tp2": tp2}.get(layout, FAMILIES)


#: the tokens the exported models' logits are compared on
PROBE = torch.arange(32).reshape(2, 16) % 16


def model_of(family: str, *, meta: bool = False) -> Any:
    """The LightningModule training ``family``; ``meta``: its model built again on the meta device in
    ``configure_model``."""
    import transformers

    module = LitGPT(GPT_LLAMA, lr=1e-2, warmup_steps=2) if family == "gpt" else lit_causal_lm(family)
    config = module.model.config
    base, lora, variant = family.partition("-lora")

    def configure_model() -> None:
        with torch.device("meta"):
            module.model = (GPT(config) if family == "gpt" else
                            transformers.AutoModelForCausalLM.from_config(
                                config, attn_implementation=attention_implementation(base)))
            if lora:
                module.model = with_lora(module.model, base, saved="-saved" in variant, tokens="-tokens" in variant,
                                         dora="-dora" in variant)

    if meta:
        module.configure_model = configure_model
    return module


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    """``model``'s logits on :data:`PROBE` (meshlight's GPT returns them; Hugging Face's, in its output; a
    vision-language model's after an image: :func:`~tests.strategies.hf_vlm.image_inputs`)."""
    with torch.no_grad():
        if isinstance(model, GPT):
            output = model(PROBE)
        elif hasattr(model.config, "vision_config"):
            output = model(**image_inputs(family_of(model.config), PROBE))
        else:
            output = model(input_ids=PROBE)
    return output if isinstance(output, torch.Tensor) else output.logits


def from_pretrained(folder: Path) -> Any:
    """``from_pretrained`` of ``folder`` with the attention its family's parity model runs."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(folder))
    if hasattr(config, "vision_config"):
        return transformers.AutoModelForImageTextToText.from_pretrained(str(folder), attn_implementation="sdpa")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), attn_implementation=attention_implementation(config.model_type))


def exported_logits(folder: Path) -> torch.Tensor:
    return logits_of(from_pretrained(folder))


#: litgpt's weights as its own files hold them (``lit_model.pth``, a torch.save'd state dict, in the folder named after
#: the family), loaded under these layouts: tensor parallelism (the fused q|k|v part by part), pipelining, ZeRO-3, and
#: its MoE's experts held as a list split over ep=2 (each rank reads its experts only)
TORCH_FILES = {"tp2": "litgpt", "pp2": "litgpt", "zero3": "litgpt", "ep2": "litgpt_moe"}
TORCH_FILE_LAYOUTS = {**{name: LAYOUTS[name] for name in ("tp2", "pp2", "zero3")},
                      "ep2": (lambda: ml.MoEStrategy(ep=2), 2, 2)}


def litgpt_files(out: Path, folders: Path) -> None:
    """Each of :data:`TORCH_FILES`' runs trained from its family's ``lit_model.pth``; rank 0 saves its losses and
    full weights to ``OUT/<layout>-<family>-pth.pt``, and writes the run's checkpoint back as a ``lit_model.pth``
    (``consolidate``, the names without the LightningModule's ``model.``) to ``OUT/<layout>-<family>.pth``."""
    from meshlight.parallel.checkpoint import consolidate

    for layout, family in TORCH_FILES.items():
        strategy, devices, replicas = TORCH_FILE_LAYOUTS[layout]
        checkpoint = out / f"{layout}-{family}-pth.ckpt"
        result = parity.train("adamw", strategy=strategy(), devices=devices, data_parallel=replicas,
                              model=lambda family=family: lit_causal_lm(family), save_to=checkpoint,
                              callbacks=[ml.callbacks.PretrainedWeights(folders / family / "lit_model.pth")])
        result.pop("module")
        if torch.distributed.get_rank() == 0:
            torch.save(result, out / f"{layout}-{family}-pth.pt")
            consolidate(checkpoint, out / f"{layout}-{family}.pth", strip_prefix="model.")
        torch.distributed.barrier()


#: layout -> the model fine-tuned with PEFT's LoRA that loads its base model's folder under it: Llama, its embedding
#: and head trained whole beside (modules_to_save; ``-meta``: built on the meta device, its adapters initialized after
#: allocation, as DoRA, its magnitudes computed from the weights loaded), Qwen3-MoE with LoRA on its experts too,
#: split over 2 ranks (each adding its experts' part of the adapters' update), and GPT-2 with rows of its embedding
#: trained (trainable_token_indices; its head, tied to it, on the other stage: each stage's rows start from the rows
#: it loaded)
LORA_FILES = {"tp2": "llama-lora-saved", "zero3-meta": "llama-lora-saved-dora", "ep2": "qwen3_moe-lora",
              "pp2": "gpt2-lora-tokens"}


def lora_files(out: Path, folders: Path) -> None:
    """Each of :data:`LORA_FILES` trained under its layout from its base model's folder; rank 0 saves its losses and
    full weights to ``OUT/<layout>-<model>.pt``, and the run its checkpoint to ``….ckpt`` beside."""
    for layout, family in LORA_FILES.items():
        strategy, devices, replicas = {**LAYOUTS, **TORCH_FILE_LAYOUTS}[layout]
        result = parity.train("adamw", strategy=strategy(), devices=devices, data_parallel=replicas,
                              model=lambda layout=layout, family=family: model_of(
                                  family, meta=layout.endswith("-meta")),
                              save_to=out / f"{layout}-{family}.ckpt",
                              callbacks=[ml.callbacks.PretrainedWeights(folders / family.partition("-lora")[0])])
        result.pop("module")
        if torch.distributed.get_rank() == 0:
            torch.save(result, out / f"{layout}-{family}.pt")


def main(out: Path, folders: Path, layouts: list[str]) -> None:
    for layout in layouts:
        if layout in EXTRAS:
            EXTRAS[layout](out, folders)
            continue
        strategy, devices, replicas = LAYOUTS[layout]
        assert devices == int(os.environ["WORLD_SIZE"]), f"{layout} runs on {devices} processes"
        for family in families(layout):
            checkpoint = out / f"{layout}-{family}.ckpt"
            result = parity.train("adamw", strategy=strategy(), devices=devices, data_parallel=replicas,
                                  model=lambda family=family, layout=layout: model_of(
                                      family, meta=layout.endswith("-meta")),
                                  save_to=checkpoint,
                                  callbacks=[ml.callbacks.PretrainedWeights(folders / family)])
            result.pop("module")
            if torch.distributed.get_rank() == 0:
                exported = out / f"{layout}-{family}-hf"
                export_pretrained(checkpoint, exported)
                torch.save({"losses": result["losses"], "logits": exported_logits(exported)},
                           out / f"{layout}-{family}.pt")
            torch.distributed.barrier()


#: runs beside the layouts' (on 2 processes): litgpt's files, and a LoRA model loading its base model's
EXTRAS = {"litgpt-files": litgpt_files, "lora-files": lora_files}

if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
