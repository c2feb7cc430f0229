"""MeshStrategy takes its world from whichever cluster environment Lightning detects. Lightning's own
launcher is exercised by tests/examples, torchrun by every distributed test; SLURM cannot run here, so this
checks that a job started by srun (its environment variables) is resolved into the right layout and ranks."""

from lightning.fabric.plugins.environments import SLURMEnvironment

import meshlight as ml

SRUN_TASK_3_OF_4 = {
    "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1", "SLURM_NODELIST": "node[1-2]", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "42",
}


def test_layout_and_ranks_come_from_slurm(monkeypatch):
    for name, value in SRUN_TASK_3_OF_4.items():
        monkeypatch.setenv(name, value)
    trainer = ml.Trainer(strategy=ml.ZeroStrategy(stage=3, dp_replicate=2), devices=2, num_nodes=2, accelerator="cpu")
    strategy = trainer.strategy
    assert isinstance(strategy.cluster_environment, SLURMEnvironment)
    assert strategy.launcher is None  # srun started the processes
    assert (strategy.world_size, strategy.global_rank, strategy.local_rank, strategy.node_rank) == (4, 3, 1, 1)
    assert (strategy.layout.dp_replicate, strategy.layout.dp_shard) == (2, 2)
