"""ActivationCheckpointing recomputes instead of storing: the same losses and weights bit for bit (dropout
included), far fewer bytes kept for backward, and unchanged parameter names."""

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig
from meshlight.parallel.blocks import BlockSelection
from meshlight.parallel.recompute import apply_recompute


def _model() -> LitGPT:
    config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=64, n_layers=4,
                            dropout=0.1)
    return LitGPT(config, lr=1e-2, warmup_steps=2)


def _train(callbacks) -> tuple[list[float], dict[str, torch.Tensor]]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    import meshlight as ml

    class Losses(Callback):
        def __init__(self):
            self.values = []

        def on_train_batch_end(self, trainer, *args):
            self.values.append(float(trainer.callback_metrics["train/loss"]))

    pl.seed_everything(0, verbose=False)
    losses, module = Losses(), _model()
    trainer = ml.Trainer(strategy="zero3", devices=1, accelerator="cpu", max_steps=8, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, callbacks=[losses, *callbacks])
    trainer.fit(module, AdditionDataModule(3, batch_size=8, train_size=64))
    from tests.strategies.parity import full_weights

    return losses.values, full_weights(module)


def test_recomputation_changes_no_bit_of_training():
    from meshlight.callbacks import ActivationCheckpointing

    plain_losses, plain_weights = _train([])
    losses, weights = _train([ActivationCheckpointing()])
    assert losses == plain_losses  # dropout 0.1: recomputation replays the same random masks
    assert weights.keys() == plain_weights.keys()  # names unchanged
    assert all(torch.equal(weights[k], plain_weights[k]) for k in weights)


def _saved_bytes(module: torch.nn.Module, inputs: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd holds for backward when the forward ends, parameters excluded:
    the activations."""
    storages = {}
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in weights:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = module(inputs).sum()
    loss.backward()  # the recomputation during backward is not counted: it happens one block at a time
    return sum(storages.values())


@pytest.mark.parametrize(("every", "at_most"), [(1, 0.5), (2, 0.6)])  # measured: 0.089, 0.544
def test_recomputing_blocks_keeps_far_fewer_activations(every, at_most):
    torch.manual_seed(0)
    model = GPTConfig.tiny(vocab_size=256, max_seq_len=64, dim=64, n_layers=4)
    from meshlight.models import GPT

    plain, recomputed = GPT(model), GPT(model)
    chosen = apply_recompute(recomputed, BlockSelection(every_n_blocks=every))
    assert len(chosen) == 4 // every
    inputs = torch.randint(0, 256, (4, 64))
    ratio = _saved_bytes(recomputed, inputs) / _saved_bytes(plain, inputs)
    assert ratio <= at_most, ratio


def test_recomputing_chosen_module_types_keeps_their_activations_only_and_changes_no_gradient():
    from meshlight.models import GPT
    from meshlight.models.gpt import MLP, Attention

    torch.manual_seed(0)
    config = GPTConfig.tiny(vocab_size=256, max_seq_len=64, dim=64, n_layers=4)
    plain, mlps, blocks = GPT(config), GPT(config), GPT(config)
    mlps.load_state_dict(plain.state_dict())
    blocks.load_state_dict(plain.state_dict())
    chosen = apply_recompute(mlps, BlockSelection(module_types=(MLP,)))
    apply_recompute(blocks, BlockSelection())
    assert chosen == [block.mlp for block in mlps.blocks]
    assert not any(getattr(m, "_meshlight_recompute", False) for m in mlps.modules() if isinstance(m, Attention))
    assert [name for name, _ in mlps.named_parameters()] == [name for name, _ in plain.named_parameters()]
    inputs = torch.randint(0, 256, (4, 64))
    kept = {name: _saved_bytes(model, inputs) for name, model in (("plain", plain), ("mlp", mlps),
                                                                   ("blocks", blocks))}
    assert kept["blocks"] < kept["mlp"] < kept["plain"]  # the MLPs' insides go; the attention's stay
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(mlps.parameters(), plain.parameters()))


def test_recomputing_module_types_under_a_strategy_changes_no_bit_of_training():
    from meshlight.callbacks import ActivationCheckpointing
    from meshlight.models.gpt import Attention

    plain_losses, plain_weights = _train([])
    losses, weights = _train([ActivationCheckpointing(module_types=[Attention])])
    assert losses == plain_losses
    assert all(torch.equal(weights[k], plain_weights[k]) for k in plain_weights)


@pytest.fixture(scope="module")
def distributed(tmp_path_factory) -> dict:
    from pathlib import Path

    from tests.callbacks.workers import recompute_worker
    from tests.launch import torchrun

    out = tmp_path_factory.mktemp("recompute") / "runs.pt"
    torchrun(Path(recompute_worker.__file__), 4, str(out), timeout=600)
    return torch.load(out)


@pytest.mark.parametrize("strategy", ["3d", "zero3"])
def test_recomputation_under_pipeline_tensor_and_sharded_data_parallelism(distributed, strategy):
    plain_losses, plain_weights, none = distributed[strategy, False]
    losses, weights, recomputed = distributed[strategy, True]
    assert none == 0 and recomputed == (2 if strategy == "3d" else 4)  # rank 0 holds 2 of the 4 blocks under pp=2
    assert losses == plain_losses
    assert weights.keys() == plain_weights.keys()
    assert all(torch.equal(weights[k], plain_weights[k]) for k in weights)


def test_the_callback_asks_meshlights_strategies_for_recomputation_by_a_policy_value():
    from meshlight.callbacks import ActivationCheckpointing
    from meshlight.parallel.recompute import RecomputePolicy
    from meshlight.parallel.transforms import Transforms

    callback = ActivationCheckpointing(every_n_blocks=2)
    assert Transforms.collect([object(), callback]) == Transforms(recompute=RecomputePolicy(every_n_blocks=2))
