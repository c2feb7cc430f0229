"""A model users bring, built from its config file alone on the meta device (no memory, no weights, nothing
downloaded): what the layout planner reads to plan a model that is not on this machine."""

from __future__ import annotations

import os

import torch
from torch import nn

__all__ = ["ModelConfigError", "model_from_config"]


class ModelConfigError(ValueError):
    """A path that holds no config a model can be built from."""


def model_from_config(path: str) -> nn.Module:
    """The model whose config is at ``path``, on the meta device: a Hugging Face ``config.json`` (a causal LM, or an
    image-text-to-text model), a litgpt ``model_config.yaml`` (litgpt's GPT), or a checkpoint's folder holding one."""
    if not os.path.exists(path):
        raise ModelConfigError(f"{path}: no such file or folder. Give a config.json (Hugging Face), a"
                               " model_config.yaml (litgpt), or a checkpoint's folder holding one; nothing is"
                               " downloaded.")
    litgpt_file = os.path.join(path, "model_config.yaml") if os.path.isdir(path) else path
    if litgpt_file.endswith((".yaml", ".yml")) and os.path.isfile(litgpt_file) and not os.path.isfile(
            os.path.join(path, "config.json")):
        return _litgpt_model(litgpt_file)
    return _hugging_face_model(path)


def _litgpt_model(path: str) -> nn.Module:
    """litgpt's GPT of the ``model_config.yaml`` at ``path``."""
    try:
        import litgpt
    except ImportError:
        raise ModelConfigError(f"{path} is a litgpt config: pip install 'meshlight[litgpt]'") from None
    try:
        config = litgpt.Config.from_file(path)
    except (TypeError, ValueError) as error:
        raise ModelConfigError(f"{path}: not a litgpt model config ({error}).") from None
    with torch.device("meta"):
        return litgpt.GPT(config)


def _hugging_face_model(path: str) -> nn.Module:
    """The Hugging Face model of the config at ``path`` (a config.json or its folder): a causal LM, or an
    image-text-to-text model (whose decoder is planned)."""
    try:
        import transformers
    except ImportError:
        raise ModelConfigError(f"{path} is read as a Hugging Face config, with transformers: pip install"
                               " 'meshlight[hf]'") from None
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ModelConfigError(f"{path}: no Hugging Face config there ({error}). Give a config.json, a litgpt"
                               " model_config.yaml, or a checkpoint's folder holding one.") from None
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
        try:
            with torch.device("meta"):
                return auto.from_config(config)
        except ValueError:
            continue
    raise ModelConfigError(f"{path}: transformers builds no causal LM (nor an image-text-to-text model) from a"
                           f" {type(config).__name__}.")
