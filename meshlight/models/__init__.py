"""Reference models written to meshlight's pipeline / tensor / expert parallel contract."""

from meshlight.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
