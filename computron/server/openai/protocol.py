"""A completion or chat completion request, checked, and the engine requests it becomes. No I/O.

- ``parse_completion`` / ``parse_chat``: a ``/v1/completions`` or ``/v1/chat/completions`` body as
  ``CompletionParams`` (every known field checked, 400 naming it; unknown fields listed in ``unknown``
  for the route's ``FieldPolicy``). Chat's own fields (messages, tools, tool_choice) are ``chat.py``'s.
- ``prompts``: the prompt(s) of a completions request, each a string or token ids (a batch of prompts is
  a list of them); ``prompt_ids`` tokenizes one.
- ``engine_request``: what the engine is sent for one choice: the fields the request sets, then the
  model's generation_config.json defaults, then OpenAI's; ``choice_requests`` makes the ``n`` of a prompt
  (seed ``s + i`` for choice ``i``).

The engine's fields (``CONTRACT``: presence/frequency/repetition penalties, ``logit_bias``, ``min_p``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``logprobs``, ``prompt_logprobs``, ``grammar``) are sent
only when the request sets them, so a plain request is what it always was.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

from ...batching.generation import GenerationDefaults, fill
from ..errors import bad
from .fields import body_object, boolean, integer, is_int, model_field, number, obj, token_ids

if TYPE_CHECKING:
    from ..text import ModelText

MAX_LOGPROBS = 20
"""The most alternatives a token's logprobs may list (``logprobs``, ``top_logprobs``)."""

_QUIET = {"user", "metadata", "service_tier", "store", "prompt_cache_key", "safety_identifier"}
"""Fields that mean nothing here: accepted and ignored without a log line."""
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens",
           "ignore_eos", "stop_token_ids", "logprobs", "response_format", "keep_alive"} | _QUIET
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls", "chat_template_kwargs"}
_ENGINE_EXTRAS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p",
                  "min_tokens", "ignore_eos", "stop_token_ids")

Prompt = Union[str, List[int]]


@dataclass
class CompletionParams:
    """What a completion or chat completion request asks for, checked."""
    model: str
    chat: bool
    max_tokens: Optional[int]
    """None: unset (the model's generation_config.json default, else the route's)."""
    temperature: Optional[float]
    """None: unset (the model's generation_config.json default, else OpenAI's 1)."""
    top_p: Optional[float]
    top_k: Optional[int]
    seed: Optional[int]
    stop: List[str]
    stream: bool
    include_usage: bool
    n: int = 1
    echo: bool = False
    logprobs: Optional[int] = None
    """Alternatives per generated token (completions' ``logprobs``, chat's ``top_logprobs``); None: none."""
    extras: Dict[str, Any] = field(default_factory=dict)
    """The engine's sampling controls the request sets (penalties, bias, min_p, min_tokens, ...)."""
    grammar: Optional[Dict[str, Any]] = None
    """The engine's ``grammar`` (from ``response_format``; chat's forced tool calls set their own)."""
    prompt: Any = field(default=None, repr=False)
    """The raw ``prompt`` (completions) or ``messages`` (chat)."""
    unknown: List[str] = field(default_factory=list)
    """The body's fields this route does not know (ignored, or refused in strict mode)."""

    @property
    def stop_token_ids(self) -> List[int]:
        return list(self.extras.get("stop_token_ids") or [])


def parse_completion(body: Any, max_n: int = 16) -> CompletionParams:
    return _parse(body, chat=False, max_n=max_n)


def parse_chat(body: Any, max_n: int = 16) -> CompletionParams:
    return _parse(body, chat=True, max_n=max_n)


def _parse(body: Any, chat: bool, max_n: int) -> CompletionParams:
    body = body_object(body)
    model = model_field(body)
    unknown = sorted(set(body) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))
    n = integer(body, "n", 1)
    n = 1 if n is None else n
    if n > max_n:
        raise bad("n", f"n={n}: above this server's maximum of {max_n} choices per prompt (server.max_n)")
    echo = False if chat else boolean(body, "echo")
    max_tokens = integer(body, "max_tokens", 0 if echo else 1)
    if max_tokens is None and chat:
        max_tokens = integer(body, "max_completion_tokens", 1)
    seed = body.get("seed")
    if seed is not None and (not is_int(seed) or seed < 0 or seed + n > 2 ** 63):
        raise bad("seed", f"seed={seed!r}: must be an integer in [0, 2**63)")
    stream = boolean(body, "stream")
    so = obj(body, "stream_options") or {}
    if not chat:
        _defaults_only(body, n)
    p = CompletionParams(
        model=model, chat=chat, max_tokens=max_tokens, temperature=number(body, "temperature", 0, 2),
        top_p=number(body, "top_p", 0, 1, lo_open=True), top_k=integer(body, "top_k", 0), seed=seed,
        stop=_stop(body.get("stop")), stream=stream, include_usage=boolean(so, "include_usage"), n=n, echo=echo,
        logprobs=_logprobs(body, chat), extras=_extras(body, max_tokens), grammar=response_format(body),
        prompt=body.get("messages" if chat else "prompt"), unknown=unknown)
    return p


def _defaults_only(body: Dict[str, Any], n: int) -> None:
    """Completions' fields accepted only at values with no effect here."""
    if body.get("suffix") not in (None, ""):
        raise bad("suffix", "suffix: not supported (no insertion mode)")
    best_of = integer(body, "best_of", 1)
    if best_of is not None and best_of != n:
        raise bad("best_of", f"best_of={best_of}: only best_of equal to n ({n}) is supported")


def _stop(stop: Any) -> List[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise bad("stop", "stop: must be a string or a list of strings")


def _logprobs(body: Dict[str, Any], chat: bool) -> Optional[int]:
    """Alternatives per token: completions' ``logprobs: k``; chat's ``logprobs: true`` with ``top_logprobs``."""
    lp = body.get("logprobs")
    if not chat:
        if lp is None or lp is False:
            return None
        return integer(body, "logprobs", 0, MAX_LOGPROBS)
    on = boolean(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        integer(body, "top_logprobs", 0, MAX_LOGPROBS)
        if not on:
            raise bad("top_logprobs", "top_logprobs: needs logprobs: true")
    return (top or 0) if on else None


def _extras(body: Dict[str, Any], max_tokens: Optional[int]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        v = number(body, name, -2, 2)
        if v:
            out[name] = v
    rp = number(body, "repetition_penalty", 0, float("inf"), lo_open=True, hi_open=True)
    if rp is not None:  # 1 too: it overrides a generation_config.json default
        out["repetition_penalty"] = rp
    bias = body.get("logit_bias")
    if bias:
        out["logit_bias"] = _logit_bias(bias)
    min_p = number(body, "min_p", 0, 1)
    if min_p:
        out["min_p"] = min_p
    min_tokens = integer(body, "min_tokens", 0)
    if min_tokens:
        if max_tokens is not None and min_tokens > max_tokens:
            raise bad("min_tokens", f"min_tokens={min_tokens}: above max_tokens={max_tokens}")
        out["min_tokens"] = min_tokens
    if boolean(body, "ignore_eos"):
        out["ignore_eos"] = True
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(is_int(t) and t >= 0 for t in stop_ids):
            raise bad("stop_token_ids", "stop_token_ids: must be a list of token ids (integers >= 0)")
        if stop_ids:
            out["stop_token_ids"] = list(stop_ids)
    return out


def _logit_bias(bias: Any) -> Dict[int, float]:
    if not isinstance(bias, dict):
        raise bad("logit_bias", "logit_bias: must be an object mapping token ids to numbers in [-100, 100]")
    out = {}
    for k, v in bias.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            tok = -1
        if tok < 0 or (isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100):
            raise bad("logit_bias", f"logit_bias[{k!r}]={v!r}: keys must be token ids, values numbers in [-100, 100]")
        out[tok] = float(v)
    return out


def response_format(body: Dict[str, Any], name: str = "response_format") -> Optional[Dict[str, Any]]:
    """The engine's ``grammar`` of a ``response_format`` (``text``: None), 400 naming it when malformed."""
    rf = body.get(name)
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if isinstance(js, dict) and "schema" not in js and "name" not in js:
            js = None
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise bad(name, f"{name}: json_schema needs an object json_schema.schema (the JSON schema)")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad(name, f"{name}: json_schema.strict must be true or false")
        return {"type": "json_schema", "schema": schema, "strict": bool(strict)}
    raise bad(name, f"{name}: type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


# ---- prompts --------------------------------------------------------------------------------------------

def prompts(p: CompletionParams) -> List[Prompt]:
    """The prompts of a completions request: one string, one list of token ids, or a batch of either."""
    prompt = p.prompt
    if prompt is None:
        raise bad("prompt", "prompt: required")
    if isinstance(prompt, str) or token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(x, str) or token_ids(x) for x in prompt):
        return list(prompt)
    raise bad("prompt", "prompt: must be a string, a list of token ids, or a non-empty list of either")


def prompt_ids(text: ModelText, prompt: Prompt) -> List[int]:
    """A prompt's token ids (a string tokenized with the model's special tokens)."""
    return text.encode(prompt) if isinstance(prompt, str) else list(prompt)


def engine_field_names(body: Any, chat: bool) -> Dict[str, str]:
    """The request's names of the engine's fields (``input_ids`` is the prompt or the messages), for the
    ``param`` of an error the engine raised."""
    names = {"input_ids": "messages" if chat else "prompt", "grammar": "response_format",
             "prompt_logprobs": "logprobs"}
    if chat:
        names["logprobs"] = "top_logprobs"
    if chat and isinstance(body, dict) and body.get("max_tokens") is None and "max_completion_tokens" in body:
        names["max_tokens"] = "max_completion_tokens"
    if chat and isinstance(body, dict) and body.get("tool_choice") not in (None, "auto", "none") \
            and body.get("response_format") is None:
        names["grammar"] = "tool_choice"
    return names


def engine_request(p: CompletionParams, ids: List[int], default_max: int, max_positions: Optional[int],
                   generation: Optional[GenerationDefaults] = None) -> Dict[str, Any]:
    """The engine's generation request for one choice: the fields the request sets; those it leaves unset from
    the model's ``generation`` defaults (its generation_config.json), else OpenAI's (``temperature`` 1;
    ``max_tokens`` ``default_max``); a default ``max_tokens`` is capped by the positions the prompt leaves.
    ``max_tokens: 0`` (echo only: the prompt scored) asks the engine for one token, which is not answered."""
    data: Dict[str, Any] = {"input_ids": ids}
    data.update({k: getattr(p, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "seed")
                 if getattr(p, k) is not None})
    if data.get("max_tokens") == 0:
        data["max_tokens"] = 1
    data.update(p.extras)
    data = dict(fill(data, generation, len(ids), max_positions))
    data.setdefault("temperature", 1.0)  # OpenAI's default: sampling at temperature 1
    if "max_tokens" not in data:
        data["max_tokens"] = default_max if max_positions is None else max(1, min(default_max,
                                                                                   max_positions - len(ids)))
    if p.logprobs is not None:
        data["logprobs"] = p.logprobs
    if p.echo and p.logprobs is not None:
        data["prompt_logprobs"] = p.logprobs
    if p.grammar is not None:
        data["grammar"] = p.grammar
    return data


def choice_requests(data: Dict[str, Any], n: int) -> List[Dict[str, Any]]:
    """The ``n`` engine requests of one prompt: the same request, seed ``s + i`` for choice ``i``."""
    out = []
    for i in range(n):
        d = dict(data)
        if i and d.get("seed") is not None:
            d["seed"] = d["seed"] + i
        out.append(d)
    return out


def usage(n_prompt: int, n_generated: int) -> Dict[str, int]:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_generated, "total_tokens": n_prompt + n_generated}
