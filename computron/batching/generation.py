"""A checkpoint's ``generation_config.json`` on the master: the EOS ids and the default sampling values
it lists (``GenerationDefaults``), and how they fill the fields a generation request leaves unset (``fill``).

- EOS: every id of the file's ``eos_token_id`` (an int or a list) ends a sequence, besides config.json's
  (``merge_eos``; Llama 3 lists its end-of-turn ids only here).
- Defaults: ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty`` and ``max_new_tokens`` (the
  request's ``max_tokens``, capped to the positions the prompt leaves) fill a request field that is absent or
  None; a value the request sets always wins. ``do_sample: false`` makes greedy the default (temperature 0),
  ``do_sample: true`` without a ``temperature`` samples at temperature 1; without ``do_sample`` a listed ``temperature``
  is the default (as vLLM reads these files). ``repetition_penalty`` applies as transformers' ``generate``
  and vLLM apply it (``batching.controls``), under token-level generation.

A missing file means no defaults; a file that is not JSON, or a field of the wrong type or range, raises
``GenerationConfigError`` naming the file and the field. Stdlib only (the preflight reads these files).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..comm.messages import GENERATION_FIELDS

GENERATION_CONFIG = "generation_config.json"
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens")
"""The request fields a ``GenerationDefaults`` may fill (``max_tokens`` from ``max_new_tokens``)."""


class GenerationConfigError(ValueError):
    """A generation_config.json (or a model's generation_config) that cannot be read: names it and the field."""


def eos_ids(value: Any, where: str = "eos_token_id") -> List[int]:
    """An ``eos_token_id`` value (None, an int or a list of ints) as a list; ``GenerationConfigError``
    naming ``where`` for anything else."""
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise GenerationConfigError(f"{where}={value!r}: must be a token id (an int >= 0), a list of them, "
                                    "or null")
    return list(values)


def merge_eos(*values: Any) -> List[int]:
    """Every id of the given ``eos_token_id`` values (None, an int or a list), first occurrence first."""
    out: List[int] = []
    for v in values:
        out += [i for i in eos_ids(v) if i not in out]
    return out


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_CHECKS = {
    "temperature": (lambda v: _number(v) and v >= 0, "a finite number >= 0"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _int(v) and v >= 0, "an int >= 0 (0: no cut)"),
    "do_sample": (lambda v: isinstance(v, bool), "true or false"),
    "max_new_tokens": (lambda v: _int(v) and v >= 1, "an int >= 1"),
    "repetition_penalty": (lambda v: _number(v) and v > 0, "a number > 0"),
}


@dataclass(frozen=True)
class GenerationDefaults:
    """What a model's generation config adds to its requests: EOS ids, and the values of unset fields."""
    eos_token_id: Tuple[int, ...] = ()
    temperature: Optional[float] = None
    """0.0 where ``do_sample`` is false: greedy unless the request asks to sample."""
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    repetition_penalty: Optional[float] = None
    max_tokens: Optional[int] = None
    """The file's ``max_new_tokens``."""
    source: str = ""
    """Where these come from (the file's path), for messages."""
    ignored: Tuple[str, ...] = ()
    """Listed values the engine does not apply, as ``name=value``."""

    @classmethod
    def parse(cls, values: Mapping[str, Any], source: str) -> "GenerationDefaults":
        """From the fields of a generation config (a JSON object); other keys are ignored."""
        if not isinstance(values, Mapping):
            raise GenerationConfigError(f"{source}: must be a JSON object, got {type(values).__name__}")
        v = {k: values.get(k) for k in GENERATION_FIELDS}
        for k, (ok, what) in _CHECKS.items():
            if v[k] is not None and not ok(v[k]):
                raise GenerationConfigError(f"{source}: {k}={v[k]!r}: must be {what}")
        try:
            eos = eos_ids(v["eos_token_id"])
        except GenerationConfigError as exc:
            raise GenerationConfigError(f"{source}: {exc}") from None
        temperature = v["temperature"]
        if v["do_sample"] is False:
            temperature = 0.0
        elif v["do_sample"] is True and temperature is None:
            temperature = 1.0
        ignored: list = []
        rep = v["repetition_penalty"]
        return cls(repetition_penalty=None if rep in (None, 1, 1.0) else float(rep),
                   eos_token_id=tuple(eos), temperature=None if temperature is None else float(temperature),
                   top_p=None if v["top_p"] is None else float(v["top_p"]), top_k=v["top_k"],
                   max_tokens=v["max_new_tokens"], source=source, ignored=tuple(ignored))

    def request_defaults(self) -> Dict[str, Any]:
        """The request fields these defaults fill, with their values (``SAMPLING_DEFAULTS`` that are set)."""
        return {k: getattr(self, k) for k in SAMPLING_DEFAULTS if getattr(self, k) is not None}

    def describe(self) -> str:
        """For a log line: the EOS ids, the defaults taken, and what is ignored."""
        defaults = ", ".join(f"{k}={v}" for k, v in self.request_defaults().items())
        text = f"eos_token_id {list(self.eos_token_id)}; defaults of unset request fields: {defaults or 'none'}"
        if self.ignored:
            text += f"; ignored (the engine has no such setting): {', '.join(self.ignored)}"
        return text


def read_generation_config(directory: str) -> Optional[GenerationDefaults]:
    """The ``generation_config.json`` of a checkpoint directory, or None when it has none."""
    path = os.path.join(os.fspath(directory), GENERATION_CONFIG)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, ValueError) as exc:
        raise GenerationConfigError(f"{path}: cannot be read as JSON: {exc}") from None
    return GenerationDefaults.parse(values, path)


def fill(data: Mapping[str, Any], defaults: Optional[GenerationDefaults], n_prompt: Optional[int] = None,
         max_positions: Optional[int] = None) -> Mapping[str, Any]:
    """``data`` (a generation request) with its unset fields (absent or None) taken from ``defaults``; the
    fields it sets are kept. A default ``max_tokens`` is capped to the ``max_positions`` the ``n_prompt``
    tokens leave (at least 1). A new dict where a field was filled, else ``data`` itself (never changed)."""
    todo = {k: v for k, v in defaults.request_defaults().items() if data.get(k) is None} if defaults else {}
    if not todo:
        return data
    if "max_tokens" in todo and max_positions is not None and n_prompt is not None:
        todo["max_tokens"] = max(1, min(todo["max_tokens"], max_positions - n_prompt))
    return {**data, **todo}


__all__ = ["GENERATION_CONFIG", "SAMPLING_DEFAULTS", "GenerationConfigError", "GenerationDefaults", "eos_ids",
           "merge_eos", "read_generation_config", "fill"]
