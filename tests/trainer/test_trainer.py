"""meshlight.Trainer resolves strategy names, registers the names Lightning lacks, logs to TensorBoard,
and rejects invalid layouts when it is constructed — before any process is launched."""

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy as LightningDDP

import meshlight as ml


def _trainer(strategy, devices=2, **kwargs):
    return ml.Trainer(strategy=strategy, devices=devices, accelerator="cpu", **kwargs)


@pytest.mark.parametrize(
    ("name", "cls", "zero"),
    [("ddp", ml.DDPStrategy, 0), ("zero1", ml.ZeroStrategy, 1), ("zero2", ml.ZeroStrategy, 2),
     ("zero3", ml.ZeroStrategy, 3), ("fsdp", ml.ZeroStrategy, 3)],
)
def test_names_resolve_to_meshlight_strategies(name, cls, zero):
    strategy = _trainer(name, devices=4).strategy
    assert type(strategy) is cls
    assert (strategy.layout.zero, strategy.layout.dp, strategy.layout.world_size) == (zero, 4, 4)


def test_lightning_trainer_finds_the_names_it_lacks_but_keeps_its_own():
    assert type(pl.Trainer(strategy="zero2", devices=2, accelerator="cpu", logger=False).strategy) is ml.ZeroStrategy
    assert type(pl.Trainer(strategy="ddp", devices=2, accelerator="cpu", logger=False).strategy) is LightningDDP


def test_tensorboard_is_the_default_logger(tmp_path):
    trainer = _trainer("ddp", default_root_dir=tmp_path)
    assert isinstance(trainer.logger, TensorBoardLogger) and trainer.logger.save_dir == str(tmp_path)
    assert _trainer("ddp", logger=False).logger is None


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        (lambda: ml.MeshStrategy(dp_replicate=3), "uses 3 processes but the world has 4"),
        (lambda: ml.MeshStrategy(dp_replicate="auto", tp=3), "does not divide"),
        (lambda: ml.MeshStrategy(dp_replicate="auto", zero=4), "zero=4 is not a ZeRO stage"),
        (lambda: ml.MeshStrategy(dp_replicate="auto", pp=0), "pp=0 is not a valid size"),
        (lambda: ml.ZeroStrategy(stage=3, dp_replicate=3), "does not divide"),
    ],
)
def test_invalid_layouts_fail_when_the_trainer_is_built(strategy, message):
    with pytest.raises(ValueError, match=message):
        _trainer(strategy(), devices=4)


def test_invalid_zero_stage_fails_at_construction():
    with pytest.raises(ValueError, match="choose stage 1"):
        ml.ZeroStrategy(stage=4)
