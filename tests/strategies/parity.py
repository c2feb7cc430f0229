"""The parity experiment, shared by the distributed worker and the single-process control in the test.

Control: one process trains GPT-tiny on a global batch of ``GLOBAL_BATCH`` sequences per step for
``STEPS`` optimizer steps (fp32, dropout 0). Each strategy trains the same model on the same data with
``GLOBAL_BATCH / world`` sequences per rank. Lightning's DistributedSampler shuffles training data with a
seeded permutation that does not depend on the number of replicas; the control reads the same permutation
through a one-replica DistributedSampler, so every step sees the same set of samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

import meshlight as ml
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig

GLOBAL_BATCH = 16
STEPS = 20
SEED = 0

# name -> (LitGPT arguments, Trainer arguments)
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "adamw": ({}, {}),
    "accumulate": ({}, {"accumulate_grad_batches": 2}),
    "clip": ({}, {"gradient_clip_val": 1.0}),
    "sgd": ({"optimizer": "sgd", "lr": 0.3}, {}),
    "adafactor": ({"optimizer": "adafactor", "lr": 3e-2}, {}),
    "adamw-3e-3": ({"lr": 3e-3}, {}),  # no loss spike: low-precision runs follow the fp32 curve closely
    "adamw-foreach": ({"foreach": True}, {}),  # asked for: a group mixing DTensors and tensors steps as two
    "adamw-single": ({"foreach": False}, {}),  # one parameter at a time, torch's default on CPU
}


class MultiTensorSteps(Callback):
    """Every parity run steps Adam, AdamW and SGD with torch's multi-tensor (``foreach``) kernels, its default on
    CUDA, where the model left the choice to torch: what users' GPU runs do. (Alone, tensor_worker on 2 processes ran
    9% faster so; in the whole suite the difference is within its run-to-run spread.) Groups mixing DTensors and
    plain tensors too: meshlight steps them as two (``adapt_optimizer``); ``"adamw-single"`` asks for one
    parameter at a time everywhere."""

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        for optimizer in trainer.optimizers:
            if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)):
                continue
            for group in optimizer.param_groups:
                if group.get("foreach") is None and not group.get("fused"):
                    group["foreach"] = True


class Recorder(Callback):
    """Logged (globally reduced) training loss of every batch, the gradient norm before each step, and the
    parameters whose gradient is a DTensor placed otherwise than the parameter or holding other local values (DTensor's
    own embedding backward gave each rank the whole vocabulary's gradient, replicated, beside a sharded weight)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.unlike: list[list[str]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        self.unlike.append(sorted(name for name, p in module.named_parameters() if isinstance(p.grad, DTensor) and (
            p.grad.placements != p.placements or p.grad.to_local().shape != p.to_local().shape)))
        # Only meaningful in the single-process control, where gradients are plain full tensors.
        grads = [p.grad for p in module.parameters() if p.grad is not None and not hasattr(p.grad, "placements")]
        if grads:
            self.grad_norms.append(float(torch.nn.utils.get_total_norm(grads)))


def make_model(variant: str) -> LitGPT:
    # No biases: a key bias has an exactly-zero gradient (softmax ignores a per-query constant), which Adam
    # would turn from float noise into full-size, irreproducible steps.
    config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=32, n_layers=2, bias=False)
    return LitGPT(config, **{"lr": 1e-2, "warmup_steps": 2, **VARIANTS[variant][0]})


def make_data(batch_size: int, pad_to_multiple_of: int = 1) -> AdditionDataModule:
    return AdditionDataModule(3, batch_size=batch_size, train_size=GLOBAL_BATCH * STEPS * 2, val_size=32, seed=SEED,
                              pad_to_multiple_of=pad_to_multiple_of)


def train(variant: str, strategy: Any = "auto", devices: int = 1, data_parallel: int = 0,
          model: Any = None, save_to: Any = None, callbacks: Sequence[Callback] = (), ckpt_path: Any = None,
          pad_to_multiple_of: int = 1, **trainer_args: Any) -> dict[str, Any]:
    """Train one variant; return the logged losses, gradient norms, (on global rank 0) the full weights, and
    the trained ``module`` itself (not picklable across processes: pop it before saving).

    ``data_parallel``: ranks reading different data (default: all); ``model``: a factory replacing GPT-tiny;
    ``save_to``: a checkpoint path written after training; ``ckpt_path``: one to resume from; ``callbacks`` and
    ``trainer_args``: added to the Trainer's (replacing ``max_steps=STEPS``, ``enable_checkpointing=False``);
    ``pad_to_multiple_of``: the sequences' length is padded to a multiple of it (12 tokens unpadded).
    """
    pl.seed_everything(SEED, verbose=False)
    world = devices
    model = model() if model is not None else make_model(variant)
    data = make_data(GLOBAL_BATCH // (data_parallel or world), pad_to_multiple_of)
    recorder = Recorder()
    trainer = ml.Trainer(
        strategy=strategy, devices=devices, accelerator="cpu", logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[recorder, MultiTensorSteps(), *callbacks],
        **{"max_steps": STEPS, "enable_checkpointing": False, **VARIANTS[variant][1], **trainer_args},
    )
    if strategy == "auto":  # the single-process control reads the distributed permutation
        data.setup()
        sampler = DistributedSampler(data.train_set, num_replicas=1, rank=0, shuffle=True, seed=SEED)
        loader = DataLoader(data.train_set, batch_size=GLOBAL_BATCH, sampler=sampler, drop_last=True)
        trainer.fit(model, train_dataloaders=loader)
    else:
        trainer.fit(model, data, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    weights = full_weights(model) if world > 1 else {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "weights": weights, "module": model,
            "gradients_unlike_parameters": recorder.unlike}


def full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded weights of the whole model on global rank 0 (empty elsewhere), merged from every pipeline
    stage; a collective."""
    local = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    local = {name: tensor.detach().cpu() for name, tensor in local.items()}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, local)
    if torch.distributed.get_rank() != 0:
        return {}
    return {name: tensor for part in gathered for name, tensor in part.items()}


#: Weights whose gradient is exactly zero in exact arithmetic: a key projection's bias adds ``q·b`` to every score of
#: a query alike, which softmax ignores. What they hold after training is rounding noise that Adam scales up (about
#: 1e-5 after 20 steps in fp32, 1e-14 in fp64), differently in every layout, and the model's function never reads it.
#: Hugging Face's Qwen2 (``k_proj.bias``) is trained with SGD for this reason, which keeps the noise from growing
#: to the size of a step, but relative to a weight that holds nothing else it is still any size.
GAUGE_WEIGHTS = ("attn.wk.bias", "self_attn.k_proj.bias")
#: The MoE parity models train without the expert bias (on by default) unless a run is about it. Routing is discrete:
#: a token whose two best scores tie to within rounding may pick the other expert under another summation order, and
#: the bias (moved after each step by rate·(mean − load)/mean) turns that one assignment into a step that changes every
#: later near-tie — at the start of training most choices: 20 steps of some layouts drifted past 1e-4. The runs named
#: "bias" check it.
WITHOUT_EXPERT_BIAS = {"expert_bias_rate": 0.0}


def assert_parity(result: dict[str, Any], control: dict[str, Any], rtol: float = 1e-4) -> None:
    """Every logged loss within ``rtol`` relative, every final weight tensor within ``rtol`` (relative norm); the
    :data:`GAUGE_WEIGHTS` within ``rtol`` absolute instead (near zero: they only gather rounding noise). At every
    optimizer step each gradient was placed as its parameter (:class:`Recorder`), where the run recorded it."""
    assert not any(result.get("gradients_unlike_parameters", ())), result["gradients_unlike_parameters"]
    losses, expected = torch.tensor(result["losses"]), torch.tensor(control["losses"])
    assert losses.shape == expected.shape, (losses.shape, expected.shape)
    torch.testing.assert_close(losses, expected, rtol=rtol, atol=0.0)
    assert result["weights"].keys() == control["weights"].keys()
    for name, weight in control["weights"].items():
        if not weight.is_floating_point():  # a table the model keeps (DeepSeek-V4's token → expert hash)
            assert torch.equal(result["weights"][name], weight), name
            continue
        if name.endswith(GAUGE_WEIGHTS):
            assert (result["weights"][name] - weight).abs().max() <= rtol, name
            continue
        error = (result["weights"][name] - weight).norm() / weight.norm().clamp_min(1e-12)
        assert error <= rtol, f"{name}: relative error {error:.2e} > {rtol:.0e}"
