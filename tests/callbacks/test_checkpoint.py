"""DistributedCheckpoint: a run SIGKILLed after step 12 and resumed from "last" (the step-10 checkpoint, written
asynchronously, mid-epoch) reproduces every loss of an uninterrupted 20-step run bit for bit, under every
strategy; plus atomic commit, retention and the errors for partial or damaged checkpoints."""

from pathlib import Path

import pytest
import torch

from tests.callbacks.workers import resume_worker
from tests.launch import torchrun

WORKER = Path(resume_worker.__file__)
BY_WORLD = {world: [n for n, (w, _, _) in resume_worker.STRATEGIES.items() if w == world] for world in (2, 4)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("resume")
    results = {}
    for world, names in BY_WORLD.items():
        for name in names:
            killed = torchrun(WORKER, world, "kill", str(root / "ckpt"), name, timeout=600, check=False)
            assert killed.returncode != 0, f"{name}: the run was meant to be killed after step 12"
        torchrun(WORKER, world, "resume", str(root / "ckpt"), str(root / f"resumed-{world}.pt"), *names, timeout=1200)
        runs = torch.load(root / f"resumed-{world}.pt")
        results.update({name: (*runs[name], root / "ckpt" / name) for name in names})
    return results


@pytest.mark.parametrize("name", list(resume_worker.STRATEGIES))
def test_resume_after_sigkill_reproduces_every_loss_bitwise(runs, name):
    full, resumed, directory = runs[name]
    # From step 10, or from step 5 when step 10's background write had not finished before the kill: both
    # mid-epoch (8-step epochs), and an uncommitted checkpoint must never be picked.
    first = min(resumed)
    assert first in (6, 11) and sorted(resumed) == list(range(first, 21)), sorted(resumed)
    assert {step: full[step] for step in resumed} == resumed  # exact float equality
    # keep_last_k=2 after the resumed run: the newest two, all complete
    assert sorted(p.name for p in directory.iterdir()) == ["step=000000015", "step=000000020"]


# ---------------------------------------------------------------- one process: commit, retention, errors


def _fit(tmp_path, dirpath, *, max_steps=10, ckpt_path=None, callbacks=(), batch_size=4, **checkpoint_args):
    import meshlight as ml
    from meshlight.callbacks import DistributedCheckpoint

    checkpoint = DistributedCheckpoint(dirpath, **{"every_n_train_steps": 2, **checkpoint_args})
    trainer = ml.Trainer(strategy="ddp", devices=1, accelerator="cpu", max_steps=max_steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         default_root_dir=tmp_path, callbacks=[checkpoint, *callbacks])
    trainer.fit(resume_worker.model(0), _data(batch_size), ckpt_path=ckpt_path)
    return trainer, checkpoint


def _data(batch_size=4):
    from meshlight.demos import AdditionDataModule

    return AdditionDataModule(3, batch_size=batch_size, train_size=batch_size * 6)


def test_refuses_strategies_that_are_not_meshlights(tmp_path):
    import lightning.pytorch as pl

    from meshlight.callbacks import DistributedCheckpoint

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                         callbacks=[DistributedCheckpoint(tmp_path)])
    with pytest.raises(TypeError, match="DistributedCheckpoint writes through meshlight's strategies"):
        trainer.fit(resume_worker.model(0), _data())


def test_resuming_with_another_global_batch_warns(tmp_path):
    _fit(tmp_path, tmp_path / "ckpt", max_steps=2, async_save=False)
    with pytest.warns(UserWarning, match="Resuming with a global batch of 8 .* saved with 4"):
        _fit(tmp_path, tmp_path / "ckpt", max_steps=4, ckpt_path="last", batch_size=8)


def test_keeps_the_newest_k_and_resumes_from_the_newest_complete(tmp_path):
    from meshlight.parallel.checkpoint import INCOMPLETE_MARKER

    _, checkpoint = _fit(tmp_path, tmp_path / "ckpt", keep_last_k=2)
    assert checkpoint.complete_steps() == [8, 10]
    # a save interrupted at step 12 leaves a marked folder: never picked, deleted by the next clean-up
    partial = tmp_path / "ckpt" / "step=000000012"
    partial.mkdir()
    (partial / INCOMPLETE_MARKER).touch()
    trainer, checkpoint = _fit(tmp_path, tmp_path / "ckpt", keep_last_k=2, max_steps=14, ckpt_path="last")
    assert trainer.global_step == 14 and checkpoint.complete_steps() == [12, 14]
    assert not (partial / INCOMPLETE_MARKER).exists()  # step 12 was written again, whole this time


def test_partial_and_damaged_checkpoints_fail_naming_the_file(tmp_path):
    from meshlight.parallel.checkpoint import INCOMPLETE_MARKER, CheckpointError

    _fit(tmp_path, tmp_path / "ckpt", max_steps=2, async_save=False)
    folder = tmp_path / "ckpt" / "step=000000002"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    (folder / INCOMPLETE_MARKER).touch()
    with pytest.raises(CheckpointError, match=r"step=000000002' is incomplete: its save was interrupted"):
        _fit(tmp_path, tmp_path / "other", max_steps=4, ckpt_path=str(folder))
    (folder / INCOMPLETE_MARKER).unlink()
    (folder / "meta.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"meta.pt' cannot be read .*: the file is corrupted"):
        _fit(tmp_path, tmp_path / "other", max_steps=4, ckpt_path=str(folder))
    shard = next(p for p in folder.iterdir() if p.suffix == ".distcp")
    (folder / "meta.pt").write_bytes(before["meta.pt"])
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"step=000000002' cannot be read"):
        _fit(tmp_path, tmp_path / "other", max_steps=4, ckpt_path=str(folder))
    (folder / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata' is missing"):
        _fit(tmp_path, tmp_path / "other", max_steps=4, ckpt_path=str(folder))
    assert {p.name for p in folder.iterdir()} == set(before) - {".metadata"}  # nothing overwritten by a failure


def test_writes_to_an_fsspec_url_and_ranks_by_a_monitored_metric(tmp_path):
    import fsspec

    _, checkpoint = _fit(tmp_path, "memory://run", max_steps=6, async_save=False)
    assert checkpoint.complete_steps() == [6]  # save_top_k=1 without monitor: the newest
    assert fsspec.filesystem("memory").exists("/run/step=000000006/meta.pt")

    from lightning.pytorch.callbacks import Callback

    class Log(Callback):  # a metric that is best at step 4
        def on_train_batch_end(self, trainer, module, *args):
            module.log("score", float(abs(trainer.global_step - 4)))

        def on_train_batch_start(self, trainer, *args):
            trainer.callback_metrics.pop("score", None)

    import meshlight as ml
    from meshlight.callbacks import DistributedCheckpoint

    ranked = DistributedCheckpoint(tmp_path / "ranked", monitor="score", save_top_k=1, async_save=False)
    trainer = ml.Trainer(strategy="ddp", devices=1, accelerator="cpu", max_steps=8, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, val_check_interval=2,
                         limit_val_batches=1, callbacks=[Log(), ranked], default_root_dir=tmp_path)
    trainer.fit(resume_worker.model(0), _data())
    assert ranked.best_model_path.endswith("step=000000004")
    assert ranked.complete_steps() == [4, 8]  # the best and, with save_last, the newest


# ---------------------------------------------------------------- resharding


@pytest.fixture(scope="module")
def resharded(tmp_path_factory) -> dict:
    from tests.callbacks.workers import reshard_worker

    root = tmp_path_factory.mktemp("reshard")
    worker = Path(reshard_worker.__file__)
    torchrun(worker, 8, "save", str(root / "ckpt"), str(root / "3d.pt"), timeout=900)
    results = {"3d": torch.load(root / "3d.pt"), "directory": root / "ckpt"}
    for name, world in (("ddp", 4), ("zero3", 2), ("single", 1)):
        torchrun(worker, world, "resume", str(root / "ckpt"), str(root / f"{name}.pt"), name, timeout=600)
        results[name] = torch.load(root / f"{name}.pt")
    return results


@pytest.mark.parametrize("name", ["ddp", "zero3", "single"])
def test_a_3d_checkpoint_resumes_under_another_layout(resharded, name):
    saved, resumed = resharded["3d"], resharded[name]
    assert saved["weights"].keys() == resumed["weights"].keys()
    for key, tensor in saved["weights"].items():
        assert torch.equal(tensor, resumed["weights"][key]), key
    assert sorted(resumed["losses"]) == sorted(saved["losses"]) == list(range(6, 11))
    for step, loss in saved["losses"].items():
        assert resumed["losses"][step] == pytest.approx(loss, rel=1e-5), step


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_consolidate_writes_the_3d_checkpoint_as_one_full_state_dict(resharded, tmp_path, suffix):
    import subprocess
    import sys

    from tests.launch import REPO

    out = tmp_path / f"model{suffix}"
    ckpt = resharded["directory"] / "step=000000005"
    result = subprocess.run([sys.executable, "-m", "meshlight.cli", "consolidate", str(ckpt), str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"to {out}" in result.stdout
    if suffix == ".pt":
        state = torch.load(out)
    else:
        from safetensors.torch import load_file

        state = load_file(out)
    saved = resharded["3d"]["weights"]
    assert state.keys() == saved.keys()
    assert all(torch.equal(state[k], saved[k]) for k in saved)


# ---------------------------------------------------------------- faults under torchrun --max-restarts=1


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("faults")
    results = {}
    for kind in ("none", "rank", "save"):
        torchrun(WORKER, 2, "fault", str(root / kind), str(root / f"{kind}.pt"), kind, max_restarts=1, timeout=600)
        results[kind] = torch.load(root / f"{kind}.pt")
    return results


@pytest.mark.parametrize("kind", ["rank", "save"])
def test_the_job_restarts_from_the_last_complete_checkpoint_and_ends_with_the_same_weights(faults, kind):
    # "rank": one rank SIGKILLed after step 12; "save": every rank killed inside the save of step 10, which
    # must then be ignored (the restart resumes from step 5) and written again
    reference, restarted = faults["none"], faults[kind]
    assert reference["restarts"] == 0 and restarted["restarts"] == 1
    assert restarted["steps"] == reference["steps"] == [15, 20]
    assert reference["weights"].keys() == restarted["weights"].keys()
    for name, tensor in reference["weights"].items():
        assert torch.equal(tensor, restarted["weights"][name]), name


def test_saving_over_a_checkpoint_replaces_its_files(tmp_path, recwarn):
    import warnings

    from torch import nn

    from meshlight.parallel.checkpoint import load_checkpoint, save_checkpoint

    path = tmp_path / "last.ckpt"
    model = nn.Linear(3, 2)
    save_checkpoint(path, {"state_dict": model.state_dict(), "step": 1}, write_metadata=True, rng_state={})
    (path / "__7_0.distcp").write_bytes(b"a shard of an earlier, larger world")
    (path / "rng-7.pt").write_bytes(b"")
    with torch.no_grad():
        model.weight.add_(1.0)
    expected = model.weight.clone()
    warnings.simplefilter("always")
    save_checkpoint(path, {"state_dict": model.state_dict(), "step": 2}, write_metadata=True, rng_state={})
    assert not [w for w in recwarn if "existing checkpoint" in str(w.message)]  # DCP's overwrite warning
    assert not (path / "__7_0.distcp").exists() and not (path / "rng-7.pt").exists()
    fresh = nn.Linear(3, 2)
    assert load_checkpoint(path, fresh)["step"] == 2
    assert torch.equal(fresh.weight, expected)
