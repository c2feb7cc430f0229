"""The ``meshlight`` command line.

    meshlight plan --model llama3-70b --gpus 1024 --gpu h100 --seq 8192     # layouts for a cluster you plan
    meshlight plan --model llama3-8b --gpus 64 --seq 131072                 # ... long sequences split over cp ranks
    meshlight plan --gpus 64 --layers 48 --hidden 6144 --heads 48 --vocab 32000   # ... for a model of your own
    meshlight plan --config ./Qwen2.5-7B --gpus 16                          # ... a Hugging Face or litgpt config
    meshlight consolidate runs/ckpt/step=000001000 model.safetensors         # one full state dict, for inference
    meshlight export runs/ckpt/last hf-model --to hf                          # a folder from_pretrained loads
    meshlight export runs/ckpt/last adapter --to peft                         # a LoRA fine-tune's adapter folder
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Sequence
from typing import Any, Optional

import torch

from meshlight.models.from_config import ModelConfigError, model_from_config
from meshlight.parallel.activation_compression import COMPRESSED_DTYPES
from meshlight.parallel.compression import GradientCompression
from meshlight.parallel.pipeline import SCHEDULES, stage_blocks_of
from meshlight.parallel.planner import (
    HARDWARE,
    LONG_SEQUENCE,
    MODELS,
    Candidate,
    Hardware,
    ModelSpec,
    PlanError,
    format_plan,
    model_spec_of,
    more_devices_hint,
    plan,
    precision_bytes,
    same_devices_hint,
    shown_layouts,
)
from meshlight.parallel.presets import GB

__all__ = ["main"]

#: ``--precision``: Lightning's precision flag and the MixedPrecision callback's parameter dtype it stands for
PRECISIONS = {"bf16": ("32-true", torch.bfloat16), "bf16-mixed": ("bf16-mixed", None), "bf16-true": ("bf16-true", None),
              "32-true": ("32-true", None)}
TOKENS_PER_STEP = 4 * 2**20  # default global batch: about 4M tokens, as large pretraining runs use
#: ``meshlight plan``'s model-shape flags: the ModelSpec field each sets, and what it means
SHAPE_FLAGS = {
    "layers": ("layers", "transformer blocks"), "hidden": ("hidden", "model width"),
    "heads": ("heads", "attention heads"), "kv-heads": ("kv_heads", "key/value heads (default: --heads)"),
    "ffn": ("ffn_hidden", "MLP width (default: 4 × --hidden)"), "vocab": ("vocab", "vocabulary size"),
    "experts": ("experts", "experts per MoE layer (default 0: dense)"),
    "top-k": ("top_k", "experts per token (default 2 with --experts)"),
    "seq": ("seq_len", "sequence length (default: the preset's; custom: 4096)"),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="meshlight", description="meshlight command line")
    commands = parser.add_subparsers(dest="command", required=True)
    planner = commands.add_parser(
        "plan", help="rank parallel layouts for a model on a cluster (no devices needed)",
        description="Estimate per-device memory and step time of every valid (dp, pp, tp, cp, ep, zero,"
                    " microbatches, virtual stages, recomputation) and print the best layouts. Exit status: 0 when a"
                    " layout fits, 1 when none does (what would fit is printed), 2 for input no layout can have.")
    source = planner.add_mutually_exclusive_group()
    source.add_argument("--model", choices=sorted(MODELS),
                        help="model preset; or give your model's shape with the flags below (they also override a"
                             " preset's)")
    source.add_argument("--config", metavar="PATH",
                        help="a Hugging Face model's config.json or a litgpt model_config.yaml, or a checkpoint's"
                             " folder holding one: read from disk, nothing downloaded, the model built on the meta"
                             " device (needs meshlight[hf] or [litgpt]); the shape flags below override it")
    shape = planner.add_argument_group("model shape (your own model, or changes to a preset)")
    for flag, (_, meaning) in SHAPE_FLAGS.items():
        shape.add_argument(f"--{flag}", type=int, help=meaning)
    shape.add_argument("--mlp", choices=("swiglu", "gelu"), help="MLP kind (default: the preset's; custom: gelu)")
    shape.add_argument("--trainable", type=float, metavar="SHARE",
                       help="share of the parameters that train, the others frozen: no gradients, no optimizer"
                            " state, no weight-gradient matmuls (default 1; a LoRA fine-tune's adapters: about 0.01)")
    planner.add_argument("--gpus", type=int, required=True, help="number of devices")
    planner.add_argument("--gpu", default="h100", choices=sorted(HARDWARE), help="device preset (default h100)")
    planner.add_argument("--gpus-per-node", type=int, help="devices per node (default: the preset's)")
    planner.add_argument("--gpu-memory", type=float, help="GB of memory per device (default: the preset's)")
    planner.add_argument("--host-memory", type=float,
                         help="GB of host memory per device, for what Offload keeps there (default 256: a 2 TB"
                              " node's over its 8 GPUs)")
    planner.add_argument("--host-bandwidth", type=float,
                         help="GB/s each way between a device and host memory, for Offload's copies (default: the"
                              " preset's PCIe link at 85%%, 54.4 for PCIe 5)")
    planner.add_argument("--host-step-rate", type=float,
                         help="billion parameters per second one host thread's optimizer step reaches under optimizer"
                              " offload (default 0.78: fused AdamW on an H100 machine's host)")
    planner.add_argument("--host-threads", type=int,
                         help="host threads each device's process steps its optimizer with (default 1: torchrun's"
                              " OMP_NUM_THREADS=1)")
    planner.add_argument("--host-memory-bandwidth", type=float,
                         help="GB/s of a node's host memory, which its devices' host steps share (default 461: two"
                              " sockets of eight DDR5-4800 channels at 75%%; 307 for A100 presets)")
    planner.add_argument("--memory-bandwidth", type=float,
                         help="GB/s of device memory, at which the kernels between the matmuls stream activations"
                              " (default: the preset's datasheet figure, 3350 for an H100 SXM)")
    planner.add_argument("--peak-tflops", type=float,
                         help="dense bf16 TFLOP/s per device (default: the preset's; a 32-true run computes at the"
                              " preset's fp32 or TF32 rate)")
    planner.add_argument("--precision", choices=list(PRECISIONS), default="bf16",
                         help="bf16: meshlight's MixedPrecision callback (default); bf16-mixed: Lightning's autocast"
                              " flag (fp32 parameters); bf16-true: everything in bf16, optimizer state included;"
                              " 32-true: fp32")
    planner.add_argument("--float32-matmul-precision", choices=("highest", "high", "medium"), default="highest",
                         help="with --precision 32-true: torch.set_float32_matmul_precision's setting — highest"
                              " (torch's default) keeps fp32 matmuls off the tensor cores, high and medium run TF32")
    planner.add_argument("--offload-optimizer", action="store_true",
                         help="the Offload callback's optimizer offload: master shards, their gradients and the"
                              " optimizer state in host memory, stepped there")
    planner.add_argument("--offload-activations", type=float, default=0.0, metavar="SHARE",
                         help="share of the blocks whose saved activations the Offload callback keeps in host"
                              " memory, 1/n for every n-th block (1: every block; 0.5:"
                              " Offload(activations_every_n_blocks=2))")
    planner.add_argument("--compress-activations", choices=("bf16", "fp8_e4m3"),
                         help="every block's saved activations kept in this dtype (the ActivationCompression"
                              " callback)")
    planner.add_argument("--grad-compression", choices=("bf16", "fp16"),
                         help="gradients reduced in this dtype over the data-parallel ranks (the strategies'"
                              " grad_compression; PowerSGD runs on plain DDP only, which needs no plan)")
    planner.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: ~4M tokens)")
    for size in ("dp", "pp", "tp", "ep", "zero"):
        planner.add_argument(f"--{size}", type=int, help=f"fix {size} instead of planning it")
    planner.add_argument("--cp", type=int, help="fix cp (the ranks each sequence is split over) instead of planning"
                                                f" it; planned for sequences longer than {LONG_SEQUENCE} tokens")
    planner.add_argument("--expert-layout", choices=("split", "fold"),
                         help="fix where an MoE model's experts sit under tp: split over the tp ranks, or folded into"
                              " ep (ep spanning the tp ranks); default: both are planned")
    planner.add_argument("--schedule", choices=list(SCHEDULES), help="fix the pipeline schedule")
    planner.add_argument("--virtual-stages", type=int, help="fix the pipeline stages per rank")
    planner.add_argument("--microbatches", type=int, help="fix the microbatches of a pipelined replica's batch")
    planner.add_argument("--recompute", choices=("yes", "no"), help="fix whether every block recomputes its"
                                                                     " activations in backward")
    planner.add_argument("--keep-gathered-inputs", action="store_true",
                         help="keep the sequence-gathered inputs of the tensor-parallel projections for backward"
                              " (default: gathered again, as Megatron-LM does)")
    planner.add_argument("--top", type=int, default=5, help="layouts to show (default 5)")
    planner.add_argument("--json", action="store_true", help="print the best layouts as JSON")
    merge = commands.add_parser(
        "consolidate", help="write a sharded checkpoint's model weights as one file",
        description="Gather the model weights of a sharded meshlight checkpoint (any layout) into one full state"
                    " dict: OUT ending in .safetensors is written as safetensors, anything else with torch.save.")
    merge.add_argument("checkpoint", help="checkpoint folder or URL")
    merge.add_argument("out", help="output file (.safetensors or .pt)")
    merge.add_argument("--strip-prefix", default="", help='remove this prefix from names, e.g. "model."')
    export = commands.add_parser(
        "export", help="write a sharded checkpoint's model in another library's layout",
        description="Write the model weights of a sharded meshlight checkpoint (any layout) as Hugging Face"
                    " safetensors (sharded above --max-shard-gb, with their index) and its config.json, a folder"
                    " AutoModelForCausalLM.from_pretrained loads. A PEFT model (LoRA) is written merged into its base"
                    " model's weights (--to hf), or as PEFT's adapter folder (--to peft), which"
                    " PeftModel.from_pretrained loads onto the base model.")
    export.add_argument("checkpoint", help="checkpoint folder")
    export.add_argument("out", help="output folder")
    export.add_argument("--to", choices=("hf", "peft"), default="hf",
                        help="the layout to write (hf: Hugging Face, a PEFT model merged; peft: its adapters)")
    export.add_argument("--prefix", default="model.",
                        help='the names the model has in the LightningModule (default "model.": its self.model)')
    export.add_argument("--config", help="config.json to write beside the weights (a file, or a folder holding"
                                         " one); default: the one the checkpoint saved with the model")
    export.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file (default 5)")
    args = parser.parse_args(argv)
    if args.command == "consolidate":
        return _consolidate(args)
    if args.command == "export":
        return _export(args)
    try:
        model, hardware = _model_of(args), _hardware_of(args)
    except ValueError as error:
        planner.error(str(error))
    global_batch = args.global_batch if args.global_batch is not None else max(TOKENS_PER_STEP // model.seq_len, 1)
    fixed = {k: v for k, v in dict(dp=args.dp, pp=args.pp, tp=args.tp, ep=args.ep, zero=args.zero, cp=args.cp,
                                   schedule=args.schedule, virtual_stages=args.virtual_stages,
                                   microbatches=args.microbatches, experts=args.expert_layout,
                                   recompute=None if args.recompute is None else args.recompute == "yes").items()
             if v is not None}
    # a config's model unchanged by shape flags: each pipeline rank priced by the blocks of its stages, as the
    # strategy's split cuts them at fit
    reshaped = args.mlp or any(getattr(args, flag.replace("-", "_")) is not None for flag in SHAPE_FLAGS
                               if flag != "seq")
    if args.config and not reshaped:
        fixed["stage_blocks"] = stage_blocks_of(_config_module(args.config))
    try:
        candidates = plan(model, hardware, args.gpus, global_batch, **fixed)
    except PlanError as error:
        print(f"meshlight plan: {error}", file=sys.stderr)
        return 2
    if args.json:
        rows = [{"layout": c.describe(), **c.strategy_arguments(), "recompute": c.recompute,
                 "memory_bytes": c.memory_bytes, "host_bytes": c.host_bytes, "fits": c.fits,
                 "step_seconds": c.step_time,
                 "tokens_per_second_per_device": c.tokens_per_second_per_device, "mfu": c.mfu, "times": c.times}
                for c in shown_layouts(candidates, args.top)]
        print(json.dumps(rows, indent=1))
        if not candidates[0].fits:  # the rows say "fits": false; what would fit goes beside them
            print(_remedies(model, hardware, args, global_batch, fixed), file=sys.stderr)
    else:
        print(f"{model.name} (seq {model.seq_len}, global batch {global_batch}) on {args.gpus} × {hardware.name},"
              f" {hardware.devices_per_node} per node, precision {args.precision}"
              + (", optimizer state in host memory" if args.offload_optimizer else "")
              + (f", {args.offload_activations:.0%} of the blocks' activations in host memory"
                 if args.offload_activations else "") + ":")
        print(format_plan(candidates, top=args.top))
        if candidates[0].fits:
            print(_how_to_train(candidates[0], global_batch, args, hardware.devices_per_node))
        else:
            print(_remedies(model, hardware, args, global_batch, fixed))
    return 0 if candidates[0].fits else 1


def _how_to_train(best: Candidate, global_batch: int, args: argparse.Namespace, per_node: int) -> str:
    """The Trainer arguments that run ``best``: the devices (``per_node`` on each node), its sizes given to
    ``Hybrid3DStrategy`` (all of them, so that nothing is planned again at fit), the accumulation, precision,
    compression and offloading it was planned with, and each data-parallel replica's batch."""
    sizes = {key: value for key, value in best.strategy_arguments().items()
             if key in ("dp", "pp", "tp", "ep", "zero") or (key == "cp" and value > 1) or (
                 best.pp > 1 and key in ("schedule", "microbatches")) or (key == "virtual_stages" and value > 1)
             or (key == "experts" and best.ep > 1 and best.tp > 1)}
    if args.grad_compression:
        sizes["grad_compression"] = args.grad_compression
    if args.keep_gathered_inputs:
        sizes["keep_gathered_inputs"] = True
    strategy = ", ".join(f"{key}={value!r}" for key, value in sizes.items())
    options = [f"strategy=Hybrid3DStrategy({strategy}, recompute={best.recompute})"]
    if args.gpus <= per_node or args.gpus % per_node == 0:  # Lightning runs as many devices on every node
        nodes = max(1, args.gpus // per_node)
        options.insert(0, f"devices={args.gpus // nodes}" + (f", num_nodes={nodes}" if nodes > 1 else ""))
    if best.pp == 1 and best.microbatches > 1:
        options.append(f"accumulate_grad_batches={best.microbatches}")
    callbacks = []
    if args.precision == "bf16":
        callbacks.append('MixedPrecision("bf16")')
    else:
        options.append(f"precision={args.precision!r}")
    if args.offload_optimizer or args.offload_activations:
        every = round(1 / args.offload_activations) if args.offload_activations else None
        callbacks.append(f"Offload(optimizer={args.offload_optimizer}"
                         + (f", activations_every_n_blocks={every}" if every else "") + ")")
    if args.compress_activations:
        callbacks.append(f"ActivationCompression({args.compress_activations!r})")
    if callbacks:
        options.append(f"callbacks=[{', '.join(callbacks)}]")
    batch = global_batch // best.dp // (best.microbatches if best.pp == 1 else 1)
    tf32 = (f" (after torch.set_float32_matmul_precision({args.float32_matmul_precision!r}))"
            if args.precision == "32-true" and args.float32_matmul_precision != "highest" else "")
    return (f"Train it{tf32}: Trainer({', '.join(options)}), each data-parallel replica's DataLoader giving batches"
            f" of {batch} sequence{'s' if batch > 1 else ''}.")


def _remedies(model: ModelSpec, hardware: Hardware, args: argparse.Namespace, global_batch: int,
              fixed: dict[str, Any]) -> str:
    """For a plan nothing fits: what would fit on the same devices, and on how many it fits as it is."""
    hint = functools.partial(same_devices_hint, model, hardware, args.gpus, global_batch, offload=args.gpu != "cpu")
    here = (hint(fixed=fixed) if fixed else "") or hint()  # keeping what was fixed, where that fits
    return "\n".join(filter(None, (here, more_devices_hint(model, hardware, args.gpus, global_batch))))


def _model_of(args: argparse.Namespace) -> ModelSpec:
    """The preset named by ``--model`` with the shape flags given applied, or a model made of those flags."""
    changes = {field: getattr(args, flag.replace("-", "_")) for flag, (field, _) in SHAPE_FLAGS.items()}
    changes = {field: value for field, value in changes.items() if value is not None}
    if args.mlp:
        changes["swiglu"] = args.mlp == "swiglu"
    if args.model:
        base = MODELS[args.model]
    elif args.config:
        base = _config_model(args.config)
    else:
        required = ("layers", "hidden", "heads", "vocab")
        missing = [f"--{flag}" for flag in required if SHAPE_FLAGS[flag][0] not in changes]
        if missing:
            raise ValueError(f"give --model, or your model's shape: {', '.join(missing)} missing (--kv-heads,"
                             " --ffn, --experts, --top-k, --mlp and --seq are optional)")
        hidden, heads = changes["hidden"], changes["heads"]
        base = ModelSpec(changes["layers"], hidden, heads, heads, 4 * hidden, changes["vocab"], seq_len=4096,
                         swiglu=False, name=f"custom {changes['layers']}×{hidden}")
    if args.trainable is not None:
        if not 0 < args.trainable <= 1:
            raise ValueError(f"--trainable {args.trainable}: give the share of the parameters that train, in (0, 1]")
        changes["trainable"] = args.trainable
    if changes.get("experts") and "top_k" not in changes and not base.experts:
        changes["top_k"] = 2
    changed = [f"{field}={value}" for field, value in changes.items() if field != "seq_len"]
    if (args.model or args.config) and changed:
        changes["name"] = f"{base.name} with {', '.join(changed)}"
    model = base.replace(**changes, keep_gathered_inputs=args.keep_gathered_inputs)
    for flag, (field, _) in SHAPE_FLAGS.items():
        value = getattr(model, field)
        if value < (0 if field == "experts" else 1):
            raise ValueError(f"--{flag} {value}: give a whole number ≥ {0 if field == 'experts' else 1}")
    if model.hidden % model.heads:
        raise ValueError(f"--heads {model.heads} must divide --hidden {model.hidden}")
    if model.heads % model.kv_heads:
        raise ValueError(f"--kv-heads {model.kv_heads} must divide --heads {model.heads}")
    if model.experts and model.top_k > model.experts:
        raise ValueError(f"--top-k {model.top_k} is more than --experts {model.experts}")
    return model


def _config_model(path: str) -> ModelSpec:
    """The planner's view of the model whose config is at ``path`` (:func:`~meshlight.models.model_from_config`:
    built on the meta device), read as :func:`~meshlight.parallel.planner.model_spec_of` reads a module; sequences
    of 4096 tokens unless ``--seq`` says otherwise."""
    try:
        module = _config_module(path)
    except ModelConfigError as error:
        raise ValueError(f"--config {error} Or give the model's shape: --layers, --hidden, --heads, --vocab.") from None
    return model_spec_of(module, 4096).replace(name=f"{type(module).__name__} ({path})")


#: the model a config describes, built once (on the meta device) for its shape and its pipeline split
_config_module = functools.cache(model_from_config)


def _hardware_of(args: argparse.Namespace) -> Hardware:
    """The device preset named by ``--gpu``, with the memory, peak and node size given."""
    preset, changes, changed = HARDWARE[args.gpu], {}, []
    for flag, field, value, scale, unit in (("gpus-per-node", "devices_per_node", args.gpus_per_node, 1, ""),
                                            ("gpu-memory", "memory", args.gpu_memory, GB, "GB"),
                                            ("host-memory", "host_memory", args.host_memory, GB, "GB host memory"),
                                            ("host-bandwidth", "host_bandwidth", args.host_bandwidth, GB,
                                             "GB/s to the host"),
                                            ("host-step-rate", "host_step_rate", args.host_step_rate, 1e9,
                                             "billion parameters/s per host thread"),
                                            ("host-threads", "host_threads", args.host_threads, 1, "host threads"),
                                            ("host-memory-bandwidth", "host_memory_bandwidth",
                                             args.host_memory_bandwidth, GB, "GB/s host memory"),
                                            ("memory-bandwidth", "memory_bandwidth", args.memory_bandwidth, GB,
                                             "GB/s device memory"),
                                            ("peak-tflops", "peak_flops", args.peak_tflops, 1e12, "TFLOP/s")):
        if value is None:
            continue
        if value <= 0:
            raise ValueError(f"--{flag} {value:g}: give a number > 0")
        changes[field] = value * scale
        if unit:
            changed.append(f"{value:g} {unit}")
    if changed:
        changes["name"] = f"{preset.name} with {', '.join(changed)}"
    share = args.offload_activations
    if not 0 <= share <= 1:
        raise ValueError(f"--offload-activations {share:g}: give a share between 0 and 1")
    if share and abs(1 / round(1 / share) - share) > 0.01 * share:
        nearest = 1 / round(1 / share)
        raise ValueError(f"--offload-activations {share:g}: the Offload callback offloads every n-th block's"
                         f" activations, a share of 1/n: give 1, 0.5, 0.333, 0.25, … (the nearest: {nearest:.3g})")
    return preset.replace(**changes, **precision_bytes(*PRECISIONS[args.precision]),
                          offload_optimizer=args.offload_optimizer, offload_activations=args.offload_activations,
                          float32_matmul_precision=args.float32_matmul_precision,
                          gradient_compression=GradientCompression(args.grad_compression).ratio()
                          if args.grad_compression else 1.0,
                          compressed_activations=1.0 if args.compress_activations else 0.0,
                          compressed_activation_bytes=COMPRESSED_DTYPES[args.compress_activations or "bf16"].itemsize)


def _consolidate(args: argparse.Namespace) -> int:
    from meshlight.parallel.checkpoint import CheckpointError, consolidate

    try:
        state = consolidate(args.checkpoint, args.out, strip_prefix=args.strip_prefix)
    except (CheckpointError, ImportError) as error:
        print(f"meshlight consolidate: {error}", file=sys.stderr)
        return 2
    count = sum(t.numel() for t in state.values())
    print(f"Wrote {len(state)} tensors ({count:,} values) to {args.out}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from meshlight.parallel.checkpoint import CheckpointError
    from meshlight.parallel.pretrained import PretrainedWeightsError, export_pretrained

    try:
        files = export_pretrained(args.checkpoint, args.out, prefix=args.prefix, config=args.config,
                                  max_shard_bytes=int(args.max_shard_gb * 2**30), to=args.to)
    except (CheckpointError, PretrainedWeightsError, OSError) as error:
        print(f"meshlight export: {error}", file=sys.stderr)
        return 2
    if args.to == "hf" and "config.json" not in files:
        print("meshlight export: the checkpoint holds no Hugging Face config for this prefix; pass --config so that"
              " from_pretrained can load the folder.", file=sys.stderr)
    print(f"Wrote {', '.join(files)} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
