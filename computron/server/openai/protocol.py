"""OpenAI's request and answer shapes: parsing and building, no I/O.

- ``parse_completion`` / ``parse_chat``: a ``/v1/completions`` or ``/v1/chat/completions`` body as
  ``CompletionParams`` (every field checked, 400 naming it); ``prompt_ids`` turns its prompt or
  messages into token ids once the model's tokenizer is known; ``engine_request`` is what the engine
  is sent: the fields the request sets, then the model's generation_config.json defaults, then OpenAI's.
- ``Answer``: the completion, chunk and usage objects of one answer.
- ``parse_embeddings`` / ``embedding_data``: ``/v1/embeddings`` for embedding models.

Fields are accepted with their effect (``_COMMON`` and the endpoint's own), or only at their OpenAI
default, without effect (``_DEFAULT_ONLY``); anything else answers 400 naming the field.
"""
from __future__ import annotations

import base64
import struct
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from ...batching.generation import GenerationDefaults, fill
from ..errors import bad

if TYPE_CHECKING:
    from ..text import ModelText
    from ..building import UnderstandingModel

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
           "user", "n"}
_COMPLETION_FIELDS = _COMMON | {"prompt"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"}
_DEFAULT_ONLY = {
    "echo": (False,), "logprobs": (None, False), "top_logprobs": (None, 0), "presence_penalty": (0,),
    "frequency_penalty": (0,), "logit_bias": (None, {}), "best_of": (1,), "suffix": (None,), "tools": (None, []),
    "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None,),
    "service_tier": (None, "auto", "default"), "store": (None, False), "metadata": (None, {}),
}
_EMBEDDING_FIELDS = {"model", "input", "encoding_format", "user", "dimensions"}

_MISSING = object()


def _number(body, name, lo, hi, lo_open=False):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v > hi or v < lo or (lo_open and v == lo):
        raise bad(name, f"{name}={v!r}: must be a number in {'(' if lo_open else '['}{lo}, {hi}]")
    return float(v)


def _int(body, name, lo):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise bad(name, f"{name}={v!r}: must be an integer >= {lo}")
    return v


def model_field(body: Any) -> str:
    """The ``model`` of a request body, which must be a JSON object."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model: a model id (string) is required")
    return model


@dataclass
class CompletionParams:
    """What a completion or chat completion request asks for, checked."""
    model: str
    chat: bool
    max_tokens: Optional[int]
    temperature: Optional[float]
    """None: unset (the model's generation_config.json default, else OpenAI's 1)."""
    top_p: Optional[float]
    top_k: Optional[int]
    seed: Optional[int]
    stop: List[str]
    stream: bool
    include_usage: bool
    prompt: Any = field(default=_MISSING, repr=False)
    """The raw ``prompt`` (completions) or ``messages`` (chat), checked by ``prompt_ids``."""


def parse_completion(body: Any) -> CompletionParams:
    return _parse(body, chat=False)


def parse_chat(body: Any) -> CompletionParams:
    return _parse(body, chat=True)


def _parse(body: Any, chat: bool) -> CompletionParams:
    allowed = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    for k, v in body.items():
        if k in allowed:
            continue
        if k in _DEFAULT_ONLY:
            if v in _DEFAULT_ONLY[k]:
                continue
            raise bad(k, f"{k}={v!r} is not supported by this server")
        raise bad(k, f"unsupported field {k!r}")
    model = model_field(body)
    n = body.get("n")
    if n is not None and n != 1:
        raise bad("n", f"n={n!r}: only n=1 is supported")
    max_tokens = _int(body, "max_tokens", 1)
    if max_tokens is None and chat:
        max_tokens = _int(body, "max_completion_tokens", 1)
    temperature = _number(body, "temperature", 0, 2)
    top_p, top_k = _number(body, "top_p", 0, 1, lo_open=True), _int(body, "top_k", 0)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad("seed", f"seed={seed!r}: must be an integer")
    stop = _stop(body.get("stop"))
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("stream", f"stream={stream!r}: must be true or false")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise bad("stream_options", "stream_options: must be an object")
    return CompletionParams(
        model=model, chat=chat, max_tokens=max_tokens,
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop, stream=stream,
        include_usage=bool((so or {}).get("include_usage", False)),
        prompt=body.get("messages" if chat else "prompt", _MISSING))


def _stop(stop: Any) -> List[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise bad("stop", "stop: must be a string or a list of at most 4 strings")


def prompt_ids(text: ModelText, p: CompletionParams) -> List[int]:
    """The prompt's token ids: the chat template applied to the messages, or the prompt tokenized."""
    if p.chat:
        return text.chat_ids(_messages(None if p.prompt is _MISSING else p.prompt))
    prompt = p.prompt
    if prompt is _MISSING:
        raise bad("prompt", "prompt: required")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return text.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad("prompt", "prompt: one prompt per request (a batch of prompts is not supported)")
    raise bad("prompt", "prompt: must be a non-empty string or a list of token ids")


def _messages(messages: Any) -> List[Dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages: must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", f"messages[{i}]: must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content", f"messages[{i}].content: only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", f"messages[{i}].content: must be a string")
        out.append({"role": m["role"], "content": content})
    return out


def engine_field_names(body: Any, chat: bool) -> Dict[str, str]:
    """The request's names of the engine's fields (``input_ids`` is the prompt or the messages), for the
    ``param`` of an error the engine raised."""
    names = {"input_ids": "messages" if chat else "prompt"}
    if chat and isinstance(body, dict) and body.get("max_tokens") is None and "max_completion_tokens" in body:
        names["max_tokens"] = "max_completion_tokens"
    return names


def engine_request(p: CompletionParams, ids: List[int], default_max: int, max_positions: Optional[int],
                   generation: Optional[GenerationDefaults] = None) -> Dict[str, Any]:
    """The engine's generation request: the fields the request sets; those it leaves unset from the model's
    ``generation`` defaults (its generation_config.json), else OpenAI's (``temperature`` 1; ``max_tokens``
    ``default_max``); a default ``max_tokens`` is capped by the positions the prompt leaves."""
    data: Dict[str, Any] = {"input_ids": ids}
    data.update({k: getattr(p, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "seed")
                 if getattr(p, k) is not None})
    data = dict(fill(data, generation, len(ids), max_positions))
    data.setdefault("temperature", 1.0)  # OpenAI's default: sampling at temperature 1
    if "max_tokens" not in data:
        data["max_tokens"] = default_max if max_positions is None else max(1, min(default_max,
                                                                                   max_positions - len(ids)))
    return data


def usage(n_prompt: int, n_generated: int) -> Dict[str, int]:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_generated, "total_tokens": n_prompt + n_generated}


class Answer:
    """The OpenAI objects of one answer (one id and creation time): whole, as stream chunks, usage."""

    def __init__(self, p: CompletionParams):
        self.chat, self.model = p.chat, p.model
        self.id = ("chatcmpl-" if p.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _head(self, obj: str) -> Dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, reason: str, counts: Dict[str, int]) -> Dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": counts}

    def _chunk_head(self) -> Dict[str, Any]:
        return self._head("chat.completion.chunk" if self.chat else "text_completion")

    def chunk(self, piece: Optional[str], reason: Optional[str] = None, role: bool = False) -> Dict[str, Any]:
        """A stream chunk: a piece of text, the finish reason, or (chat) the assistant's role first."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": piece} if piece else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": reason}
        return {**self._chunk_head(), "choices": [choice]}

    def usage_chunk(self, counts: Dict[str, int]) -> Dict[str, Any]:
        return {**self._chunk_head(), "choices": [], "usage": counts}


# ---- /v1/embeddings ---------------------------------------------------------------------------------

def parse_embeddings(model: UnderstandingModel, body: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], str]:
    """OpenAI's embeddings request as (engine requests, encoding format); 400 naming the field at fault.
    The engine checks and tokenizes each row (``PayloadError`` naming its row)."""
    for k in body:
        if k not in _EMBEDDING_FIELDS:
            raise bad(k, f"unsupported field {k!r}")
    dims = body.get("dimensions")
    if dims is not None and dims != model.hidden_size:
        raise bad("dimensions", f"dimensions={dims!r}: model {model.id!r} answers {model.hidden_size} "
                                "dimensions only")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad("encoding_format", f"encoding_format={fmt!r}: must be 'float' or 'base64'")
    inp = body.get("input")

    def is_ids(x):
        return isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    if isinstance(inp, str) or is_ids(inp):
        items = [inp]
    elif isinstance(inp, list) and inp and all(isinstance(x, str) or is_ids(x) for x in inp):
        items = inp
    else:
        raise bad("input", "input: must be a non-empty string, a list of strings, a list of token ids "
                           "or a list of lists of token ids")
    rows = []
    for i, x in enumerate(items):
        if isinstance(x, str):
            if not x:
                raise bad("input", f"input[{i}]: an empty string")
            rows.append({"text": x})
        else:
            rows.append({"input_ids": list(x)})
    return rows, fmt


def embedding_data(vectors: List[List[float]], fmt: str) -> List[Dict[str, Any]]:
    out = []
    for i, v in enumerate(vectors):
        emb: Any = v
        if fmt == "base64":  # little-endian float32, as OpenAI sends them
            emb = base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
        out.append({"object": "embedding", "index": i, "embedding": emb})
    return out
