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


def test_a_module_fitted_again_under_another_layout_is_parallelized_for_it_and_test_reuses_the_fitted_model(tmp_path):
    """On 2 processes: DDP leaves the LightningModule itself as it was (only the root around it carries DDP), so a
    second Trainer with ZeRO-3 parallelizes it anew, from the weights the first fit trained; ``test`` after ``fit``
    runs the very model ``fit`` parallelized; once ZeRO-3 sharded it, a third layout is refused."""
    from pathlib import Path

    import torch

    from tests.launch import torchrun
    from tests.strategies.workers import relayout_worker

    torchrun(Path(relayout_worker.__file__), 2, str(tmp_path))
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert result["ddp_test_reused_fit_model"] and result["zero3_test_reused_fit_model"], result
        assert result["ddp_fsdp_units"] == 0 and result["zero3_fsdp_units"] == 5, result  # 4 blocks + root
        assert result["zero3_weights_are_the_ddp_trained_ones"], result
        assert result["ddp_changed_weights"], result
        assert "already parallelized as dp=2 (ZeRO-3)" in result["third_layout_error"], result
