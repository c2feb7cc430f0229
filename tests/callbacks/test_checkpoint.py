"""DistributedCheckpoint: a run SIGKILLed after step 12 and resumed from "last" (the step-10 checkpoint, written
asynchronously, mid-epoch) reproduces every loss of an uninterrupted 20-step run bit for bit, under every
strategy (3-D as dp=2 × pp=2 × tp=2, whose checkpoint also resumes under ddp, zero3 and in one process); plus
asynchronous writes, atomic commit, retention, restarts after faults under torchrun, the errors for partial or
damaged checkpoints, a crash inside a synchronous save (under torchrun's restarts) and inside an asynchronous
one (the previous checkpoint resumes bit for bit), and SIGTERM: every rank stops after the same step, which is
saved and resumes bit for bit; SLURM's requeue signal: every rank writes the checkpoint after the same step, and
the requeued job resumes it bit for bit (in one process: tests/strategies/test_preemption.py)."""

import re
import time
from pathlib import Path

import pytest
import torch

from meshlight.parallel.checkpoint import is_complete
from tests.callbacks.workers import resume_worker
from tests.launch import torchrun

WORKER = Path(resume_worker.__file__)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("resume")
    names, world = list(resume_worker.STRATEGIES), resume_worker.WORLD
    for name in names:
        killed = torchrun(WORKER, world, "kill", str(root / "ckpt"), name, timeout=600, check=False)
        assert killed.returncode != 0 and resume_worker.KILLED in killed.stdout, (
            f"{name}: the run was meant to be killed after step {resume_worker.KILL_AFTER}, and ended otherwise:\n"
            f"{killed.stdout[-3000:]}\n{killed.stderr[-8000:]}")
        left = {folder.name: is_complete(folder) for folder in sorted((root / "ckpt" / name).iterdir())}
        assert left.get("step=000000005"), f"{name}: the kill left no complete step-5 checkpoint: {left}"
    torchrun(WORKER, world, "resume", str(root / "ckpt"), str(root / "resumed.pt"), *names, timeout=1200)
    runs = torch.load(root / "resumed.pt")
    return {name: (*runs[name], root / "ckpt" / name) for name in names}


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


def _fit(tmp_path, dirpath, *, max_steps=10, ckpt_path=None, callbacks=(), batch_size=4, data=None, weights_only=None,
         **checkpoint_args):
    import meshlight as ml
    from meshlight.callbacks import DistributedCheckpoint

    checkpoint = DistributedCheckpoint(dirpath, **{"every_n_train_steps": 2, **checkpoint_args})
    trainer = ml.Trainer(strategy="ddp", devices=1, accelerator="cpu", max_steps=max_steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         default_root_dir=tmp_path, callbacks=[*callbacks, checkpoint])
    trainer.fit(resume_worker.model(0), data or _data(batch_size), ckpt_path=ckpt_path, weights_only=weights_only)
    return trainer, checkpoint


def _data(batch_size=4):
    from meshlight.demos import AdditionDataModule

    return AdditionDataModule(3, batch_size=batch_size, train_size=batch_size * 6)


def test_training_goes_on_while_a_checkpoint_is_written_and_one_write_is_in_flight_at_most(tmp_path, monkeypatch):
    import threading
    import time

    from lightning.pytorch.callbacks import Callback
    from torch.distributed.checkpoint import FileSystemWriter

    writes, lock = {"now": 0, "most": 0}, threading.Lock()
    write_data = FileSystemWriter.write_data

    def slow_write_data(self, plan, planner):  # a slow file system: each save's shards take 1.5 s more
        with lock:
            writes["now"] += 1
            writes["most"] = max(writes["most"], writes["now"])
        time.sleep(1.5)
        try:
            return write_data(self, plan, planner)
        finally:
            with lock:
                writes["now"] -= 1

    monkeypatch.setattr(FileSystemWriter, "write_data", slow_write_data)

    class Visible(Callback):  # the complete checkpoints after each step, before that step's own save
        def __init__(self):
            self.after = {}

        def on_train_batch_end(self, trainer, *args):
            self.after[trainer.global_step] = trainer.checkpoint_callback.complete_steps()

    visible = Visible()
    _, checkpoint = _fit(tmp_path, tmp_path / "ckpt", max_steps=6, keep_last_k=3, callbacks=[visible])
    assert visible.after[3] == []  # step 3 trained while step 2's checkpoint was still being written
    assert visible.after[5] == [2]  # the save of step 4 waited for step 2's to commit; step 4's is in flight
    assert checkpoint.complete_steps() == [2, 4, 6] and writes["most"] == 1


class _Counting(torch.utils.data.Dataset):
    """A dataset that records the index of every sample it loads."""

    def __init__(self, base):
        self.base, self.loaded = base, []

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        self.loaded.append(index)
        return self.base[index]


def _counting_data(batch_size=4):
    from meshlight.demos import AdditionDataModule

    class CountingData(AdditionDataModule):
        def setup(self, stage=None):
            super().setup(stage)
            if not isinstance(self.train_set, _Counting):
                self.train_set = _Counting(self.train_set)

    return CountingData(3, batch_size=batch_size, train_size=batch_size * 8)  # 8-step epochs


def test_resuming_mid_epoch_loads_only_the_samples_still_to_come(tmp_path):
    full, first, resumed = _counting_data(), _counting_data(), _counting_data()
    _fit(tmp_path, tmp_path / "full", max_steps=6, data=full, async_save=False)
    _fit(tmp_path, tmp_path / "ckpt", max_steps=4, data=first, async_save=False)
    _fit(tmp_path, tmp_path / "ckpt", max_steps=6, data=resumed, async_save=False, ckpt_path="last")
    assert len(full.train_set.loaded) == 6 * 4
    # steps 5 and 6 read exactly the uninterrupted run's samples; the 16 of steps 1-4 were skipped unread
    assert resumed.train_set.loaded == full.train_set.loaded[4 * 4:]


def test_one_process_with_dropout_resumes_every_loss_bitwise_mid_epoch(tmp_path):
    # ddp on one process (the 2-process runs above are killed; here the second fit stands for the restart)
    from tests.callbacks.workers.reshard_worker import StopAfter

    full, first, resumed = resume_worker.Losses(), resume_worker.Losses(), resume_worker.Losses()
    _fit(tmp_path, tmp_path / "full", max_steps=9, callbacks=[full], async_save=False)
    # stopped after step 4 (of 6-step epochs: mid-epoch) with max_steps, and so the LR schedule, as the full run's
    _fit(tmp_path, tmp_path / "ckpt", max_steps=9, callbacks=[first, StopAfter(4)], async_save=False)
    _fit(tmp_path, tmp_path / "ckpt", max_steps=9, callbacks=[resumed], async_save=False, ckpt_path="last")
    assert sorted(resumed.losses) == [5, 6, 7, 8, 9]
    assert {step: full.losses[step] for step in resumed.losses} == resumed.losses  # exact float equality
    assert resume_worker.model(0).config.dropout == 0.1


def test_on_one_device_without_a_strategy_the_callbacks_run_through_a_mesh_of_one(tmp_path):
    # developed on one device, the run writes the checkpoints the scaled-out runs read: ml.Trainer's "auto" is
    # meshlight's ddp when a callback needs one of meshlight's strategies
    import meshlight as ml
    from meshlight.callbacks import DistributedCheckpoint, MixedPrecision
    from meshlight.parallel import is_complete

    losses = resume_worker.Losses()
    for callbacks in ([DistributedCheckpoint(tmp_path / "ckpt", every_n_train_steps=2, async_save=False)],
                      [MixedPrecision("bf16"), losses]):
        trainer = ml.Trainer(devices=1, accelerator="cpu", max_steps=4, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, callbacks=callbacks)
        assert type(trainer.strategy) is ml.DDPStrategy and trainer.strategy.layout.world_size == 1
        trainer.fit(resume_worker.model(0), _data())
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step=000000004"]  # (keeps the newest)
    assert is_complete(tmp_path / "ckpt" / "step=000000004") and sorted(losses.losses) == [1, 2, 3, 4]
    plain = ml.Trainer(devices=1, accelerator="cpu", logger=False)
    assert type(plain.strategy).__name__ == "SingleDeviceStrategy"  # nothing asks for a mesh: Lightning's own


def test_a_checkpoint_written_on_one_device_resumes_under_zero3_on_two_processes(tmp_path):
    # the same global batch of 16 (8 per rank there), no dropout: the continuation is the one device's
    import meshlight as ml
    from meshlight.callbacks import DistributedCheckpoint

    losses = resume_worker.Losses()
    trainer = ml.Trainer(devices=1, accelerator="cpu", max_steps=6, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0,
                         callbacks=[losses, DistributedCheckpoint(tmp_path / "one", every_n_train_steps=2,
                                                                  keep_last_k=3, async_save=False)])
    trainer.fit(resume_worker.model(0, dropout=0.0), _one_device_data())
    torchrun(WORKER, 2, "from-one-device", str(tmp_path / "one" / "step=000000004"), str(tmp_path / "out.pt"),
             timeout=300)
    resumed = torch.load(tmp_path / "out.pt")
    assert sorted(resumed) == [5, 6]
    for step, loss in resumed.items():
        assert abs(loss - losses.losses[step]) <= 1e-5 * losses.losses[step], (step, loss, losses.losses[step])


def _one_device_data():
    from meshlight.demos import AdditionDataModule

    return AdditionDataModule(3, batch_size=resume_worker.GLOBAL_BATCH,
                              train_size=resume_worker.GLOBAL_BATCH * resume_worker.STEPS_PER_EPOCH)


def test_refuses_strategies_that_are_not_meshlights(tmp_path):
    import lightning.pytorch as pl

    from meshlight.callbacks import DistributedCheckpoint

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                         callbacks=[DistributedCheckpoint(tmp_path)])
    with pytest.raises(TypeError, match="DistributedCheckpoint writes through meshlight's strategies.*use ml.Trainer"
                                        r" \(on one device it runs meshlight's \"ddp\""):
        trainer.fit(resume_worker.model(0), _data())


def test_resuming_with_another_global_batch_warns(tmp_path):
    _fit(tmp_path, tmp_path / "ckpt", max_steps=2, async_save=False)
    with pytest.warns(UserWarning, match="Resuming with a global batch of 8 .* saved with 4"):
        _fit(tmp_path, tmp_path / "ckpt", max_steps=4, ckpt_path="last", batch_size=8)


def test_resuming_with_another_max_steps_warns(tmp_path, recwarn):
    import warnings

    warnings.simplefilter("always")
    _fit(tmp_path, tmp_path / "ckpt", max_steps=2, async_save=False)
    _fit(tmp_path, tmp_path / "ckpt", max_steps=4, async_save=False, ckpt_path="last")
    (warning,) = [w for w in recwarn if "max_steps" in str(w.message)]
    assert "Resuming with max_steps=4; the checkpoint was saved by a run with max_steps=2" in str(warning.message)
    recwarn.clear()
    _fit(tmp_path, tmp_path / "same", max_steps=4, async_save=False, keep_last_k=2)  # fresh: nothing to compare
    _fit(tmp_path, tmp_path / "same", max_steps=4, async_save=False, ckpt_path=str(tmp_path / "same" /
                                                                                    "step=000000002"))
    assert not [w for w in recwarn if "max_steps" in str(w.message)]


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


@pytest.mark.parametrize("save_on_sigterm", [True, False])
def test_sigterm_in_one_process_stops_after_the_optimizer_step_and_saves_it_unless_told_not_to(tmp_path,
                                                                                               save_on_sigterm):
    import os
    import signal

    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    import meshlight as ml
    from meshlight.callbacks import DistributedCheckpoint

    class TermAtStep3(Callback):
        """SIGTERM as the first of step 3's two accumulated batches starts."""

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == 4:
                os.kill(os.getpid(), signal.SIGTERM)

    checkpoint = DistributedCheckpoint(tmp_path / "ckpt", save_on_sigterm=save_on_sigterm)
    trainer = ml.Trainer(strategy="ddp", devices=1, accelerator="cpu", max_steps=10, accumulate_grad_batches=2,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[TermAtStep3(), checkpoint])
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SIGTERMException):
        trainer.fit(resume_worker.model(0), _data(batch_size=2))
    assert trainer.global_step == 3  # not within the accumulation window: after its optimizer step
    assert signal.getsignal(signal.SIGTERM) is before  # the handler lives only as long as fit
    assert checkpoint.complete_steps() == ([3] if save_on_sigterm else [])


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
    with pytest.raises(CheckpointError, match=r"meta.pt is truncated or grown \(16 bytes, written with"):
        _fit(tmp_path, tmp_path / "other", max_steps=4, ckpt_path=str(folder))
    shard = next(p for p in folder.iterdir() if p.suffix == ".distcp")
    (folder / "meta.pt").write_bytes(before["meta.pt"])
    shard.write_bytes(shard.read_bytes()[:100])
    damaged = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(shard))} is truncated or grown \(100 bytes"):
        _fit(tmp_path, tmp_path / "other", max_steps=4, ckpt_path=str(folder))
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == damaged  # a failed resume writes nothing
    # without the checksums (a checkpoint of an older meshlight, or DCP's alone) the reads still name the damage
    for record in folder.glob("checksums-*.json"):
        record.unlink()
    with pytest.raises(CheckpointError, match=rf"'{re.escape(str(shard))}' is truncated \(100 of [\d,]+ bytes\)"):
        _fit(tmp_path, tmp_path / "other", max_steps=4, ckpt_path=str(folder))
    shard.write_bytes(before[shard.name])
    (folder / "meta.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"meta.pt' cannot be read .*: the file is corrupted"):
        _fit(tmp_path, tmp_path / "other", max_steps=4, ckpt_path=str(folder))
    (folder / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata' is missing"):
        _fit(tmp_path, tmp_path / "other", max_steps=4, ckpt_path=str(folder))
    assert {p.name for p in folder.iterdir()} == set(before) - {".metadata", "checksums-0.json"}
    assert not (tmp_path / "other").exists()  # no run that failed to resume saved anything


class _Payload:
    """Unpickling it runs code: it creates the file named."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_random_state_file_that_would_run_code_is_refused_naming_it_unless_trusted(tmp_path):
    from meshlight.parallel.checkpoint import CheckpointError

    _fit(tmp_path, tmp_path / "ckpt", max_steps=2, async_save=False)
    folder = tmp_path / "ckpt" / "step=000000002"
    state = torch.load(folder / "rng-0.pt", weights_only=True)  # what meshlight writes loads without unpickling
    assert set(state) >= {"torch", "numpy", "python", "world_size"}
    ran = tmp_path / "payload-ran"
    torch.save({**state, "numpy": _Payload(ran)}, folder / "rng-0.pt")
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(folder / 'rng-0.pt'))} is (damaged|truncated)"):
        _fit(tmp_path, tmp_path / "other", max_steps=4, ckpt_path=str(folder))  # it is not the file written
    # checksums are no defence against someone who writes them too: the file is still read as data only
    from meshlight.parallel.integrity import record_checksums

    record_checksums(str(folder), ["rng-0.pt"], rank=0)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(folder / 'rng-0.pt'))}' holds objects that unpickling"
                                              r" would have to run code for.*weights_only=False"):
        _fit(tmp_path, tmp_path / "other", max_steps=4, ckpt_path=str(folder))
    assert not ran.exists()  # refused before anything ran
    torch.save(state, folder / "rng-0.pt")
    record_checksums(str(folder), ["rng-0.pt"], rank=0)
    _fit(tmp_path, tmp_path / "other", max_steps=4, ckpt_path=str(folder))  # the file as meshlight wrote it resumes


def test_metadata_that_would_run_code_is_refused_naming_it_unless_trusted(tmp_path):
    from meshlight.parallel.checkpoint import CheckpointError
    from meshlight.parallel.integrity import record_checksums

    _fit(tmp_path, tmp_path / "ckpt", max_steps=2, async_save=False)
    folder = tmp_path / "ckpt" / "step=000000002"
    meta = torch.load(folder / "meta.pt", weights_only=True)  # what meshlight writes loads without unpickling
    ran = tmp_path / "payload-ran"
    torch.save({**meta, "planted": _Payload(ran)}, folder / "meta.pt")
    record_checksums(str(folder), ["meta.pt"], rank=0)  # as whoever planted it would
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(folder / 'meta.pt'))}' holds objects that unpickling"
                                              r" would have to run code for.*weights_only=False"):
        _fit(tmp_path, tmp_path / "other", max_steps=4, ckpt_path=str(folder))
    assert not ran.exists()  # refused before anything ran
    _fit(tmp_path, tmp_path / "other", max_steps=4, ckpt_path=str(folder), weights_only=False)  # trusted: read
    assert ran.exists()


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


def test_a_zero3_checkpoint_saved_right_after_validation_resumes_bitwise(tmp_path):
    # After a validation forward ZeRO-3's root unit (embedding, head) is still gathered, as FSDP2 keeps a root
    # until its backward; a checkpoint written then must hold the sharded state like any other.
    torchrun(WORKER, 2, "validated", str(tmp_path / "ckpt"), str(tmp_path / "out.pt"), timeout=600)
    full, resumed = torch.load(tmp_path / "out.pt")
    assert sorted(resumed) == list(range(7, 13))
    assert {step: full[step] for step in resumed} == resumed  # exact float equality


# ---------------------------------------------------------------- 3-D: exact resume, resharding


@pytest.fixture(scope="module")
def resharded(tmp_path_factory) -> dict:
    from tests.callbacks.workers import reshard_worker

    root = tmp_path_factory.mktemp("reshard")
    worker = Path(reshard_worker.__file__)
    killed = torchrun(worker, 8, "kill", str(root), timeout=600, check=False)
    assert killed.returncode != 0, "the 3-D run was meant to be killed after step 12"
    started = time.monotonic()
    torchrun(worker, 8, "term", str(root), str(root / "term.pt"), timeout=300)  # before: hung until killed
    term_seconds = time.monotonic() - started
    term_saved = sorted(p.name for p in (root / "term").iterdir())
    started = time.monotonic()
    torchrun(worker, 8, "requeue", str(root), str(root / "requeue.pt"), timeout=300)  # before: hung until killed
    requeue = {"fit": torch.load(root / "requeue.pt")["fit"], "seconds": time.monotonic() - started,
               "saved": sorted(p.name for p in (root / "requeue").iterdir()),
               "scontrol": (root / "scontrol.log").read_text()}
    torchrun(worker, 8, "save", str(root), str(root / "3d.pt"), timeout=900)
    results = {"3d": torch.load(root / "3d.pt"), "directory": root / "full", "term": torch.load(root / "term.pt"),
               "term_seconds": term_seconds, "term_saved": term_saved, "requeue": requeue}
    for name, world in (("ddp", 4), ("zero3", 2), ("single", 1)):
        torchrun(worker, world, "resume", str(root), str(root / f"{name}.pt"), name, timeout=600)
        results[name] = torch.load(root / f"{name}.pt")
    return results


def test_resume_after_sigkill_with_dropout_reproduces_every_loss_bitwise_under_dp2_pp2_tp2(resharded):
    # every random stream — data ranks', pipeline stages', and the tp ranks' own inside the blocks under sequence
    # parallelism — continues where the uninterrupted run had it (the run is killed with dropout on only: a resume
    # exact with every stream in use is exact without; the SIGTERM and requeue resumes below are dropout-free)
    full, resumed = resharded["3d"]["dropout losses"], resharded["3d"]["dropout resumed"]
    first = min(resumed)  # from step 10, or step 5 if step 10's background write was still in flight
    assert first in (6, 11) and sorted(resumed) == list(range(first, 21)), sorted(resumed)
    assert {step: full[step] for step in resumed} == resumed  # exact float equality
    assert full != resharded["3d"]["losses"]  # dropout was on


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step_which_is_saved_and_resumes_bitwise(resharded):
    # Rank 5 alone receives SIGTERM as step 7 starts, mid-way through the pipeline's epoch: every rank finishes
    # step 7 and fit raises SIGTERMException on all 8 (Lightning's own handler, a broadcast inside the signal
    # handler, left all 8 processes waiting on each other here).
    assert resharded["term"]["fit"] == [("SIGTERMException", 7)] * 8
    assert resharded["term_seconds"] < 120  # the 8-process launch and 7 steps: ~10 s on 2 cores
    assert resharded["term_saved"] == ["step=000000007"]  # saved on SIGTERM; step 5's removed (save_top_k=1)
    full, resumed = resharded["3d"]["losses"], resharded["3d"]["resumed_after_term"]
    assert sorted(resumed) == list(range(8, 21))
    assert {step: full[step] for step in resumed} == resumed  # exact float equality
    # trainer.validate (no step to save): every rank stops after the same batch
    assert resharded["term"]["validate"] == [("SIGTERMException", 7)] * 8


def test_slurm_requeue_signal_to_one_rank_saves_after_the_same_step_on_all_and_the_requeued_job_resumes_bitwise(
        resharded):
    # A faked SLURM job (auto-requeue): rank 5 alone receives SIGUSR1 as step 7 starts. Every rank writes
    # hpc_ckpt_1.ckpt after step 7 and rank 0 runs scontrol requeue, which (as SLURM stopping the job) sends rank 0
    # SIGTERM: all 8 stop after step 8. Lightning's own handler writes the checkpoint inside the signal handler, on
    # rank 5 alone: the 8 processes waited on each other until killed (90 s, nothing saved).
    requeue = resharded["requeue"]
    assert requeue["fit"] == [("SIGTERMException", 8)] * 8
    assert requeue["seconds"] < 120 and requeue["scontrol"] == "requeue 4242\n"
    assert requeue["saved"] == ["hpc_ckpt_1.ckpt"]
    # The requeued job calls fit without ckpt_path: Lightning finds the hpc checkpoint, meshlight loads it.
    full, resumed = resharded["3d"]["losses"], resharded["3d"]["resumed_after_requeue"]
    assert sorted(resumed) == list(range(8, 21))
    assert {step: full[step] for step in resumed} == resumed  # exact float equality


@pytest.mark.parametrize("name", ["ddp", "zero3", "single"])
def test_a_3d_checkpoint_resumes_under_another_layout(resharded, name):
    saved, resumed = resharded["3d"], resharded[name]
    assert saved["weights"].keys() == resumed["weights"].keys()
    for key, tensor in saved["weights"].items():
        assert torch.equal(tensor, resumed["weights"][key]), key
    assert sorted(resumed["losses"]) == list(range(11, 16))
    for step, loss in resumed["losses"].items():
        assert loss == pytest.approx(saved["losses"][step], rel=0, abs=1e-5), step


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_consolidate_writes_the_3d_checkpoint_as_one_full_state_dict(resharded, tmp_path, suffix):
    import subprocess
    import sys

    from tests.launch import REPO

    out = tmp_path / f"model{suffix}"
    ckpt = resharded["directory"] / "step=000000010"
    result = subprocess.run([sys.executable, "-m", "meshlight.cli", "consolidate", str(ckpt), str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"to {out}" in result.stdout
    assert "Warning" not in result.stderr, result.stderr  # DCP's "assuming … a single process": that is the intent
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
    for kind in ("none", "rank", "save"):  # the uninterrupted run needs no restart: forked as other launches are
        torchrun(WORKER, 2, "fault", str(root / kind), str(root / f"{kind}.pt"), kind,
                 max_restarts=0 if kind == "none" else 1, timeout=600)
        results[kind] = torch.load(root / f"{kind}.pt")
    return results


@pytest.mark.parametrize("kind", ["rank", "save"])
def test_the_job_restarts_from_the_last_complete_checkpoint_and_ends_with_the_same_weights(faults, kind):
    # "rank": one rank SIGKILLed after step 12; "save": every rank killed inside the save of step 10, with all
    # its files written but not committed, which must then be ignored (the restart resumes from step 5, whose
    # files the crash left as they were) and written again
    reference, restarted = faults["none"], faults[kind]
    assert reference["restarts"] == 0 and restarted["restarts"] == 1
    assert reference["resumed_from"] == 0 and restarted["resumed_from"] == {"rank": 10, "save": 5}[kind]
    assert restarted["step5_intact"] is (True if kind == "save" else None)
    assert restarted["steps"] == reference["steps"] == [15, 20]
    assert reference["weights"].keys() == restarted["weights"].keys()
    for name, tensor in reference["weights"].items():
        assert torch.equal(tensor, restarted["weights"][name]), name


def test_a_crash_inside_an_asynchronous_save_leaves_the_previous_checkpoint_to_resume_from(tmp_path):
    # the process dies from the background writer, its step-4 shards written and nothing committed, while training
    # goes on: "last" is step 2, whose files the crash left as they were, and the resumed run is the uninterrupted one
    crashed = torchrun(WORKER, 1, "async-crash", str(tmp_path / "ckpt"), str(tmp_path / "out.pt"), "first",
                       check=False, timeout=300)
    assert crashed.returncode != 0 and "was meant to kill" not in crashed.stderr
    assert (tmp_path / "ckpt" / "step=000000004").exists()  # left behind, uncommitted
    torchrun(WORKER, 1, "async-crash", str(tmp_path / "ckpt"), str(tmp_path / "out.pt"), "resume", timeout=300)
    result = torch.load(tmp_path / "out.pt")
    assert result["step2_intact"] and result["started"] == 2
    assert sorted(result["resumed"]) == [3, 4, 5, 6]
    assert {step: result["full"][step] for step in result["resumed"]} == result["resumed"]  # bitwise
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step=000000002", "step=000000004",
                                                                     "step=000000006"]


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


def test_an_optimizer_group_without_parameters_here_resumes_with_the_others_restored(tmp_path):
    # a pipeline stage holding none of a group's parameters (the embedding's own group, on the last stage)
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from meshlight.parallel.checkpoint import OPTIMIZER_STATE, load_checkpoint, save_checkpoint

    def model_and_optimizer() -> tuple:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
        groups = [{"params": list(model[0].parameters()), "lr": 0.1}, {"params": [], "lr": 0.2},
                  {"params": list(model[1].parameters()), "lr": 0.3, "weight_decay": 0.0}]
        return model, torch.optim.AdamW(groups)

    model, optimizer = model_and_optimizer()
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    path = tmp_path / "step.ckpt"
    save_checkpoint(path, {"state_dict": model.state_dict(), "optimizer_states": [
        get_optimizer_state_dict(model, optimizer, options=OPTIMIZER_STATE)]}, write_metadata=True, rng_state={})
    fresh, resumed = model_and_optimizer()
    resumed.param_groups[2]["lr"] = 0.0
    load_checkpoint(path, fresh, [resumed])  # was: IndexError from torch's flattened optimizer state
    assert [group["lr"] for group in resumed.param_groups] == [0.1, 0.2, 0.3]
    assert [len(group["params"]) for group in resumed.param_groups] == [2, 0, 2]
    for param, saved in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(resumed.state[param]["exp_avg"], optimizer.state[saved]["exp_avg"])
