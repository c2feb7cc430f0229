"""Train from a YAML configuration with Lightning's command line (LightningCLI), the strategy chosen in the file.

    python examples/cli.py fit --config examples/configs/3d.yaml        # strategy: 3d, by name
    python examples/cli.py fit --config examples/configs/hybrid.yaml    # a strategy class with its arguments
    python examples/cli.py fit --config examples/configs/3d.yaml --trainer.max_steps 50 --model.lr 1e-3
    python examples/cli.py fit --print_config                           # every option, as YAML

Any option of the Trainer, the model (``meshlight.demos.LitGPT``) and the data (``AdditionDataModule``) can be set
in the file or on the command line; ``trainer.strategy`` takes a name meshlight registers (``"zero3"``, ``"3d"``,
…) or ``class_path``/``init_args`` of any meshlight strategy. Requires ``pip install meshlight[cli]``
(``jsonargparse``).
"""

from lightning.pytorch.cli import LightningCLI

import meshlight as ml
from meshlight.demos import AdditionDataModule, LitGPT


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(LitGPT, AdditionDataModule, trainer_class=ml.Trainer, args=args)


if __name__ == "__main__":
    main()
