"""examples/slurm.sh under a faked SLURM job: the batch script's variables, and an ``srun`` stand-in
(tests/examples/fake_slurm/srun) that starts 2 local tasks with the variables srun gives each. Lightning's
SLURMEnvironment takes the ranks from them: the 2 tasks form one 2-process job rather than two 2-process jobs."""

import os
import sys

from tests.examples.run import run_command
from tests.launch import REPO

JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "meshlight", "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "2",
       "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_SUBMIT_DIR": str(REPO), "ACCELERATOR": "cpu"}


def test_slurm_script_trains_on_two_srun_tasks(tmp_path):
    fake = REPO / "tests" / "examples" / "fake_slurm"
    path = os.pathsep.join([str(fake), os.path.dirname(sys.executable), os.environ["PATH"]])
    result = run_command(["bash", "examples/slurm.sh", "--strategy", "ddp", "--max-steps", "6", "--val-every", "3",
                          "--dim", "32", "--out", str(tmp_path)], env={**JOB, "PATH": path})
    output = result.stdout + result.stderr
    assert output.count("MEMBER: 1/2") == 1 and output.count("MEMBER: 2/2") == 1  # one job of 2 ranks
    assert "Trained 6 steps" in result.stdout and "dp=2" in result.stdout
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
