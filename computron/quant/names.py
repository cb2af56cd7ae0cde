"""The names ``ModelConfig.quantization`` takes (no torch: the config checks them on the master)."""
from __future__ import annotations

from typing import Tuple

INT4_GROUPS = (32, 64, 128, 256)


def quantization_kind(value: str) -> Tuple[str, int]:
    """``("int8", 0)`` or ``("int4", group)`` for a ``ModelConfig.quantization`` value; ValueError otherwise."""
    if value == "int8":
        return "int8", 0
    if value == "int4":
        return "int4", 32
    if isinstance(value, str) and value.startswith("int4-g") and value[6:].isdigit() and int(value[6:]) in INT4_GROUPS:
        return "int4", int(value[6:])
    raise ValueError(f"quantization={value!r}: must be 'int8' (per output channel), 'int4' (groups of 32) or "
                     f"'int4-gG' with G one of {', '.join(map(str, INT4_GROUPS))}")



def check_quantization(quantization, compute) -> None:
    """ValueError naming ``ModelConfig``'s field when ``quantization`` or ``quant_compute`` is not one it takes."""
    if quantization is not None:
        try:
            quantization_kind(quantization)
        except ValueError as exc:
            raise ValueError(f"ModelConfig.{exc}") from None
    if compute not in (None, "expand", "packed"):
        raise ValueError(f"ModelConfig.quant_compute={compute!r}: must be 'expand', 'packed' or None")


__all__ = ["INT4_GROUPS", "quantization_kind", "check_quantization"]
