"""Checking request fields: typed getters that answer 400 naming the field (a known field with a bad value
always answers 400; unknown fields are ``field_policy.FieldPolicy``'s). Pure Python."""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

from ...sched.keep_alive import KeepAliveError, parse_keep_alive
from ..errors import bad


def body_object(body: Any) -> Dict[str, Any]:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    return body


def model_field(body: Any) -> str:
    """The ``model`` of a request body, which must be a JSON object."""
    model = body_object(body).get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model: a model id (string) is required")
    return model


def number(body: Dict[str, Any], name: str, lo: float, hi: float, lo_open: bool = False,
           hi_open: bool = False) -> Optional[float]:
    """A number in [lo, hi] (open ends as asked); None when absent or null."""
    v = body.get(name)
    if v is None:
        return None
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v > hi or v < lo
            or (lo_open and v == lo) or (hi_open and v == hi)):
        where = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise bad(name, f"{name}={v!r}: must be a number in {where}")
    return float(v)


def integer(body: Dict[str, Any], name: str, lo: int, hi: Optional[int] = None) -> Optional[int]:
    """An integer in [lo, hi]; None when absent or null."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise bad(name, f"{name}={v!r}: must be an integer " + (f">= {lo}" if hi is None else f"in [{lo}, {hi}]"))
    return v


def boolean(body: Dict[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"{name}={v!r}: must be true or false")
    return v


def obj(body: Dict[str, Any], name: str) -> Optional[Dict[str, Any]]:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad(name, f"{name}: must be an object")
    return v


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def token_ids(v: Any) -> bool:
    """Whether ``v`` is a non-empty list of token ids."""
    return isinstance(v, list) and bool(v) and all(is_int(t) for t in v)


def keep_alive_of(body: Dict[str, Any]) -> Optional[float]:
    """The request's ``keep_alive`` (Ollama's: how long its model stays resident after it) in seconds, -1.0 for
    as long as memory allows; None when it gives none. 400 naming the field for anything else."""
    if body.get("keep_alive") is None:
        return None
    try:
        return parse_keep_alive(body["keep_alive"])
    except KeepAliveError as exc:
        raise bad("keep_alive", str(exc)) from None
