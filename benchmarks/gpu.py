"""One accelerator: a 1.02B-parameter GPT (sequence 2048, bf16, fused/flash SDPA, ``torch.compile`` per block)
trained through ``meshlight.Trainer`` and as the same training written as a plain PyTorch loop; MFU by
torchtitan's convention (6 × non-embedding parameters + attention FLOPs per token, against the device's dense
bf16 peak); and what activation checkpointing and offload cost and save in accelerator memory.

Sections (each a list of variants; every run in a fresh process, so its peak and resident bytes are its own;
``--rounds`` interleaves the variants so drift cancels, and the median is reported):

- ``speed``: ``plain autocast`` (fp32 weights, bf16 autocast, compiled blocks), ``plain fsdp2`` (the same with
  ``fully_shard`` per block over one rank and FSDP2's bf16 mixed-precision policy), ``meshlight``
  (``ml.Trainer(strategy="zero2")`` with ``MixedPrecision("bf16")`` and ``Compile()``: norms stay fp32, each an
  FSDP unit of its own) and ``meshlight bf16 norms`` (``MixedPrecision("bf16", fp32_norms=False)``: exactly the
  plain fsdp2 loop's units and policy, so its ratio is what meshlight and Lightning add). All use AdamW, fused on
  CUDA (torchtitan's default). Step time is the mean over ``--steps`` steps after ``--warmup`` (compilation)
  steps, synchronized; the data comes from the same DataLoader for all.
- ``memory``: ``meshlight`` without and with ``ActivationCheckpointing()``, ``Offload()`` (optimizer state, with
  the fp32 shards and gradients, in host memory) and ``Offload(optimizer=False, activations_every_n_blocks=1)``:
  peak accelerator bytes over the measured steps, bytes resident after a step, and step time.

A variant's name says what it adds to ``meshlight`` ("bf16 norms", "recompute", "offload optimizer", "offload
activations"), so a diagnostic mix runs as ``--variant "meshlight bf16 norms recompute"`` (one run, printed).

    python benchmarks/gpu.py [--section speed memory] [--batch 8] [--steps 20] [--warmup 8] [--rounds 2] [--out F]
    python benchmarks/gpu.py --smoke        # the same code on CPU: a tiny model, dynamo only (tests)

``--out F`` keeps the sections F already holds and replaces those measured now, so the two sections can run as
two commands (each inside a 10-minute limit). On a lent GPU machine, with its preinstalled PyTorch and
Lightning, the commands in ``run_all.GPU_COMMANDS`` (with ``PYTHONPATH=.``) write benchmarks/gpu_results.json;
commit the file and ``make bench`` formats it into RESULTS.md.

Prints JSON (and writes it to ``--out`` when given).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS = {
    "speed": ["plain autocast", "plain fsdp2", "meshlight", "meshlight bf16 norms"],
    "memory": ["meshlight", "meshlight recompute", "meshlight offload optimizer", "meshlight offload activations"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--section", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, backend eager, 2 steps")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--variant", default=None, help="one run of this variant in this process (printed)")
    args = parser.parse_args()
    if args.smoke:  # backend eager: dynamo traces the blocks, AOTAutograd is left to test_compile's (~30 s less)
        args.batch, args.seq, args.steps, args.warmup, args.rounds, args.backend = 2, 32, 2, 1, 1, "eager"

    import lightning
    import torch

    from meshlight.parallel.planner import detect_hardware

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    config = model_config(args.seq, smoke=args.smoke)
    if args.variant:  # one run, in a process of its own (see isolated)
        _init_single_process_group(device)
        print(RESULT + json.dumps(RUNNERS[args.variant.split(" ")[0]](args.variant, config, device, args)))
        return
    hardware = detect_hardware(device, 1)
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    jobs = [(section, variant) for section in args.section for _ in range(args.rounds) for variant in VARIANTS[section]]
    # on the device one run at a time, each timed alone; the smoke test's CPU runs two at a time (their figures mean
    # nothing, their code is what it checks)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2 if args.smoke else 1) as pool:
        results = list(pool.map(lambda job: isolated(job[1], sys.argv[1:]), jobs))
    for (section, variant), result in zip(jobs, results):
        runs.setdefault(section, {}).setdefault(variant, []).append(result)

    from meshlight.models import GPT

    with torch.device("meta"):
        model = GPT(config)
    flops_per_token = model.flops_per_token(args.seq)
    tokens = args.batch * args.seq
    setup = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "peak_flops": hardware.peak_flops, "torch": torch.__version__, "lightning": lightning.__version__,
        "cuda": torch.version.cuda,
        "model": {"params": model.num_params(), "non_embedding_params": model.num_params(exclude_embeddings=True),
                  "layers": config.n_layers, "dim": config.dim, "heads": config.n_heads, "seq": args.seq,
                  "batch": args.batch, "flops_per_token": flops_per_token},
    }
    # --out: sections measured earlier (another command, e.g. the other section within a 10-minute limit) stay,
    # when they were measured on the same device, versions and model
    summary = earlier_summary(Path(args.out), setup) if args.out else {}
    summary.update(setup, date=datetime.date.today().isoformat())
    sections = summary.setdefault("sections", {})
    for section, variants in runs.items():
        rows = {}
        for variant, results in variants.items():
            step = statistics.median(r["step_seconds"] for r in results)
            rows[variant] = {
                "step_seconds": step, "tokens_per_second": tokens / step,
                "mfu": tokens / step * flops_per_token / hardware.peak_flops,
                "peak_bytes": max(r["peak_bytes"] for r in results),
                "resident_bytes": max(r["resident_bytes"] for r in results),
                "rounds": [r["step_seconds"] for r in results],
                **{key: results[0][key] for key in ("host_step", "host_threads") if key in results[0]},
            }
        sections[section] = {"command": " ".join(["python", "benchmarks/gpu.py", *sys.argv[1:]]),
                             "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
                             "backend": args.backend, "date": datetime.date.today().isoformat(), "variants": rows}
    summary["ratios"] = ratios(sections, summary["model"]["params"])
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


#: How a variant's process (``--variant``) hands its result to the parent: one line, this prefix, then JSON.
RESULT = "gpu.py result: "


def isolated(variant: str, argv: list[str]) -> dict[str, float]:
    """Run ``variant`` in a fresh process with the same arguments: its peak and resident bytes are its own, not
    what an earlier variant's compiled code, trainer or caching allocator left in this one."""
    import subprocess

    with socket.socket() as free:  # a port of its own for its one-process group
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {**os.environ, "MASTER_PORT": str(port), "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, __file__, *argv, "--variant", variant], env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"gpu.py: the {variant!r} run failed (exit {done.returncode}); its output is above.")
    line = next(line for line in done.stdout.splitlines() if line.startswith(RESULT))
    return json.loads(line[len(RESULT):])


def earlier_summary(path: Path, setup: dict[str, Any]) -> dict[str, Any]:
    """What ``path`` holds, if it was measured with the same ``setup`` (device, versions, model); else nothing,
    with a warning naming what differs (sections from two setups would make meaningless ratios)."""
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    changed = [key for key, value in setup.items() if earlier.get(key) != value]
    if changed:
        print(f"{path} was measured with a different {', '.join(changed)}: its sections"
              f" {sorted(earlier.get('sections', {}))} are replaced, not merged.", file=sys.stderr)
        return {}
    return earlier


def ratios(sections: dict[str, Any], params: int) -> dict[str, Any]:
    """The targets' ratios from the sections measured (None where the device reports no memory: CPU)."""
    out: dict[str, Any] = {}
    if "speed" in sections:
        speed = sections["speed"]["variants"]
        for other in ("plain autocast", "plain fsdp2"):
            out[f"meshlight / {other}"] = _ratio(speed["meshlight"]["step_seconds"], speed[other]["step_seconds"])
        # the same FSDP2 units and policy as the plain loop: what meshlight and Lightning add, nothing else
        out["meshlight bf16 norms / plain fsdp2"] = _ratio(speed["meshlight bf16 norms"]["step_seconds"],
                                                           speed["plain fsdp2"]["step_seconds"])
    if "memory" in sections:
        memory = sections["memory"]["variants"]
        base, recompute = memory["meshlight"], memory["meshlight recompute"]
        optimizer, activations = memory["meshlight offload optimizer"], memory["meshlight offload activations"]
        optimizer_state = 8 * params * bool(base["peak_bytes"])  # AdamW's two fp32 moments
        out.update({
            "recompute: peak / none": _ratio(recompute["peak_bytes"], base["peak_bytes"]),
            # the activations' share: the peak above what stays between steps (weights, gradients, Adam)
            "recompute: peak activations / none": _ratio(recompute["peak_bytes"] - recompute["resident_bytes"],
                                                         base["peak_bytes"] - base["resident_bytes"]),
            "recompute: step / none": _ratio(recompute["step_seconds"], base["step_seconds"]),
            "offload optimizer: resident bytes removed / optimizer state":
                _ratio(base["resident_bytes"] - optimizer["resident_bytes"], optimizer_state),
            "offload optimizer: peak bytes removed / optimizer state":
                _ratio(base["peak_bytes"] - optimizer["peak_bytes"], optimizer_state),
            "offload optimizer: step / none": _ratio(optimizer["step_seconds"], base["step_seconds"]),
            "offload activations: peak / none": _ratio(activations["peak_bytes"], base["peak_bytes"]),
            "offload activations: step / none": _ratio(activations["step_seconds"], base["step_seconds"]),
        })
    return out


def _ratio(numerator: float, denominator: float) -> Any:
    return numerator / denominator if denominator else None


def model_config(seq: int, *, smoke: bool = False):  # noqa: ANN201 - a GPTConfig
    """1.02B parameters (0.91B without the token embedding): 16 blocks of width 2048, 16 heads of 128, SwiGLU,
    RMSNorm, rotary positions, untied embedding and head (Llama-shaped, GPT-2 vocabulary)."""
    from meshlight.models import GPTConfig

    if smoke:
        return GPTConfig.tiny(max_seq_len=seq, n_layers=2, mlp="swiglu", norm="rmsnorm", positions="rotary", bias=False)
    return GPTConfig(vocab_size=50304, max_seq_len=seq, n_layers=16, n_heads=16, dim=2048, mlp="swiglu",
                     norm="rmsnorm", positions="rotary", bias=False, tie_embeddings=False)


def _init_single_process_group(device: Any) -> None:
    """A one-process group (FSDP2 over one rank needs it; Lightning then finds it initialized)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(name, value)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def _loader(config: Any, args: Any) -> Any:
    from torch.utils.data import DataLoader

    from meshlight.demos import RandomTokensDataModule

    data = RandomTokensDataModule(config.vocab_size, args.seq, batch_size=args.batch,
                                  train_size=args.batch * (args.warmup + args.steps), val_size=args.batch)
    data.setup()
    return DataLoader(data.train_set, batch_size=args.batch, shuffle=False, drop_last=True)


def _optimizer(model: Any, total_steps: int) -> tuple[Any, Any]:
    """LitGPT's optimizer and schedule: AdamW (matrices decayed), linear warmup then cosine."""
    import torch

    from meshlight.demos.lit_gpt import _warmup_cosine

    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    on_cuda = next(model.parameters()).is_cuda  # the fused kernel on CUDA, as torchtitan's default
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
                                  lr=3e-4, betas=(0.9, 0.95), fused=on_cuda or None)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(2, total_steps, 0.1))


class _Window:
    """Times the steps after warmup (synchronized) and records peak and resident accelerator memory."""

    def __init__(self, device: Any, warmup: int, steps: int) -> None:
        self.device, self.warmup, self.steps = device, warmup, steps
        self.start = self.step_seconds = 0.0
        self.peak_bytes = self.resident_bytes = 0

    def before(self, index: int) -> None:
        if index == self.warmup:
            self._synchronize()
            if self.device.type == "cuda":
                import torch

                torch.cuda.reset_peak_memory_stats(self.device)
            self.start = time.perf_counter()

    def after(self, index: int) -> None:
        if index == self.warmup + self.steps - 1:
            self._synchronize()
            self.step_seconds = (time.perf_counter() - self.start) / self.steps
            if self.device.type == "cuda":
                import torch

                self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
                self.resident_bytes = torch.cuda.memory_allocated(self.device)

    def result(self) -> dict[str, float]:
        return {"step_seconds": self.step_seconds, "peak_bytes": self.peak_bytes, "resident_bytes": self.resident_bytes}

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)


def run_plain(variant: str, config: Any, device: Any, args: Any) -> dict[str, float]:
    """The loop a user writes by hand: compiled blocks, bf16 autocast over fp32 weights or FSDP2's bf16 policy."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from meshlight.models import GPT

    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config)
    for block in model.blocks:
        block.forward = torch.compile(block.forward, backend=args.backend)
    autocast = variant == "plain autocast"
    if not autocast:
        mesh = init_device_mesh(device.type, (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer, scheduler = _optimizer(model, args.warmup + args.steps)
    window = _Window(device, args.warmup, args.steps)
    for index, (inputs, targets) in enumerate(_loader(config, args)):
        window.before(index)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model.loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        window.after(index)
    return window.result()


def run_meshlight(variant: str, config: Any, device: Any, args: Any) -> dict[str, float]:
    """The same training as a LightningModule through ``meshlight.Trainer``."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    import meshlight as ml
    from meshlight.callbacks import ActivationCheckpointing, Compile, MixedPrecision, Offload
    from meshlight.demos import LitGPT

    class Module(LitGPT):
        def configure_optimizers(self) -> Any:
            optimizer, scheduler = _optimizer(self, args.warmup + args.steps)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class Timing(Callback):
        def __init__(self) -> None:
            self.window = _Window(device, args.warmup, args.steps)

        def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, index: int) -> None:
            self.window.before(index)

        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, index: int) -> None:
            self.window.after(index)

    extra = {"recompute": [ActivationCheckpointing()], "offload optimizer": [Offload()],
             "offload activations": [Offload(optimizer=False, activations_every_n_blocks=1)]}
    callbacks = [callback for words, chosen in extra.items() if words in variant for callback in chosen]
    timing = Timing()
    pl.seed_everything(0, verbose=False)
    trainer = ml.Trainer(
        strategy="zero2", devices=1, accelerator="gpu" if device.type == "cuda" else "cpu",
        max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[MixedPrecision("bf16", fp32_norms="bf16 norms" not in variant), Compile(backend=args.backend),
                   *callbacks, timing],
    )
    trainer.fit(Module(config), train_dataloaders=_loader(config, args))
    result: dict[str, Any] = timing.window.result()
    if "offload optimizer" in variant:  # how the host stepped AdamW, and on how many threads
        import torch

        fused = all(group["fused"] for optimizer in trainer.optimizers for group in optimizer.param_groups)
        result["host_step"] = "torch's fused host kernel" if fused else "torch's per-parameter loop"
        result["host_threads"] = torch.get_num_threads()
    return result


RUNNERS = {"plain": run_plain, "meshlight": run_meshlight}


if __name__ == "__main__":
    main()
