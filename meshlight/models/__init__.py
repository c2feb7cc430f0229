"""Reference models written to meshlight's pipeline / tensor / expert parallel contract, and models users bring built
from their config files (:func:`model_from_config`)."""

from meshlight.models.from_config import ModelConfigError, model_from_config
from meshlight.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "ModelConfigError", "model_from_config"]
