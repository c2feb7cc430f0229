"""examples/train_gpt.py runs under Lightning's own launcher (devices=2, no torchrun), logs the losses and
the answer accuracy to TensorBoard, writes a sharded checkpoint and, with --profile-steps, a profiler trace per
rank, and says where the logs and checkpoints are; its compression flags (bf16 gradients and saved activations)
train too."""

import os
import subprocess
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from meshlight.parallel import checkpoint_keys
from tests.launch import REPO


def test_example_trains_logs_and_checkpoints(tmp_path):
    command = [sys.executable, "examples/train_gpt.py", "--strategy", "zero2", "--devices", "2", "--max-steps", "40",
               "--val-every", "20", "--dim", "32", "--profile-steps", "30", "31", "--out", str(tmp_path),
               "--grad-compression", "bf16", "--compress-activations", "bf16"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Trained 40 steps" in result.stdout and "answer accuracy" in result.stdout

    log_dir = tmp_path / "lightning_logs" / "version_0"
    assert f"TensorBoard logs: {log_dir}" in result.stdout
    events = EventAccumulator(str(log_dir))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"train/loss", "val/loss", "val/answer_accuracy"} <= set(scalars)
    train_loss = [e.value for e in events.Scalars("train/loss")]
    assert len(train_loss) == 4 and train_loss[-1] < train_loss[0]

    traces = sorted(p.name.split(".")[0] for p in (log_dir / "profile").glob("*.pt.trace.json"))
    assert traces == ["rank0", "rank1"]  # --profile-steps: one trace per rank, in the log dir

    last = tmp_path / "checkpoints" / "last.ckpt"
    assert f"Last checkpoint:  {last}" in result.stdout
    assert {"state_dict", "optimizer_0"} <= set(checkpoint_keys(last))
