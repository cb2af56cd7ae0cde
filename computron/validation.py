"""Request-field checks shared by the master's batch managers and the workers' runners.

Kept free of torch and of the worker modules, so that master-side code
(``generation``, ``understanding``) validates requests without importing the
code that runs models.
"""
from __future__ import annotations

import math

POOLINGS = ("mean", "cls")
"""How an embedding is taken from the last hidden states: their masked mean, or the first token's."""


def is_valid_seed(seed) -> bool:
    """An int seed a ``torch.Generator`` takes: in [0, 2**63), and not a bool."""
    return isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2 ** 63


def is_finite_number(x) -> bool:
    """An int or float that is finite, and not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


__all__ = ["POOLINGS", "is_valid_seed", "is_finite_number"]
