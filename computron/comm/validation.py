"""Request-field checks shared by the master's batch managers and the workers' runners.

Kept free of torch and of the worker modules, so that master-side code
(``generation``, ``understanding``) validates requests without importing the
code that runs models.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List

POOLINGS = ("mean", "cls")
"""How an embedding is taken from the last hidden states: their masked mean, or the first token's."""


def is_valid_seed(seed) -> bool:
    """An int seed a ``torch.Generator`` takes: in [0, 2**63), and not a bool."""
    return isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2 ** 63


def is_finite_number(x) -> bool:
    """An int or float that is finite, and not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def int_list(data: Dict[str, Any], key: str) -> List[int]:
    """``data[key]`` as a list of ints: a list or tuple of ints, or a 1-D integer tensor (``[1, n]`` taken
    as ``[n]``); ``PayloadError`` naming ``key`` otherwise."""
    from ..errors import PayloadError
    v = data[key]
    if hasattr(v, "dim") and hasattr(v, "tolist"):  # a tensor, without importing torch here
        if v.dim() == 2 and v.shape[0] == 1:
            v = v[0]
        if v.dim() != 1 or v.dtype.is_floating_point or v.dtype.is_complex or str(v.dtype) == "torch.bool":
            raise PayloadError(f"{key} must be a 1-D integer tensor, got shape {tuple(v.shape)} {v.dtype}", key)
        return v.tolist()
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise PayloadError(f"{key} must be a list of ints or a 1-D integer tensor", key)
    return list(v)


__all__ = ["POOLINGS", "is_valid_seed", "is_finite_number", "int_list"]
