"""torchrun worker: tensor-parallel parity runs, per-rank bytes of the sharded layers, and dropout streams."""

import functools
import sys
from collections.abc import Callable
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate

import meshlight as ml
from meshlight.callbacks import ActivationCheckpointing
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPT, GPTConfig
from meshlight.parallel import CollectiveTraffic
from meshlight.parallel.tensor import apply_tensor_parallel, reduce_partial_gradients
from meshlight.parallel.tensor_plan import derive_plan, model_plan
from tests.strategies.llama import DICT_PLAN, LitLlama, LitLlamaParallelizedByUser
from tests.strategies.nanogpt import LitNanoGPT
from tests.strategies.parity import VARIANTS, make_data, train

# layout name -> (tp, data-parallel size), per world size
LAYOUTS = {2: {"tp2": (2, 1)}, 4: {"tp4": (4, 1), "tp2xdp2": (2, 2)}}


def lit_gpt(dropout: float = 0.0, tie_embeddings: bool = False, n_kv_heads: Optional[int] = None,
            **options: object) -> LitGPT:
    config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=32, n_heads=4,
                            n_kv_heads=n_kv_heads, bias=False, dropout=dropout, tie_embeddings=tie_embeddings)
    return LitGPT(config, **{"lr": 1e-2, "warmup_steps": 2, **options})


# model name -> (factory, plan)
MODELS = {"gpt": (lit_gpt, None), "gpt-tied": (functools.partial(lit_gpt, tie_embeddings=True), None),
          # one key/value head (multi-query): fewer than the ranks, each computes it
          "gpt-mqa": (functools.partial(lit_gpt, n_kv_heads=1), None),
          "llama-auto": (LitLlama, None), "llama-dict": (LitLlama, DICT_PLAN),
          "llama-configure-model": (LitLlamaParallelizedByUser, None),
          "llama-gated": (functools.partial(LitLlama, gated=True), None),
          "llama-qknorm": (functools.partial(LitLlama, qk_norm=True), None),
          "llama-outside": (functools.partial(LitLlama, outside=True), None), "nanogpt": (LitNanoGPT, None)}


def runs(world: int) -> list[tuple[str, str, bool, str]]:
    """(layout, model, sequence_parallel, variant) for this world size: on 2 every model with sequence parallelism,
    and without it the GPT and the automatically planned Llama (what sequence parallelism adds to a plan is what
    differs from model to model: the dict plan, the gate, the QK-norm, the modules outside the blocks); on 4 (a run
    there costs about twice one on 2) tp=4 where the split widths change — the plain GPT both ways, the Llama and
    its gate with sequence parallelism — and tp=2 × dp=2 once for each way of composing with data parallelism: the
    GPT, tied, nanoGPT and QK-norm Llama with sequence parallelism, the Llama without, and clipping and Adafactor
    over 2-D shards."""
    if world == 2:
        grid = [("tp2", model, sp, "adamw") for model in MODELS for sp in (True, False)
                if model not in ("llama-configure-model", "gpt-mqa") and (model in ("gpt", "llama-auto") or sp)]
        # sequence parallelism is the user's business here; their plan has none
        grid.append(("tp2", "llama-configure-model", False, "adamw"))
        # norms left plain beside DTensor weights, nothing sharding them over data ranks: multi-tensor AdamW
        grid.append(("tp2", "gpt", False, "adamw-foreach"))
        # DTensor parameters stepped one at a time, torch's default on CPU (parity runs otherwise step multi-tensor)
        grid.append(("tp2", "gpt", True, "adamw-single"))
        return grid
    grid = [("tp4", "gpt", True, "adamw"), ("tp4", "gpt", False, "adamw"), ("tp4", "llama-auto", True, "adamw"),
            ("tp4", "llama-gated", True, "adamw"), ("tp4", "gpt-mqa", True, "adamw")]
    grid += [("tp2xdp2", model, True, "adamw") for model in ("gpt", "gpt-tied", "nanogpt", "llama-qknorm")]
    grid.append(("tp2xdp2", "llama-auto", False, "adamw"))
    grid.append(("tp2xdp2", "gpt", True, "clip"))  # global norm over 2-D (dp × tp) and replicated shards
    grid.append(("tp2xdp2", "gpt", True, "adafactor"))  # norms and factored moments over 2-D shards
    return grid


#: block shapes whose saved activations are measured: Llama-like (SwiGLU, grouped-query) and GPT-2-like (GELU)
ACTIVATION_CONFIGS = {
    "swiglu-gqa": dict(n_heads=8, n_kv_heads=2, dim=256, hidden_dim=768, mlp="swiglu", norm="rmsnorm",
                       positions="rotary", bias=False),
    "gelu": dict(n_heads=8, dim=256, mlp="gelu", bias=False),
}


def saved_activation_values(name: str, tp: int, keep_gathered_inputs: bool = False) -> tuple[float, GPTConfig]:
    """Values autograd keeps for one block's backward (storages of saved tensors other than parameters, each
    counted once), per token, over the block's width — under tensor and sequence parallelism over all ranks
    when ``tp > 1``; and the model's config."""
    (values, _), config = saved_activations(name, tp, keep_gathered_inputs)
    return values / (2 * 64 * config.dim), config


def saved_activations(name: str, tp: int = 1, keep_gathered_inputs: bool = False, *, sequences: int = 2,
                      autocast: bool = False) -> tuple[tuple[int, int], GPTConfig]:
    """(values, bytes) of the tensors autograd keeps for one block's backward, other than parameters, each
    storage counted once, for ``sequences`` of 64 tokens (under bf16 ``autocast``: the weights' casts too, once
    per forward); and the model's config."""
    config = GPTConfig(vocab_size=512, max_seq_len=64, n_layers=2, **ACTIVATION_CONFIGS[name])
    torch.manual_seed(0)
    model = GPT(config)
    if tp > 1:
        apply_tensor_parallel(model, init_device_mesh("cpu", (tp,)), model_plan(model),
                              keep_gathered_inputs=keep_gathered_inputs)

    seen, saved = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}, []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if _local(t).untyped_storage().data_ptr() not in seen:
            seen.add(_local(t).untyped_storage().data_ptr())
            saved.append((_local(t).numel(), _local(t).numel() * _local(t).element_size()))
        return t

    block, tokens = model.blocks[1], torch.randint(0, config.vocab_size, (sequences, 64))
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    block.register_forward_pre_hook(lambda *_: hooks.__enter__())
    block.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(tokens)
    return (sum(v for v, _ in saved), sum(b for _, b in saved)), config


def sharded_fraction(module: pl.LightningModule) -> float:
    """This rank's bytes of the weights tensor parallelism shards, over their total bytes."""
    modules = dict(module.named_modules())
    roles = ("colwise", "rowwise", "embedding", "head")
    sharded = [modules[n] for n, role in derive_plan(module).items() if role in roles]
    weights = [p for m in sharded for p in m.parameters(recurse=False)]
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in weights)
    return local / sum(p.numel() for p in weights)


class GradientProbe(pl.Callback):
    """Whether any gradient is still a partial sum when the optimizer step begins, and the collectives the
    step itself (clipping and optimizer) issues."""

    def __init__(self) -> None:
        self.partial, self.traffic, self.step_collectives = [], CollectiveTraffic(), []

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: object) -> None:
        self.partial.append(sorted(name for name, p in module.named_parameters() if isinstance(p.grad, DTensor)
                                   and any(placement.is_partial() for placement in p.grad.placements)))
        self.traffic.reset()
        self.traffic.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.traffic.__exit__(None, None, None)
        self.step_collectives.append(sum(kind["calls"] for kind in self.traffic.summary().values()))


def partial_gradient_reduction() -> dict[str, object]:
    """reduce_partial_gradients against DTensor's own redistribution, for sum and average partials of two
    shapes and dtypes (one all-reduce per dtype and kind of partial)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    generator = torch.Generator().manual_seed(dist.get_rank())
    cases = [(Partial("sum"), (3, 5), torch.float32), (Partial("sum"), (7,), torch.float32),
             (Partial("avg"), (4,), torch.float32), (Partial("sum"), (2, 2), torch.float64)]
    params, expected = [], []
    for placement, shape, dtype in cases:
        param = torch.nn.Parameter(DTensor.from_local(torch.zeros(shape, dtype=dtype), mesh, [Replicate()]))
        param.grad = DTensor.from_local(torch.randn(shape, generator=generator, dtype=dtype), mesh, [placement])
        expected.append(param.grad.redistribute(mesh, [Replicate()]).to_local())
        params.append(param)
    traffic = CollectiveTraffic()
    with traffic:
        reduce_partial_gradients(params)
    return {
        "equal": all(torch.equal(p.grad.to_local(), e) for p, e in zip(params, expected)),
        "replicated": all(p.grad.placements == (Replicate(),) and p.grad.shape == p.shape for p in params),
        "all_reduce_calls": traffic.summary()["all_reduce"]["calls"],
    }


class ElementwiseRMSNorm(torch.nn.Module):
    """An RMSNorm written op by op, as Hugging Face's are (their statistics in float32; here in the input's dtype)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = torch.nn.Parameter(torch.rand(width) + 0.5), 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def vocab_embedding() -> dict[str, object]:
    """An embedding of 9 rows with a padding row (6, the second of the second rank's 4: 5 + 4 rows at tp=2) under
    VocabEmbedding, without sequence parallelism, against the whole embedding on the same ids (every row, the
    padding row twice): the output, each rank's weight gradient against its rows of the whole one's, and the padding
    row's gradient on the rank holding it (zero; on the other rank, True)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from meshlight.parallel.tensor_styles import VocabEmbedding

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    whole = torch.nn.Embedding(9, 3, padding_idx=6)
    split = torch.nn.Embedding(9, 3, padding_idx=6)
    split.load_state_dict(whole.state_dict())
    parallelize_module(split, mesh, VocabEmbedding(sequence_parallel=False))
    ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 6, 4, 5]])
    weights = torch.arange(12 * 3, dtype=torch.float32).reshape(1, 12, 3)  # a gradient that differs by place
    expected, output = whole(ids), split(ids)
    (expected * weights).sum().backward()
    (output * weights).sum().backward()
    rows = slice(5 * dist.get_rank(), 5 * dist.get_rank() + split.weight.to_local().shape[0])
    return {"output": torch.equal(output, expected), "placements": split.weight.grad.placements,
            "gradient": torch.equal(split.weight.grad.to_local(), whole.weight.grad[rows]),
            "padding_row_zero": dist.get_rank() != 1 or not split.weight.grad.to_local()[6 - 5].any()}


def colwise_norms() -> dict[str, object]:
    """Norms over a colwise output split over the world (``colwise_norm``) against the whole norm, in float64: the
    largest difference of output, input gradient and this rank's vectors' gradients (torch's LayerNorm with a bias,
    its RMSNorm with the default epsilon, an RMSNorm written op by op); and the error for an input of the whole
    width."""
    from meshlight.parallel.tensor_plan import TensorParallelError

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    differences = {}
    for name, make in (("layer_norm", lambda: torch.nn.LayerNorm(16)), ("rms_norm", lambda: torch.nn.RMSNorm(16)),
                       ("elementwise", lambda: ElementwiseRMSNorm(16))):
        torch.manual_seed(0)
        whole = make().double()
        for param in whole.parameters():  # not the initial ones and zeros
            param.data.uniform_(0.5, 1.5)
        split = make().double()
        split.load_state_dict(whole.state_dict())
        holder = torch.nn.Module()
        holder.norm = split
        apply_tensor_parallel(holder, mesh, {"norm": "colwise_norm"})
        x = torch.randn(2, 3, 16, dtype=torch.float64, requires_grad=True)
        grad = torch.randn(2, 3, 16, dtype=torch.float64)
        (whole(x) * grad).sum().backward()
        mine = slice(rank * 16 // world, (rank + 1) * 16 // world)
        share = x.detach()[..., mine].clone().requires_grad_()
        out = split(share)
        (out * grad[..., mine]).sum().backward()
        pairs = [(out, whole(x)[..., mine]), (share.grad, x.grad[..., mine])]
        pairs += [(_local(p.grad), w.grad[mine]) for p, w in zip(split.parameters(), whole.parameters())]
        differences[name] = (type(out) is torch.Tensor, max((a - b).abs().max().item() for a, b in pairs))
    try:
        split(torch.randn(2, 3, 16, dtype=torch.float64))  # the whole width: a norm of something else
        refusal = ""
    except TensorParallelError as error:
        refusal = str(error)
    return {"differences": differences, "refusal": refusal}


class LearnedScale(torch.nn.Module):
    """An activation with a learned scalar, as Apertus's xIELU holds two."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * torch.nn.functional.silu(x)


def interior_gradients() -> dict[str, object]:
    """A learned activation between a colwise ``up`` (16 → 24) and a rowwise ``down`` (``interior``) in float64: its
    scalar's gradient, summed over the ranks, against the whole MLP's; and the error when it is given the MLP's input
    (16 wide, not this rank's share of 24), and when a plan gives no output projection beside it."""
    from meshlight.parallel.tensor import reduce_partial_gradients
    from meshlight.parallel.tensor_plan import TensorParallelError

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    whole = torch.nn.Sequential(torch.nn.Linear(16, 24), LearnedScale(), torch.nn.Linear(24, 16)).double()
    split = torch.nn.Sequential(torch.nn.Linear(16, 24), LearnedScale(), torch.nn.Linear(24, 16)).double()
    split.load_state_dict(whole.state_dict())
    apply_tensor_parallel(split, mesh, {"0": "colwise", "1": "interior", "2": "rowwise"}, sequence_parallel=False)
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    whole(x).square().sum().backward()
    split(x).square().sum().backward()
    reduce_partial_gradients(split.parameters())
    difference = (_local(split[1].scale.grad) - whole[1].scale.grad).abs().item()
    try:
        split[1](x)  # the MLP's input: a module the MLP runs before its projections
        refusal = ""
    except TensorParallelError as error:
        refusal = str(error)
    try:  # a plan naming no output projection beside it
        apply_tensor_parallel(torch.nn.Sequential(torch.nn.Linear(16, 24), LearnedScale()), mesh,
                              {"0": "colwise", "1": "interior"}, sequence_parallel=False)
        no_writer = ""
    except TensorParallelError as error:
        no_writer = str(error)
    return {"difference": difference, "refusal": refusal, "no_writer": no_writer}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()


def _gathered(value: object) -> list:
    """``value`` from every rank, in rank order."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _fit_briefly(module: pl.LightningModule, strategy: ml.MeshStrategy, max_steps: int,
                 *callbacks: pl.Callback) -> ml.Trainer:
    """Train ``module`` for ``max_steps`` on every rank of the world (4 sequences per rank and step)."""
    trainer = ml.Trainer(strategy=strategy, devices=dist.get_world_size(), accelerator="cpu", max_steps=max_steps,
                         logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=list(callbacks))
    trainer.fit(module, make_data(4))
    return trainer


def dropout_probe(world: int) -> list[torch.Tensor]:
    """The output of the final norm (a replicated region without sequence parallelism) for one fixed input,
    in training mode with dropout, on every rank."""
    pl.seed_everything(0, verbose=False)
    module = lit_gpt(dropout=0.1)
    trainer = _fit_briefly(module, ml.TensorParallelStrategy(tp=2, sequence_parallel=False, zero=0), 1)
    captured = []
    module.model.norm.register_forward_hook(lambda mod, args, out: captured.append(out.detach().clone()))
    trainer.strategy.model.train()
    trainer.strategy.model(torch.arange(12).repeat(2, 1) % 16)
    return _gathered(captured[0])


def blocks_only_dropout_probe() -> dict[str, bool]:
    """Dropout where sequence parallelism covers the blocks only (``LitLlama(outside=True)``), with dropout after
    modules outside the blocks and after each block's feed-forward, 3 steps at tp=2:

    - ``outside_weights_agree``: the replicated modules outside the blocks hold the same weights on both tp ranks
      (their masks agree: otherwise the ranks' gradients, and weights, drift apart);
    - ``block_draws_differ``, ``outside_draws_agree``: a random draw inside a block differs between the tp ranks
      (their shares' masks do not repeat), one outside agrees;
    - ``recompute_replays``: the same run with every block recomputed ends with the same weights (recomputation
      replays each block's masks)."""

    def dropout_after(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(output, 0.3, module.training)

    def fit(*callbacks: pl.Callback) -> LitLlama:
        pl.seed_everything(0, verbose=False)
        module = LitLlama(outside=True)
        for dropped in (module.model.project, module.model.transform[0],
                        *(layer.feed_forward for layer in module.model.layers)):
            dropped.register_forward_hook(dropout_after)
        _fit_briefly(module, ml.TensorParallelStrategy(tp=2), 3, *callbacks)
        return module

    module = fit()
    outside = torch.cat([module.model.project.weight.detach().flatten(),
                         module.model.transform[0].weight.detach().flatten()])
    draws = {}

    def draw(name: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            draws.setdefault(name, torch.rand(8))

        return hook

    for name, where in (("block", module.model.layers[0].feed_forward), ("outside", module.model.project)):
        where.register_forward_hook(draw(name))
    module.model.train()
    module.model(torch.arange(12).repeat(2, 1) % 16)
    recomputed = fit(ActivationCheckpointing())
    weights = [dict(m.model.named_parameters()) for m in (module, recomputed)]
    blocks, outsides = _gathered(draws["block"]), _gathered(draws["outside"])
    return {
        "outside_weights_agree": torch.equal(*_gathered(outside)),
        "block_draws_differ": not torch.equal(*blocks),
        "outside_draws_agree": torch.equal(*outsides),
        "recompute_replays": all(torch.equal(_local(p), _local(weights[1][n])) for n, p in weights[0].items()),
    }


class LitLlamaWithAuxiliaryLoss(LitLlama):
    """Adds a plain tensor's penalty to the cross-entropy, which loss parallelism leaves a DTensor."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        logits = self.model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return loss + 0.01 * self.scale.pow(2).sum()


def mixed_tensor_notes() -> list[str]:
    """The notes meshlight adds to PyTorch's error when an auxiliary loss meets the DTensor loss."""
    try:
        _fit_briefly(LitLlamaWithAuxiliaryLoss(), ml.TensorParallelStrategy(tp=2), 1)
    except RuntimeError as error:
        return [str(error).split(",")[0], *getattr(error, "__notes__", [])]
    return []


class LitLlamaCountingSequences(LitLlama):
    """Logs the sequences of each step, summed over the ranks (``reduce_fx="sum"``)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("sequences", float(len(batch[0])), reduce_fx="sum", sync_dist=True)
        return super().training_step(batch, batch_idx)


def synced_sums() -> dict[str, object]:
    """A count logged with ``reduce_fx="sum"`` at tp2 × dp2 (4 sequences per replica), and the strategy's
    boolean decisions (rank 0 says yes) over the world."""
    strategy = ml.TensorParallelStrategy(tp=2)
    trainer = _fit_briefly(LitLlamaCountingSequences(), strategy, 1)
    yes = dist.get_rank() == 0
    return {"sequences": trainer.callback_metrics["sequences"].item(),
            "any": strategy.reduce_boolean_decision(yes, all=False), "all": strategy.reduce_boolean_decision(yes)}


if __name__ == "__main__":
    out, world = sys.argv[1], int(sys.argv[2])
    results = {}
    for layout, model, sp, variant in runs(world):
        tp, dp = LAYOUTS[world][layout]
        factory, plan = MODELS[model]
        if VARIANTS[variant][0]:  # the variant's LightningModule arguments (the factory makes the model)
            factory = functools.partial(factory, **VARIANTS[variant][0])
        strategy = ml.TensorParallelStrategy(tp=tp, plan=plan, sequence_parallel=sp)
        probe = GradientProbe()
        result = train(variant, strategy, devices=world, data_parallel=dp, model=factory, callbacks=[probe])
        result["partial_gradients"], result["step_collectives"] = probe.partial, probe.step_collectives
        module = result.pop("module")
        if dp == 1 and model != "llama-configure-model":  # the layers meshlight's plan shards
            result["sharded_fraction"] = _gathered(sharded_fraction(module))
        results[(layout, model, sp, variant)] = result
    if world == 2:
        results["partial_gradient_reduction"] = partial_gradient_reduction()
        results["colwise_norms"] = colwise_norms()
        results["vocab_embedding"] = _gathered(vocab_embedding())
        results["interior"] = interior_gradients()
        results["blocks_only_dropout"] = blocks_only_dropout_probe()
        results["mixed_tensor_notes"] = mixed_tensor_notes()
        results["saved_activations"] = {(name, keep): saved_activation_values(name, world, keep)[0]
                                        for name in ACTIVATION_CONFIGS for keep in (False, True)}
    if world == 4:
        results["dropout"] = dropout_probe(world)
        results["synced_sums"] = _gathered(synced_sums())
    if dist.get_rank() == 0:
        torch.save(results, out)
