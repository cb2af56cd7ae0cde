"""OpenAI's Responses API (``POST /v1/responses``), stateless: the request as a chat, the answer as output
items, whole or as the Responses stream events. No I/O.

- ``parse_responses``: ``input`` (a string, or a list of messages and items: ``message``, ``function_call``,
  ``function_call_output``; ``reasoning`` items are skipped), ``instructions`` (a system message first),
  function ``tools`` in the Responses shape (``{type, name, description, parameters}``), ``tool_choice``,
  ``parallel_tool_calls``, ``max_output_tokens``, ``temperature``, ``top_p``, ``text.format`` (``text``,
  ``json_object``, ``json_schema``): chat messages, ``ChatTools`` and ``CompletionParams``.
  ``previous_response_id`` answers 400 (nothing is stored).
- ``ResponseBuilder``: the ``response`` object and its output items (a ``message`` with ``output_text``,
  a ``function_call`` per tool call) whole, or as events: ``response.created``, ``response.in_progress``,
  then per item ``response.output_item.added``, (text) ``response.content_part.added``,
  ``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done`` or
  (call) ``response.function_call_arguments.delta`` / ``.done``, then ``response.output_item.done``;
  ``response.completed`` last. Each event has its ``sequence_number``.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

from ..errors import bad
from .answer import Answer
from .chat import ChatTools, chat_messages, content_text, parse_tools
from .choices import ChoiceRun
from .fields import body_object, boolean, integer, model_field, number, obj
from .protocol import CompletionParams, response_format
from .tool_parsers import ToolCall, ToolCallParser

RESPONSES_FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
                    "max_output_tokens", "temperature", "top_p", "text", "stream", "store", "metadata", "user",
                    "service_tier", "reasoning", "include", "truncation", "previous_response_id", "top_logprobs",
                    "stream_options", "prompt_cache_key", "safety_identifier", "background", "max_tool_calls"}
"""The fields ``/v1/responses`` knows (the engine-free ones accepted and ignored)."""


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _input_messages(inp: Any, instructions: Optional[str]) -> List[Dict[str, Any]]:
    """``input`` as Chat Completions' messages."""
    out: List[Dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(inp, str):
        return out + [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise bad("input", "input: must be a string or a non-empty list of messages and items")
    for i, item in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, f"{where}: must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": content_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str):
                raise bad(where, f"{where}: a function_call needs name, arguments and call_id")
            call = {"id": item.get("call_id") or item.get("id") or _new_id("call"), "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else content_text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise bad(f"{where}.type", f"{where}.type={kind!r}: not supported (message, function_call, "
                                       "function_call_output)")
    return out


def _tools(body: Dict[str, Any]) -> ChatTools:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise bad("tools", "tools: must be a list of function tools")
    chat_tools = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise bad(f"tools[{i}]", f"tools[{i}]: only function tools ({{type: 'function', name, parameters}}) "
                                     "are supported")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        chat_tools.append({"type": "function", "function": fn})
    return parse_tools({"tools": chat_tools, "tool_choice": body.get("tool_choice"),
                        "parallel_tool_calls": body.get("parallel_tool_calls")})


def parse_responses(body: Any) -> Tuple[CompletionParams, List[Dict[str, Any]], ChatTools]:
    body = body_object(body)
    model = model_field(body)
    if body.get("previous_response_id") is not None:
        raise bad("previous_response_id", "previous_response_id: this server stores no responses; send the "
                                          "whole conversation in input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", "instructions: must be a string")
    messages = chat_messages(_input_messages(body.get("input"), instructions))
    fmt = (obj(body, "text") or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad("text.format", "text.format: must be an object ({type: text | json_object | json_schema})")
    grammar = responses_format(fmt) if fmt else None
    p = CompletionParams(model=model, chat=True, max_tokens=integer(body, "max_output_tokens", 1),
                         temperature=number(body, "temperature", 0, 2),
                         top_p=number(body, "top_p", 0, 1, lo_open=True), top_k=None, seed=None, stop=[],
                         stream=boolean(body, "stream"), include_usage=False, grammar=grammar, prompt=messages,
                         unknown=sorted(set(body) - RESPONSES_FIELDS))
    return p, messages, _tools(body)


def responses_format(fmt: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """``text.format`` in the Responses shape (``{type: json_schema, name, schema, strict}``) as the engine's
    grammar."""
    if fmt.get("type") == "json_schema" and "json_schema" not in fmt:
        fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return response_format({"text.format": fmt}, "text.format")


class ResponseBuilder:
    """One response's objects and events."""

    def __init__(self, p: CompletionParams, body: Dict[str, Any], tools: ChatTools, parser: ToolCallParser,
                 tok):
        self.p, self.tools, self.parser = p, tools, parser
        self.answer = Answer(p.model, True, tok, tools, parser)
        self.id = _new_id("resp")
        self.created = time.time()
        self.seq = 0
        self.output: List[Dict[str, Any]] = []
        self._open: Optional[Dict[str, Any]] = None
        self._stream = parser.stream() if tools.parsed and not tools.forced else None
        self._held = ""
        self._echo = {"instructions": body.get("instructions"), "metadata": body.get("metadata"),
                      "max_output_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
                      "parallel_tool_calls": tools.parallel, "text": body.get("text") or {"format": {"type": "text"}},
                      "tool_choice": _choice_echo(tools),
                      "tools": [{"type": "function", **t["function"], "strict": False} for t in tools.tools]}

    def response(self, status: str, run: Optional[ChoiceRun] = None) -> Dict[str, Any]:
        out: Dict[str, Any] = {"id": self.id, "object": "response", "created_at": self.created, "model": self.p.model,
                               "status": status, "output": list(self.output), "error": None,
                               "incomplete_details": None, **self._echo}
        if run is not None:
            out["usage"] = {"input_tokens": run.n_prompt, "input_tokens_details": {"cached_tokens": 0},
                            "output_tokens": run.n_generated, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": run.n_prompt + run.n_generated}
            if status == "incomplete":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    @staticmethod
    def _message(text: str, status: str) -> Dict[str, Any]:
        return {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _call(c: ToolCall) -> Dict[str, Any]:
        return {"id": _new_id("fc"), "type": "function_call", "call_id": c.id, "name": c.name,
                "arguments": c.arguments, "status": "completed"}

    def _status(self, run: ChoiceRun) -> str:
        return "incomplete" if run.finish_reason() == "length" and not any(
            o["type"] == "function_call" for o in self.output) else "completed"

    def whole(self, run: ChoiceRun) -> Dict[str, Any]:
        content, calls = self.answer.split_calls(run.body_text)
        if content:
            self.output.append(self._message(content, "completed"))
        self.output += [self._call(c) for c in calls]
        return self.response(self._status(run), run)

    # ---- events --------------------------------------------------------------------------------------
    def _ev(self, kind: str, **fields: Any) -> Dict[str, Any]:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return e

    def start(self) -> List[Dict[str, Any]]:
        return [self._ev("response.created", response=self.response("in_progress")),
                self._ev("response.in_progress", response=self.response("in_progress"))]

    def _text(self, text: str) -> List[Dict[str, Any]]:
        out = []
        if self._open is None:
            item = {**self._message("", "in_progress"), "content": []}
            self._open = {"item": item, "index": len(self.output), "text": ""}
            self.output.append(item)
            out += [self._ev("response.output_item.added", output_index=self._open["index"], item=dict(item)),
                    self._ev("response.content_part.added", item_id=item["id"], output_index=self._open["index"],
                             content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                    "logprobs": []})]
        self._open["text"] += text
        out.append(self._ev("response.output_text.delta", item_id=self._open["item"]["id"],
                            output_index=self._open["index"], content_index=0, delta=text, logprobs=[]))
        return out

    def _close_text(self) -> List[Dict[str, Any]]:
        if self._open is None:
            return []
        o, self._open = self._open, None
        item, i, text = o["item"], o["index"], o["text"]
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item.update(status="completed", content=[part])
        return [self._ev("response.output_text.done", item_id=item["id"], output_index=i, content_index=0, text=text,
                         logprobs=[]),
                self._ev("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part),
                self._ev("response.output_item.done", output_index=i, item=dict(item))]

    def _call_events(self, c: ToolCall) -> List[Dict[str, Any]]:
        out = self._close_text()
        item = self._call(c)
        i = len(self.output)
        self.output.append(item)
        out += [self._ev("response.output_item.added", output_index=i,
                         item={**item, "arguments": "", "status": "in_progress"}),
                self._ev("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                         delta=c.arguments),
                self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                         arguments=c.arguments),
                self._ev("response.output_item.done", output_index=i, item=dict(item))]
        return out

    def _events_of(self, parts: List[Any]) -> List[Dict[str, Any]]:
        out = []
        for e in parts:
            out += self._call_events(e) if isinstance(e, ToolCall) else (self._text(e) if e else [])
        return out

    def feed(self, text: str) -> List[Dict[str, Any]]:
        if not text:
            return []
        if self.tools.forced:
            self._held += text
            return []
        return self._events_of(self._stream.push(text) if self._stream else [text])

    def finish(self, run: ChoiceRun, text: str) -> List[Dict[str, Any]]:
        out = self.feed(text)
        if self.tools.forced:
            content, calls = self.answer.split_calls(self._held)
            out += self._events_of(list(calls) if calls else [content or ""])
        elif self._stream is not None:
            out += self._events_of(self._stream.finish())
        out += self._close_text()
        status = self._status(run)
        # response.completed even when incomplete (cut by max_output_tokens): the clients wait for it
        return out + [self._ev("response.completed", response=self.response(status, run))]


def _choice_echo(tools: ChatTools) -> Any:
    if tools.choice == "function":
        return {"type": "function", "name": tools.named}
    return tools.choice if tools.tools else "auto"
