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


def test_a_parallelized_module_refuses_a_second_layout(tmp_path):
    """Checked in one process (world size 1), where DDP and ZeRO-3 are still different layouts."""
    import lightning.pytorch as pl
    import pytest

    from meshlight.demos import LitGPT, RandomTokensDataModule
    from meshlight.models import GPTConfig

    pl.seed_everything(0, verbose=False)
    module = LitGPT(GPTConfig.tiny(dim=32, vocab_size=32, max_seq_len=16))
    data = RandomTokensDataModule(vocab_size=32, seq_len=16, batch_size=2, train_size=4, val_size=2)
    options = dict(devices=1, accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                   enable_checkpointing=False, default_root_dir=tmp_path)
    trainer = ml.Trainer(strategy="zero3", **options)
    trainer.fit(module, data)
    trainer.validate(module, data, verbose=False)  # the same Trainer reuses the parallelized module
    message = r"already parallelized as dp=1 \(ZeRO-3\).* cannot also run as dp=1 \(DDP\)"
    with pytest.raises(RuntimeError, match=message):
        ml.Trainer(strategy="ddp", **options).fit(module, data)
