"""Offload keeps state in host memory without changing a bit of training: optimizer offload (FSDP2's CPU policy on
every unit) under zero2 with clipping, ddp and a pipeline; offloaded activations leave their block in forward and
come back, one block ahead, in backward. (No accelerator here: the hooks treat host tensors as offloadable.)"""

import importlib

import pytest
import torch

import meshlight.parallel.offload as offload
from meshlight.callbacks import Offload, OffloadError
from meshlight.models import GPT, GPTConfig
from meshlight.parallel.blocks import BlockSelection
from tests.strategies.parity import assert_parity


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from tests.callbacks.workers import offload_worker
    from tests.launch import results_of

    return results_of(offload_worker, 2, tmp_path_factory.mktemp("offload"))


@pytest.mark.parametrize("run", ["zero2", "ddp", "pipeline"])
def test_offloading_changes_no_bit_of_training(runs, run):
    plain, offloaded = runs[run], runs[f"{run} offload"]
    units, offloading = offloaded["offloaded_units"]
    assert units > 0 and offloading == units  # every FSDP unit keeps its shards and optimizer state on the host
    micro_batches = 2 if run == "ddp" else 1  # ddp accumulates gradients over two
    assert offloaded["losses"] == plain["losses"] and len(plain["losses"]) == 20 * micro_batches
    assert offloaded["weights"].keys() == plain["weights"].keys()
    assert all(torch.equal(offloaded["weights"][k], w) for k, w in plain["weights"].items())
    if run != "zero2":  # with activation offload too
        assert offloaded["offloaded_bytes"] > 0 and offloaded["prefetches"] > 0


@pytest.mark.parametrize("run", ["zero2", "pipeline"])
def test_optimizer_state_on_disk_changes_no_bit_of_training_and_leaves_no_file(runs, run):
    plain, on_disk = runs[run], runs[f"{run} offload nvme"]
    assert on_disk["losses"] == plain["losses"]
    assert all(torch.equal(on_disk["weights"][k], w) for k, w in plain["weights"].items())
    # 20 steps: each writes every chunk once and (after the first) reads it once, in several files of 20 kB
    assert on_disk["disk_written"] > 0 and on_disk["disk_read"] == pytest.approx(on_disk["disk_written"] * 19 / 20)
    assert len(on_disk["files"]) > 2 and all(f.startswith("chunk-") for f in on_disk["files"])
    assert on_disk["left_behind"] == []  # removed when training ends


def test_ddp_under_offload_copies_each_unit_in_once_per_step_while_accumulating(runs):
    # DDP runs on FSDP2 (shard groups of one rank) under offload; it keeps its parameters on the device between
    # micro-batches, as ZeRO-1/2 do, instead of copying the master in for each of the 2: once per unit and step
    gathers = runs["ddp offload"]["gathers"]
    assert len(gathers) >= 3 and gathers == [20] * len(gathers)  # the root unit and the two blocks


def test_the_host_steps_an_optimizer_offloaded_from_an_accelerator_with_torchs_fused_kernel(runs):
    plain, offloaded = runs["zero2"], runs["zero2 offload from an accelerator"]
    assert runs["zero2 offload"]["fused"] == [None, None] and offloaded["fused"] == [True, True]
    assert_parity(offloaded, plain, rtol=1e-5)  # the same update, to rounding


def _host_params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]


def test_host_steps_are_fused_only_where_torchs_default_was_left_and_checkpoints_keep_the_flags_given():
    params = _host_params()
    optimizer = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "foreach": False}], lr=0.1)
    notes = offload.prepare_host_steps([optimizer, torch.optim.Adafactor(_host_params())], processes_per_node=1,
                                       cores=1)
    assert [g["fused"] for g in optimizer.param_groups] == [True, None]  # the loop asked for is kept
    assert notes == ["Optimizer offload: AdamW steps parameter groups [0] on the host with torch's fused kernel"
                     " (pass fused=False to keep its per-parameter loop)."]
    # what this run chose is not saved: resumed without offload (or in a layout that cannot fuse) it is not forced
    assert [g["fused"] for g in optimizer.state_dict()["param_groups"]] == [None, None]
    # a checkpoint written by the same configure_optimizers: its flags are restored, and the same group fused again
    saved = torch.optim.AdamW([{"params": _host_params()[:1]}, {"params": _host_params()[1:], "foreach": False}])
    optimizer.load_state_dict(saved.state_dict())
    assert [g["fused"] for g in optimizer.param_groups] == [True, None]
    assert offload.fuse_host_steps(torch.optim.AdamW(_host_params(), fused=False)) == []


def test_a_fused_host_step_is_torchs_fused_kernel_and_the_default_update_to_rounding(monkeypatch):
    adam, calls = importlib.import_module("torch.optim.adam"), []  # the module (torch.optim.adam is a function)
    fused_adam = adam._fused_adam
    monkeypatch.setattr(adam, "_fused_adam", lambda *a, **k: calls.append(1) or fused_adam(*a, **k))
    default, fused = _host_params(), _host_params()
    steps = [torch.optim.AdamW(default, lr=0.1, weight_decay=0.1), torch.optim.AdamW(fused, lr=0.1, weight_decay=0.1)]
    assert offload.fuse_host_steps(steps[1]) == [0]
    for step in range(5):
        for p, q in zip(default, fused):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            q.grad = p.grad.clone()
        steps[0].step(), steps[1].step()
    assert len(calls) == 5  # the fused optimizer's steps, and only those
    for p, q in zip(default, fused):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)


def test_one_host_thread_per_rank_is_named_with_the_count_the_node_allows(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    [note] = offload.prepare_host_steps([], processes_per_node=8, cores=96)
    assert note.endswith("this node's 96 cores for 8 rank(s) allow 12 per rank: set OMP_NUM_THREADS=12.")
    assert offload.prepare_host_steps([], processes_per_node=8, cores=8) == []  # one core each: nothing to gain
    monkeypatch.setattr(torch, "get_num_threads", lambda: 12)
    assert offload.prepare_host_steps([], processes_per_node=8, cores=96) == []


def _saved(model: GPT, inputs: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """Bytes of the activations autograd keeps at the end of forward (parameters excluded), and the gradients."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in weights:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(inputs).float().logsumexp(-1).mean()
    loss.backward()
    return sum(storages.values()), [p.grad for p in model.parameters()]


def test_offloaded_activations_leave_each_block_and_come_back_ahead(monkeypatch):
    monkeypatch.setattr(offload, "_offloadable", lambda tensor: True)
    config = GPTConfig.tiny(vocab_size=256, max_seq_len=64, dim=64, n_layers=4)
    torch.manual_seed(0)
    plain, offloaded = GPT(config), GPT(config)
    offloaded.load_state_dict(plain.state_dict())
    chosen = offload.apply_activation_offload(offloaded, BlockSelection(every_n_blocks=1))
    inputs = torch.randint(0, 256, (4, 64))
    kept_plain, grads_plain = _saved(plain, inputs)
    kept, grads = _saved(offloaded, inputs)  # what the blocks saved went to host buffers, outside this count
    offloader = offloaded._meshlight_offloader
    assert len(chosen) == 4 and all(torch.equal(a, b) for a, b in zip(grads, grads_plain))
    assert kept < 0.2 * kept_plain  # measured: 0.086 (the embedding's and head's activations stay)
    assert offloader.offloaded_bytes >= 0.7 * kept_plain
    assert offloader.prefetches == 3 * 18  # what blocks 0–2 saved came back while the block after them ran backward


def test_activation_offload_by_module_type_moves_only_those_modules_activations(monkeypatch):
    from meshlight.models.gpt import MLP

    monkeypatch.setattr(offload, "_offloadable", lambda tensor: True)
    config = GPTConfig.tiny(vocab_size=256, max_seq_len=64, dim=64, n_layers=4)
    torch.manual_seed(0)
    plain, mlps, blocks = GPT(config), GPT(config), GPT(config)
    mlps.load_state_dict(plain.state_dict())
    blocks.load_state_dict(plain.state_dict())
    chosen = offload.apply_activation_offload(mlps, BlockSelection(module_types=(MLP,)))
    offload.apply_activation_offload(blocks, BlockSelection(every_n_blocks=1))
    inputs = torch.randint(0, 256, (4, 64))
    _, grads_plain = _saved(plain, inputs)
    _, grads = _saved(mlps, inputs)
    _saved(blocks, inputs)
    assert chosen == [block.mlp for block in mlps.blocks]
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_plain))
    moved, moved_by_blocks = mlps._meshlight_offloader.offloaded_bytes, blocks._meshlight_offloader.offloaded_bytes
    assert 0 < moved < moved_by_blocks  # the MLPs' activations, not the attention's
    assert mlps._meshlight_offloader.prefetches > 0


def test_optimizer_offload_needs_a_meshlight_strategy():
    import lightning.pytorch as pl

    from meshlight.demos import AdditionDataModule, LitGPT

    trainer = pl.Trainer(strategy="auto", devices=1, accelerator="cpu", max_steps=1, logger=False,
                         callbacks=[Offload()], enable_progress_bar=False)
    config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=32, n_layers=2)
    with pytest.raises(OffloadError, match="optimizer=False, activations_every_n_blocks=1"):
        trainer.fit(LitGPT(config), AdditionDataModule(3, batch_size=4, train_size=8))


def test_offloading_nothing_is_refused():
    with pytest.raises(OffloadError, match="does nothing"):
        Offload(optimizer=False)


def test_the_callback_asks_meshlights_strategies_for_offload_by_a_policy_value():
    from meshlight.parallel.offload import OffloadPolicy
    from meshlight.parallel.transforms import Transforms

    callback = Offload(activations_every_n_blocks=2, pin_memory=False)
    expected = OffloadPolicy(optimizer=True, activations=BlockSelection(2), pin_memory=False)
    assert Transforms.collect([callback]) == Transforms(offload=expected)


# ---------------------------------------------------------------- optimizer state on disk: one process


def _fit_on_disk(tmp_path, name: str, *, on_disk: bool, max_steps: int = 6, ckpt_path=None) -> list[float]:
    import meshlight as ml
    from meshlight.callbacks import DistributedCheckpoint
    from meshlight.demos import AdditionDataModule
    from tests.callbacks.workers.resume_worker import Losses, model

    losses = Losses()
    callbacks = [losses, DistributedCheckpoint(tmp_path / name, every_n_train_steps=3, async_save=False,
                                                          keep_last_k=2)]
    if on_disk:
        (tmp_path / "nvme").mkdir(exist_ok=True)
        callbacks.append(Offload("nvme", path=tmp_path / "nvme", nvme_chunk_mb=0.005))
    trainer = ml.Trainer(strategy="ddp", devices=1, accelerator="cpu", max_steps=max_steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         default_root_dir=tmp_path, callbacks=callbacks)
    trainer.fit(model(0, dropout=0.0), AdditionDataModule(3, batch_size=4, train_size=4 * 8), ckpt_path=ckpt_path)
    return [losses.losses[step] for step in sorted(losses.losses)]


def test_a_run_with_its_optimizer_state_on_disk_resumes_exactly_and_its_checkpoints_are_plain(tmp_path):
    full = _fit_on_disk(tmp_path, "full", on_disk=True)
    step_3 = tmp_path / "full" / "step=000000003"
    assert _fit_on_disk(tmp_path, "resumed", on_disk=True, ckpt_path=step_3) == full[3:]
    # the checkpoint holds the whole optimizer state: a run without offload continues from it the same way
    assert _fit_on_disk(tmp_path, "plain", on_disk=False, ckpt_path=step_3) == full[3:]
    assert _fit_on_disk(tmp_path, "plain from the start", on_disk=False) == full


def test_the_disk_for_optimizer_state_is_checked_before_training(tmp_path, monkeypatch):
    import shutil
    from types import SimpleNamespace

    with pytest.raises(OffloadError, match="needs path=<a folder on a local disk>"):
        Offload("nvme")
    with pytest.raises(OffloadError, match="path applies to optimizer='nvme' only"):
        Offload(path=tmp_path)
    with pytest.raises(OffloadError, match=r"Offload\(optimizer='disk'\): give True \(or 'host': host memory\)"):
        Offload("disk")
    with pytest.raises(ValueError, match="the folder does not exist; create it on a local disk"):
        Offload("nvme", path=tmp_path / "missing")
    # a full disk: refused at setup, once the state's size is known, before the first step
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    with pytest.raises(ValueError, match=r"0.00 GiB free, and the optimizer state needs 0.00 GiB on this disk"):
        _fit_on_disk(tmp_path, "full disk", on_disk=True)
    assert not (tmp_path / "full disk").exists()  # no step ran, no checkpoint was written
