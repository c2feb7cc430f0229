"""Random-generator states in a form that loads without running code: tensors, numbers, tuples and dicts only
(``torch.load(..., weights_only=True)``), where Lightning's collection holds numpy's state as an array."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["from_weights_only_form", "weights_only_form"]

_ARRAY = "numpy.ndarray"


def weights_only_form(value: Any) -> Any:
    """``value`` with every numpy array (numpy's generator state) as a tensor, in a form ``torch.load`` reads with
    ``weights_only=True``; :func:`from_weights_only_form` turns it back."""
    if isinstance(value, np.ndarray):
        return {_ARRAY: torch.from_numpy(value.copy())}
    if isinstance(value, (tuple, list)):
        return type(value)(weights_only_form(v) for v in value)
    if isinstance(value, dict):
        return {k: weights_only_form(v) for k, v in value.items()}
    return value


def from_weights_only_form(value: Any) -> Any:
    """``value`` as it was before :func:`weights_only_form`."""
    if isinstance(value, dict) and set(value) == {_ARRAY}:
        return value[_ARRAY].numpy()
    if isinstance(value, (tuple, list)):
        return type(value)(from_weights_only_form(v) for v in value)
    if isinstance(value, dict):
        return {k: from_weights_only_form(v) for k, v in value.items()}
    return value
