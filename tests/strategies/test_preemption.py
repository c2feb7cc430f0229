"""SLURM's requeue signal (``#SBATCH --signal=USR1@90`` with Lightning's auto-requeue) under meshlight, in one process
under a faked SLURM job: the checkpoint is written after the optimizer step at which the ranks agree, ``scontrol
requeue`` runs once, and the requeued job's ``fit`` (no ``ckpt_path``) resumes it bit for bit — mid-epoch, inside
gradient accumulation, and at an epoch's end. The same on the 8 ranks of a dp=2 × pp=2 × tp=2 run, and SIGTERM:
tests/callbacks/test_checkpoint.py."""

import os
import signal
import stat

import pytest

from tests.callbacks.workers import resume_worker

JOB = {"SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": "1", "SLURM_PROCID": "0",
       "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "127.0.0.1", "SLURM_JOB_NAME": "train",
       "SLURM_JOB_ID": "4242"}
MAX_STEPS, BATCHES_PER_EPOCH = 10, 6  # step 6 ends an epoch with or without accumulating 2 batches


@pytest.fixture
def slurm_job(tmp_path, monkeypatch):
    """A SLURM job's environment, and an ``scontrol`` on PATH that appends its arguments to the returned file."""
    for name, value in JOB.items():
        monkeypatch.setenv(name, value)
    for name in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.log"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    calls.touch()
    return calls


def _signal_at(accumulate, *steps):
    """A callback sending this process SIGUSR1 as the first batch of each of the given optimizer steps starts."""
    from lightning.pytorch.callbacks import Callback

    class Requeue(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx % accumulate == 0 and trainer.global_step + 1 in steps:
                os.kill(os.getpid(), signal.SIGUSR1)

    return Requeue()


def _crash_at(step):
    """A callback raising RuntimeError as the given optimizer step starts (a crash, not a signal)."""
    from lightning.pytorch.callbacks import Callback

    class Crash(Callback):
        def on_train_batch_start(self, trainer, *args):
            if trainer.global_step + 1 == step:
                raise RuntimeError("node failure")

    return Crash()


def _fit(root, accumulate, *callbacks, ckpt_path=None):
    """Fit under the faked job as a requeued job's script would (by default without ckpt_path). Returns {global
    step: the loss of the last batch before it} and the trainer."""
    import meshlight as ml
    from meshlight.callbacks import DistributedCheckpoint
    from meshlight.demos import AdditionDataModule

    losses = resume_worker.Losses()
    trainer = ml.Trainer(strategy="ddp", devices=1, accelerator="cpu", max_steps=MAX_STEPS, logger=False,
                         accumulate_grad_batches=accumulate, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=any(isinstance(c, DistributedCheckpoint) for c in callbacks),
                         limit_val_batches=0, default_root_dir=root,
                         callbacks=[losses, *callbacks])
    data = AdditionDataModule(3, batch_size=4, train_size=4 * BATCHES_PER_EPOCH)
    trainer.fit(resume_worker.model(0), data, ckpt_path=ckpt_path)
    return losses.losses, trainer


def _hpc(root):
    from meshlight.parallel.checkpoint import is_complete

    return {p.name: is_complete(p) for p in root.iterdir() if p.name.startswith("hpc_ckpt_")}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_requeue_signal_saves_after_the_step_requeues_once_and_the_requeued_job_resumes_bitwise(
        tmp_path, slurm_job, accumulate):
    root = tmp_path / "run"

    def resumes_from(step, resumed, trainer):
        # with accumulation a step's key holds the loss of the next step's first batch
        assert min(resumed) == step + (accumulate == 1) and max(resumed) == MAX_STEPS
        assert resumed == {step: full[step] for step in resumed}  # exact float equality
        # Lightning's count of optimizer steps for logging continues as in the uninterrupted run
        assert trainer.fit_loop.epoch_loop._batches_that_stepped == batches_that_stepped

    # The job: SIGUSR1 as step 2 starts (with accumulation, at its first batch), again at step 5 (ignored: the
    # job is already requeued). Saved after step 2, mid-epoch; training goes on (scontrol here stops nothing).
    full, trainer = _fit(root, accumulate, _signal_at(accumulate, 2, 5))
    batches_that_stepped = trainer.fit_loop.epoch_loop._batches_that_stepped
    assert trainer.global_step == MAX_STEPS
    assert slurm_job.read_text() == "requeue 4242\n"
    assert _hpc(root) == {"hpc_ckpt_1.ckpt": True}

    # The requeued job finds an hpc checkpoint killed mid-write (its .incomplete marker still there) beside it:
    # Lightning would pick the highest number; meshlight resumes from the newest whole one and says so.
    (root / "hpc_ckpt_2.ckpt").mkdir()
    (root / "hpc_ckpt_2.ckpt" / ".incomplete").touch()
    with pytest.warns(UserWarning, match=r"hpc_ckpt_2.ckpt was interrupted while being written: skipped"):
        resumed, trainer = _fit(root, accumulate, _signal_at(accumulate, 6))
    resumes_from(2, resumed, trainer)
    # SIGUSR1 as step 6 (an epoch's last) starts: saved after it; the older ones removed.
    assert slurm_job.read_text() == "requeue 4242\n" * 2
    assert _hpc(root) == {"hpc_ckpt_3.ckpt": True}

    # Requeued again, from the end of an epoch; the signal at the last step: training ends, no save, no requeue.
    resumed, trainer = _fit(root, accumulate, _signal_at(accumulate, MAX_STEPS))
    resumes_from(6, resumed, trainer)
    assert slurm_job.read_text() == "requeue 4242\n" * 2
    assert _hpc(root) == {"hpc_ckpt_3.ckpt": True}

    # Outside fitting nothing is saved: the job is requeued at once.
    from lightning.pytorch.callbacks import Callback

    class RequeueInValidation(Callback):
        def on_validation_batch_start(self, *args):
            os.kill(os.getpid(), signal.SIGUSR1)

    import meshlight as ml
    from meshlight.demos import AdditionDataModule

    trainer = ml.Trainer(strategy="ddp", devices=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root, callbacks=[RequeueInValidation()])
    trainer.validate(resume_worker.model(0), AdditionDataModule(3, batch_size=4, val_size=8))
    assert slurm_job.read_text() == "requeue 4242\n" * 3
    assert _hpc(root) == {"hpc_ckpt_3.ckpt": True}


def test_a_resumed_job_takes_the_newest_of_the_hpc_and_the_distributed_checkpoints(tmp_path, slurm_job):
    from meshlight.callbacks import DistributedCheckpoint

    full, _ = _fit(tmp_path / "full", 1)

    def resumes_from(step, resumed):
        assert min(resumed) == step + 1 and max(resumed) == MAX_STEPS
        assert resumed == {step: full[step] for step in resumed}

    # The job: the requeue signal at step 2 (hpc_ckpt_1 holds it), DistributedCheckpoint at steps 4 and 8, and a
    # crash as step 9 starts. SLURM requeues a job after a node failure with no signal: the job script's fit
    # without ckpt_path would go back to hpc_ckpt_1 under Lightning's rule; the newer step 8 is taken.
    root = tmp_path / "crash"

    def checkpoints():
        return DistributedCheckpoint(str(root / "ckpts"), every_n_train_steps=4, async_save=False)

    with pytest.raises(RuntimeError, match="node failure"):
        _fit(root, 1, _signal_at(1, 2), _crash_at(9), checkpoints())
    assert _hpc(root) == {"hpc_ckpt_1.ckpt": True}
    resumed, _ = _fit(root, 1, checkpoints())
    resumes_from(8, resumed)

    # The requeue signal at step 6 (after DistributedCheckpoint's step 4), then a crash as step 8 starts:
    # ckpt_path="last" takes hpc_ckpt_1 (step 6), the newer.
    root = tmp_path / "last"
    with pytest.raises(RuntimeError, match="node failure"):
        _fit(root, 1, _signal_at(1, 6), _crash_at(8), checkpoints())
    assert (root / "ckpts" / "step=000000004").is_dir() and _hpc(root) == {"hpc_ckpt_1.ckpt": True}
    resumed, trainer = _fit(root, 1, checkpoints(), ckpt_path="last")
    resumes_from(6, resumed)
    assert trainer.newest_checkpoint() == (MAX_STEPS, str(root / "ckpts" / "step=000000010"))


def test_requeue_names_an_array_task_and_warns_when_it_cannot(slurm_job, monkeypatch):
    from meshlight.strategies.preemption import requeue_slurm_job

    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert requeue_slurm_job()
    assert slurm_job.read_text() == "requeue 77_3\n"
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.warns(UserWarning, match="`scontrol` is not on PATH; job 77_3 was not requeued"):
        assert not requeue_slurm_job()


def test_requeue_tries_again_when_scontrol_fails_or_hangs(tmp_path, slurm_job, monkeypatch):
    import meshlight.strategies.preemption as preemption

    monkeypatch.setattr(preemption, "RETRY_WAIT", 0.0)
    monkeypatch.setattr(preemption, "SCONTROL_TIMEOUT", 1.0)
    # slurmctld busy: the first call times out on the socket, the second hangs, the third is accepted
    answers = tmp_path / "answers"
    answers.write_text("fail\nhang\nok\n")
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> "{slurm_job}"\nanswer=$(head -n 1 "{answers}")\n'
                        f'sed -i 1d "{answers}"\n'
                        '[ "$answer" = fail ] && { echo "Socket timed out on send/recv operation" >&2; exit 1; }\n'
                        '[ "$answer" = hang ] && exec sleep 30\nexit 0\n')
    with pytest.warns(UserWarning) as warned:
        assert preemption.requeue_slurm_job()
    assert slurm_job.read_text() == "requeue 4242\n" * 3
    assert [str(w.message) for w in warned] == [
        "`scontrol requeue 4242` failed (1: Socket timed out on send/recv operation), attempt 1 of 3; trying again"
        " in 0 s.",
        "`scontrol requeue 4242` failed (no answer in 1 s), attempt 2 of 3; trying again in 0 s."]
    answers.write_text("fail\nfail\nfail\n")
    with pytest.warns(UserWarning) as warned:
        assert not preemption.requeue_slurm_job()
    assert [str(w.message).split("), ")[1] for w in warned] == [
        "attempt 1 of 3; trying again in 0 s.", "attempt 2 of 3; trying again in 0 s.",
        "attempt 3 of 3; job not requeued."]
    # a request left unanswered may still have been carried out: the last warning does not say it was not
    answers.write_text("hang\nfail\nfail\n")
    with pytest.warns(UserWarning) as warned:
        assert not preemption.requeue_slurm_job()
    assert str(warned[-1].message).endswith("attempt 3 of 3; job 4242 may not be requeued: see `scontrol show job"
                                            " 4242`.")
