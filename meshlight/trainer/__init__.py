"""``meshlight.Trainer``: Lightning's Trainer with meshlight's strategy names and TensorBoard logging."""

from meshlight.trainer.trainer import Trainer

__all__ = ["Trainer"]
