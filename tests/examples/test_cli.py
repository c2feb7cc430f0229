"""examples/cli.py: LightningCLI trains from the YAML files in examples/configs — one naming the strategy ("3d"),
one giving a strategy class with its arguments — with command-line overrides, as its docstring shows; and every
meshlight strategy class builds from ``class_path``/``init_args`` as LightningCLI reads them."""

import pytest

import meshlight as ml
from tests.examples.run import run_example

jsonargparse = pytest.importorskip("jsonargparse")


@pytest.mark.parametrize("name", ["DDPStrategy", "ZeroStrategy", "TensorParallelStrategy", "PipelineStrategy",
                                  "MoEStrategy", "ContextParallelStrategy", "Hybrid3DStrategy", "MeshStrategy"])
def test_every_strategy_class_builds_from_class_path(name):
    """jsonargparse follows a subclass's **kwargs into MeshStrategy's signature: a size the subclass passes on
    itself must not come back from there as a second value."""
    from lightning.pytorch.strategies import Strategy

    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--strategy", type=Strategy)
    config = parser.parse_args(["--strategy", f'{{"class_path": "meshlight.{name}", "init_args": {{"zero": 1}}}}'
                                if name not in ("DDPStrategy", "ZeroStrategy") else f"meshlight.{name}"])
    strategy = parser.instantiate_classes(config).strategy
    assert type(strategy) is getattr(ml, name)


def test_strategy_by_name_from_yaml(tmp_path):
    result = run_example("cli.py", "fit", "--config", "examples/configs/3d.yaml", "--trainer.devices", "2",
                         "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
                         "--trainer.default_root_dir", str(tmp_path))
    assert "meshlight layout planner" in result.stdout + result.stderr  # "3d" planned the layout
    assert (tmp_path / "lightning_logs" / "version_0").is_dir()


def test_strategy_class_with_arguments_from_yaml(tmp_path):
    config = run_example("cli.py", "fit", "--config", "examples/configs/hybrid.yaml", "--print_config")
    assert "class_path: meshlight.Hybrid3DStrategy" in config.stdout and "microbatches: 4" in config.stdout
    result = run_example("cli.py", "fit", "--config", "examples/configs/hybrid.yaml", "--trainer.devices", "2",
                         "--trainer.strategy.init_args.dp", "1", "--trainer.strategy.init_args.tp", "1",
                         "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
                         "--trainer.default_root_dir", str(tmp_path))
    assert "pp=2" in result.stdout + result.stderr
    assert (tmp_path / "lightning_logs" / "version_0").is_dir()
