"""Checkpoint state as data that `torch.load(weights_only=True)` reads: never a pickle that
can run code.

`weights_only` loading accepts tensors, numbers, strings, None and dicts/lists/tuples of
them. The rest of a run's state is converted on the way out and back: numpy arrays (the
controller's histories, numpy's RNG state) travel as tensors under an `__ndarray__` key,
numpy scalars as Python numbers, sets and deques as lists. Anything else is a bug in the
state's author and raises here, at save time, not at the next resume.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

ARRAY = "__ndarray__"


def to_plain(value):
    """`value` with every numpy array/scalar, set and deque replaced by plain data."""
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise TypeError("a checkpoint cannot hold an object array")
        return {ARRAY: torch.from_numpy(np.ascontiguousarray(value))}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {key: to_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, deque)):
        items = [to_plain(item) for item in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, (set, frozenset)):
        return sorted(to_plain(item) for item in value)
    if isinstance(value, torch.Tensor):
        # a file holds host tensors: one restored onto the saving rank's GPU index would fail
        # where that index is absent, and the reader chooses the device anyway
        return value.detach().cpu()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a checkpoint cannot hold a {type(value).__name__}")


def from_plain(value):
    """The inverse of `to_plain` for arrays (sets and deques come back as lists)."""
    if isinstance(value, dict):
        if set(value) == {ARRAY}:
            return value[ARRAY].numpy()
        return {key: from_plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [from_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(from_plain(item) for item in value)
    return value
