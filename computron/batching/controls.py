"""A generation request's sampling controls beyond temperature/top-k/top-p: their checks and their SeqSpec fields.

Plain Python (no torch): ``check_controls`` raises one ``PayloadError`` naming the field of a bad value,
``spec_fields`` turns the checked request into the keyword arguments of ``comm.messages.SeqSpec``. The
semantics (applied on the sampling rank, ``models.sampling``):

- ``presence_penalty``, ``frequency_penalty`` in [-2, 2]: over the tokens generated so far,
  ``logit[t] -= presence * (count[t] > 0) + frequency * count[t]``;
- ``repetition_penalty`` > 0: over the prompt's and the generated tokens, a positive logit is divided by
  it, any other multiplied (transformers' ``RepetitionPenaltyLogitsProcessor``);
- ``logit_bias``: ``{token id: bias in [-100, 100]}`` added to the logits;
- ``min_p`` in [0, 1]: after temperature, tokens less likely than ``min_p`` times the likeliest are dropped;
- ``min_tokens`` >= 0: the ending ids (EOS unless ``ignore_eos``, and ``stop_token_ids``) are masked until
  that many tokens were generated;
- ``ignore_eos``: the model's EOS ids do not end the sequence; ``stop_token_ids`` end it like an EOS (the
  stop token is part of the output);
- ``logprobs``, ``prompt_logprobs`` in [0, 20]: the raw logprob (log_softmax of the model's logits, before
  any control) of every generated (prompt) token with that many top alternatives;
- ``grammar`` (``batching.grammar``): the generated text follows it.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Tuple

from ..errors import PayloadError

CONTROL_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p",
                  "min_tokens", "ignore_eos", "stop_token_ids", "logprobs", "prompt_logprobs", "grammar")
MAX_LOGPROBS = 20


def _number(data: Mapping[str, Any], name: str, lo: float, hi: float, lo_open: bool = False) -> Optional[float]:
    v = data.get(name)
    if v is None:
        return None
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v <= hi \
        and (v > lo if lo_open else v >= lo)
    if not ok:
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise PayloadError(f"{name}={v!r}: must be a number in {bound}", name)
    return float(v)


def _int(data: Mapping[str, Any], name: str, lo: int, hi: Optional[int] = None) -> Optional[int]:
    v = data.get(name)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        raise PayloadError(f"{name}={v!r}: must be an int in [{lo}, {hi if hi is not None else 'inf'}]", name)
    return v


def _token_id(v: Any, name: str, vocab_size: Optional[int]) -> int:
    if isinstance(v, str):
        try:
            v = int(v.strip())
        except ValueError:
            raise PayloadError(f"{name}: token id {v!r} is not an integer", name) from None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or (vocab_size is not None and v >= vocab_size):
        raise PayloadError(f"{name}: token id {v!r} must be an int in [0, {vocab_size})", name)
    return v


def logit_bias(data: Mapping[str, Any], vocab_size: Optional[int]) -> Tuple[Tuple[int, float], ...]:
    bias = data.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, Mapping):
        raise PayloadError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}", "logit_bias")
    out: Dict[int, float] = {}
    for k, v in bias.items():
        tid = _token_id(k, "logit_bias", vocab_size)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not -100 <= v <= 100:
            raise PayloadError(f"logit_bias[{k!r}]={v!r}: must be a number in [-100, 100]", "logit_bias")
        out[tid] = float(v)
    return tuple(sorted(out.items()))


def stop_token_ids(data: Mapping[str, Any], vocab_size: Optional[int]) -> Tuple[int, ...]:
    ids = data.get("stop_token_ids")
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise PayloadError(f"stop_token_ids must be a list of token ids, got {type(ids).__name__}",
                           "stop_token_ids")
    return tuple(dict.fromkeys(_token_id(t, "stop_token_ids", vocab_size) for t in ids))


def check_controls(data: Mapping[str, Any], vocab_size: Optional[int], max_tokens: Any = None) -> None:
    """``PayloadError`` naming the first control field with a bad value (the grammar: ``batching.grammar``)."""
    _number(data, "presence_penalty", -2.0, 2.0)
    _number(data, "frequency_penalty", -2.0, 2.0)
    _number(data, "repetition_penalty", 0.0, math.inf, lo_open=True)
    _number(data, "min_p", 0.0, 1.0)
    n = _int(data, "min_tokens", 0)
    if n is not None and isinstance(max_tokens, int) and n > max_tokens:
        raise PayloadError(f"min_tokens={n}: must be at most max_tokens={max_tokens}", "min_tokens")
    v = data.get("ignore_eos")
    if v is not None and not isinstance(v, bool):
        raise PayloadError(f"ignore_eos={v!r}: must be true or false", "ignore_eos")
    _int(data, "logprobs", 0, MAX_LOGPROBS)
    _int(data, "prompt_logprobs", 0, MAX_LOGPROBS)
    logit_bias(data, vocab_size)
    stop_token_ids(data, vocab_size)


def asks_controls(data: Mapping[str, Any]) -> Optional[str]:
    """The first control field a request sets (not None, not off), or None."""
    for name in CONTROL_FIELDS:
        v = data.get(name)
        if v is not None and v is not False and not (name == "repetition_penalty" and v == 1) \
                and not (name in ("presence_penalty", "frequency_penalty", "min_p", "min_tokens") and v == 0):
            return name
    return None


def spec_fields(data: Mapping[str, Any], vocab_size: Optional[int]) -> Dict[str, Any]:
    """The ``SeqSpec`` keyword arguments of a checked request's controls (the grammar apart)."""
    def num(name, default):
        v = data.get(name)
        return default if v is None else type(default)(v)
    return {"presence_penalty": num("presence_penalty", 0.0), "frequency_penalty": num("frequency_penalty", 0.0),
            "repetition_penalty": num("repetition_penalty", 1.0), "logit_bias": logit_bias(data, vocab_size),
            "min_p": num("min_p", 0.0), "min_tokens": num("min_tokens", 0),
            "ignore_eos": bool(data.get("ignore_eos") or False),
            "stop_token_ids": stop_token_ids(data, vocab_size),
            "logprobs": data.get("logprobs"), "prompt_logprobs": data.get("prompt_logprobs")}


__all__ = ["CONTROL_FIELDS", "MAX_LOGPROBS", "check_controls", "asks_controls", "spec_fields"]
