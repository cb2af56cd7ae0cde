"""What every config class shares: the error a bad field raises."""
from __future__ import annotations

from typing import Any


def _fail(cls: str, name: str, value: Any, why: str):
    raise ValueError(f"{cls}.{name}={value!r}: {why}")
