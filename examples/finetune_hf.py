"""Fine-tune a Hugging Face causal LM with any meshlight strategy: the model sits unchanged in a plain LightningModule.

    python examples/finetune_hf.py                                        # a tiny random Llama, ddp on 2 processes
    python examples/finetune_hf.py --strategy pipeline                    # its layers in 2 pipeline stages
    python examples/finetune_hf.py --family gpt2 --strategy zero3         # GPT-2 (tied head), ZeRO-3
    python examples/finetune_hf.py --strategy 3d --devices 8              # dp=2 × pp=2 × tp=2 (sequence parallel)
    python examples/finetune_hf.py --family mixtral --strategy moe        # Mixtral's 4 experts over 2 ranks (ep=2)
    python examples/finetune_hf.py --model-path ./my-model --strategy tp  # a local save_pretrained folder
    python examples/finetune_hf.py --model-path ./my-model --export ./tuned   # ... written back for from_pretrained
    python examples/finetune_hf.py --lora 8 --strategy 3d --devices 8     # LoRA (PEFT) on every Linear, under 3d
    python examples/finetune_hf.py --lora 8 --export ./merged --export-adapter ./adapter   # ... merged, and its adapter
    python examples/finetune_hf.py --lora 8 --dora --strategy tp          # DoRA, split over tp=2 with its Linears

The task is the addition of examples/train_gpt.py (``^12+34=640``: the sum least-significant digit first). With
``--model-path`` the model's own tokens stand for the digits, ``+``, ``=`` and ``^`` (its tokenizer in the folder,
or else its first 16 token ids); the model is built from the folder's config and its weights are loaded by
``PretrainedWeights`` once the strategy has split it, each rank reading only its part. ``--export`` writes the
trained model back as a folder ``from_pretrained`` loads (``meshlight export``). ``--lora R`` fine-tunes LoRA adapters
of rank R on every Linear but the head (PEFT's ``"all-linear"``), the model's own weights frozen (``pip install
meshlight[peft]``), as DoRA with ``--dora``; ``--export`` then writes the model with the adapters merged,
``--export-adapter`` PEFT's adapter folder, which ``PeftModel.from_pretrained`` loads onto the base model. Nothing is
downloaded: ``--family`` builds a small random model from a config (4 layers, width 128; Mixtral's with 4 experts,
top-2, in every layer), which reaches 100% answer accuracy in the default 500 steps: 50 s on 2 CPU processes (ddp,
Llama).
Requires ``pip install meshlight[hf]``.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor

import meshlight as ml
from meshlight.demos import AdditionDataModule
from meshlight.demos.data import IGNORE_INDEX

FAMILIES = ("llama", "qwen2", "qwen3", "gpt2", "mixtral")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, help="a local save_pretrained folder (default: a tiny random model)")
    parser.add_argument("--family", default="llama", choices=FAMILIES, help="the tiny model's family (default: llama)")
    parser.add_argument("--strategy", default="ddp",
                        help="ddp, zero1, zero2, zero3, tp, pipeline, moe (Mixtral's experts over ep), 3d"
                             " (default: ddp)")
    parser.add_argument("--devices", type=int, default=2, help="processes (CPU) or GPUs (default: 2)")
    parser.add_argument("--accelerator", default="cpu", help="cpu or gpu (default: cpu)")
    parser.add_argument("--max-steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per step per data replica (default: 64)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-every", type=int, default=100, help="validate every N steps (default: 100)")
    parser.add_argument("--out", type=Path, default=Path("runs/finetune_hf"), help="logs (default: runs/finetune_hf)")
    parser.add_argument("--export", type=Path, help="write the trained model here as a save_pretrained folder")
    parser.add_argument("--lora", type=int, default=0, metavar="R",
                        help="train LoRA adapters of rank R on every Linear but the head, the model frozen (PEFT)")
    parser.add_argument("--export-adapter", type=Path, help="with --lora: write PEFT's adapter folder here")
    parser.add_argument("--dora", action="store_true", help="with --lora: DoRA (a magnitude per output beside LoRA)")
    args = parser.parse_args(argv)
    if args.export_adapter is not None and not args.lora:
        parser.error("--export-adapter writes LoRA adapters: give --lora R too")
    if args.dora and not args.lora:
        parser.error("--dora trains DoRA adapters: give --lora R too")
    return args


def with_lora(model: Any, rank: int, dora: bool = False) -> Any:
    """``model`` adapted by PEFT's LoRA of ``rank`` on every Linear but the output head (``dora``: as DoRA), its own
    weights frozen; lora_alpha = 2·rank, as PEFT's examples set it."""
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                                      use_dora=dora))


def tiny_model(family: str) -> Any:
    """A randomly initialized 4-layer model of ``family``, 128 wide, whose vocabulary is the task's 16 symbols
    (Mixtral's: 4 experts, top-2, in every layer)."""
    import transformers

    vocab = AdditionDataModule.vocab_size
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_embd=128, n_layer=4, n_head=4, n_positions=64,
                                         use_cache=False)
    else:
        config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                        "qwen3": transformers.Qwen3Config, "mixtral": transformers.MixtralConfig}[family]
        experts = dict(num_local_experts=4, num_experts_per_tok=2) if family == "mixtral" else {}
        config = config_class(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                              tie_word_embeddings=False, use_cache=False, **experts)
    return transformers.AutoModelForCausalLM.from_config(config)


def symbol_ids(model_path: Optional[Path], vocab_size: int) -> Tensor:
    """The model's token id for each of the task's symbols: its tokenizer's, or the first 16 ids."""
    symbols = AdditionDataModule.SYMBOLS
    if model_path is not None and any(model_path.glob("tokenizer*")):
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
        ids = [tokenizer.convert_tokens_to_ids(symbol) for symbol in symbols]
        missing = [s for s, i in zip(symbols, ids) if i is None or i == tokenizer.unk_token_id]
        if missing:
            raise SystemExit(f"The tokenizer in {model_path} has no single token for {missing}.")
        return torch.tensor(ids + [ids[-1]] * (AdditionDataModule.vocab_size - len(ids)))
    if vocab_size < AdditionDataModule.vocab_size:
        raise SystemExit(f"The model's vocabulary ({vocab_size}) is smaller than the task's 16 symbols.")
    return torch.arange(AdditionDataModule.vocab_size)


class LitCausalLM(pl.LightningModule):
    """Next-token fine-tuning of a Hugging Face causal LM on ``(inputs, targets)`` batches of the task's symbols,
    which ``symbols`` maps to the model's token ids."""

    def __init__(self, model: Any, symbols: Tensor, lr: float, max_steps: int) -> None:
        super().__init__()
        self.model, self.lr, self.max_steps = model, lr, max_steps
        self.register_buffer("symbols", symbols, persistent=False)

    def forward(self, inputs: Tensor) -> Tensor:
        return self.model(input_ids=inputs).logits

    def _step(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """The loss, the logits and the targets in the model's token ids. Under tensor parallelism the training
        logits are a DTensor sharded over the vocabulary, which F.cross_entropy takes as it is (loss parallelism);
        in validation they are whole."""
        inputs, targets = batch
        targets = torch.where(targets != IGNORE_INDEX, self.symbols[targets.clamp_min(0)], IGNORE_INDEX)
        logits = self(self.symbols[inputs]).float()
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        return loss, logits, targets

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, _, _ = self._step(batch)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, logits, targets = self._step(batch)
        right = (logits.argmax(-1) == targets) | (targets == IGNORE_INDEX)
        self.log("val/loss", loss, sync_dist=True)
        self.log("val/answer_accuracy", right.all(dim=1).float().mean(), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        trained = [p for p in self.parameters() if p.requires_grad]  # (with LoRA: the adapters)
        optimizer = torch.optim.AdamW(trained, lr=self.lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, self.lr, total_steps=self.max_steps, pct_start=0.1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def strategy_for(name: str, devices: int, experts: int) -> Any:
    """``--strategy`` as meshlight takes it; ``3d`` on 8 CPU processes is dp=2 × pp=2 × tp=2; ``moe`` splits the
    model's ``experts`` over as many processes as divide both (the rest replicate them)."""
    if name == "3d" and devices == 8:
        return ml.Hybrid3DStrategy(dp=2, pp=2, tp=2, microbatches=4)
    if name == "moe":
        if not experts:
            raise SystemExit("--strategy moe splits a model's experts: use --family mixtral, or a model that has them.")
        return ml.MoEStrategy(ep=math.gcd(devices, experts))
    if name == "pipeline":
        return ml.PipelineStrategy(pp=devices, schedule="1f1b", microbatches=2 * devices)
    return name


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    pl.seed_everything(0, verbose=False)
    callbacks = []
    if args.model_path is not None:  # the folder's architecture; its weights once the strategy has split it
        import transformers

        config = transformers.AutoConfig.from_pretrained(args.model_path)
        config.use_cache = False
        model = transformers.AutoModelForCausalLM.from_config(config)
        callbacks.append(ml.callbacks.PretrainedWeights(args.model_path))
    else:
        model = tiny_model(args.family)
    symbols = symbol_ids(args.model_path, model.config.vocab_size)
    if args.lora:
        model = with_lora(model, args.lora, args.dora)  # (the folder's weights load into its base model all the same)
    module = LitCausalLM(model, symbols, args.lr, args.max_steps)
    # sequence parallelism needs a length tp divides
    data = AdditionDataModule(2, batch_size=args.batch_size, pad_to_multiple_of=8)
    experts = getattr(model.config, "num_local_experts", 0)
    trainer = ml.Trainer(strategy=strategy_for(args.strategy, args.devices, experts), devices=args.devices,
                         accelerator=args.accelerator, max_steps=args.max_steps, val_check_interval=args.val_every,
                         check_val_every_n_epoch=None, default_root_dir=args.out, enable_checkpointing=False,
                         log_every_n_steps=min(10, args.val_every), callbacks=callbacks)
    start = time.perf_counter()
    trainer.fit(module, data)
    log_dir = trainer.log_dir  # a collective: on every rank
    if trainer.is_global_zero:
        metrics = trainer.callback_metrics
        print(f"Trained {trainer.global_step} steps in {time.perf_counter() - start:.0f} s: train/loss"
              f" {float(metrics['train/loss']):.3f}, val/loss {float(metrics['val/loss']):.3f}, answer accuracy"
              f" {float(metrics['val/answer_accuracy']):.1%}")
        print(f"TensorBoard logs: {log_dir}")
    if args.export is not None or args.export_adapter is not None:  # a meshlight checkpoint of any layout, written
        from meshlight.parallel.pretrained import export_pretrained  # in Hugging Face's layout (or PEFT's)

        checkpoint = args.out / "final.ckpt"
        trainer.save_checkpoint(checkpoint)
        if trainer.is_global_zero and args.export is not None:
            export_pretrained(checkpoint, args.export)  # (with LoRA: merged)
            print(f"Exported to {args.export}: AutoModelForCausalLM.from_pretrained({str(args.export)!r})")
        if trainer.is_global_zero and args.export_adapter is not None:
            export_pretrained(checkpoint, args.export_adapter, to="peft")
            print(f"Exported the adapter to {args.export_adapter}: PeftModel.from_pretrained(base_model,"
                  f" {str(args.export_adapter)!r})")


if __name__ == "__main__":
    main()
