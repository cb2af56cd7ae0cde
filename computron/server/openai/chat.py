"""Chat's own fields: the messages (as HF chat templates expect them), tools, tool_choice, template kwargs.

- ``chat_messages``: OpenAI's messages normalized for ``apply_chat_template``: text content parts joined,
  ``developer`` as ``system``, an assistant's ``content: null`` with ``tool_calls`` (their ``arguments``
  as objects, which templates dump themselves), ``tool`` messages with their ``tool_call_id`` (and the
  called function's ``name``, which some templates print).
- ``parse_tools``: ``tools`` (function tools), ``tool_choice`` (``auto``, ``none``, ``required``, or one
  named function: 400 naming ``tool_choice`` when it is not in ``tools``) and ``parallel_tool_calls``, as
  ``ChatTools``: the tools the template renders, and for ``required`` / a named function the ``grammar``
  that forces the answer into a call (vLLM's way: a JSON array of ``{name, parameters}`` objects, or the
  named function's arguments object), read back by ``forced_calls``.
- ``template_kwargs``: ``chat_template_kwargs``, passed to ``apply_chat_template``.

Pure Python.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..errors import bad
from .fields import boolean
from .tool_parsers import ToolCall, arguments_text, call_of

_TEXT_PARTS = ("text", "input_text", "output_text")
_RESERVED_KWARGS = {"conversation", "messages", "tools", "tokenize", "return_dict", "return_tensors"}


def content_text(content: Any, where: str, allow_null: bool = False) -> Optional[str]:
    """A message's content as text: a string, or text parts joined; None where ``allow_null``."""
    if content is None and allow_null:
        return None
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"),
                                                                                                   str):
                raise bad(where, f"{where}: only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    if not isinstance(content, str):
        raise bad(where, f"{where}: must be a string or a list of text parts")
    return content


def _tool_calls(calls: Any, where: str) -> List[Dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad(where, f"{where}: must be a list of tool calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{where}[{j}]", f"{where}[{j}]: must be {{id, type: 'function', function: {{name, arguments}}}}")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except ValueError:
                raise bad(f"{where}[{j}].function.arguments", f"{where}[{j}].function.arguments: not JSON") from None
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


def chat_messages(messages: Any) -> List[Dict[str, Any]]:
    """OpenAI's ``messages`` as HF chat templates take them; 400 naming the message at fault."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages: must be a non-empty list of {role, content}")
    out, names = [], {}
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(where, f"{where}: must be an object with a string role")
        role = "system" if m["role"] == "developer" else m["role"]
        has_calls = role == "assistant" and m.get("tool_calls")
        content = content_text(m.get("content"), f"{where}.content", allow_null=role == "assistant")
        msg: Dict[str, Any] = {"role": role, "content": content if content is not None else ""}
        if has_calls:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
            for c in msg["tool_calls"]:
                if "id" in c:
                    names[c["id"]] = c["function"]["name"]
        elif content is None:
            raise bad(f"{where}.content", f"{where}.content: null only with tool_calls")
        if role == "tool":
            tid = m.get("tool_call_id")
            if tid is not None and not isinstance(tid, str):
                raise bad(f"{where}.tool_call_id", f"{where}.tool_call_id: must be a string")
            if tid is not None:
                msg["tool_call_id"] = tid
            name = m.get("name") or names.get(tid)
            if name:
                msg["name"] = name
        elif isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def template_kwargs(body: Dict[str, Any]) -> Dict[str, Any]:
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return {}
    if not isinstance(kw, dict):
        raise bad("chat_template_kwargs", "chat_template_kwargs: must be an object")
    reserved = sorted(set(kw) & _RESERVED_KWARGS)
    if reserved:
        raise bad("chat_template_kwargs", f"chat_template_kwargs.{reserved[0]}: set by the server, not the request")
    return dict(kw)


@dataclass
class ChatTools:
    """A chat request's tools and what it asks of them."""
    tools: List[Dict[str, Any]] = field(default_factory=list)
    choice: str = "none"
    """``auto``, ``none``, ``required`` or ``function`` (one named function)."""
    named: Optional[str] = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def parsed(self) -> bool:
        """Whether the answer is read for tool calls (by the model's parser, or as the forced JSON)."""
        return bool(self.tools) and self.choice != "none"

    def template_tools(self) -> Optional[List[Dict[str, Any]]]:
        """The tools the chat template renders (none for ``tool_choice: none``)."""
        return self.tools if self.tools and self.choice != "none" else None

    def _params(self, name: str) -> Dict[str, Any]:
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return fn.get("parameters") or {"type": "object", "properties": {}}

    def grammar(self) -> Optional[Dict[str, Any]]:
        """The engine's grammar forcing a call (``required``, a named function); None otherwise."""
        if self.choice == "function":
            return {"type": "json_schema", "schema": self._params(self.named), "strict": True}
        if self.choice != "required":
            return None
        one = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                 "parameters": self._params(t["function"]["name"])},
                "required": ["name", "parameters"]} for t in self.tools]
        schema: Dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": one[0] if len(one) == 1 else {"anyOf": one}}
        if not self.parallel:
            schema["maxItems"] = 1
        return {"type": "json_schema", "schema": schema, "strict": True}


def parse_tools(body: Dict[str, Any], name: str = "tools", choice_name: str = "tool_choice") -> ChatTools:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked (Chat Completions' shapes)."""
    tools = body.get(name)
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise bad(name, f"{name}: must be a list of function tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"{name}[{i}]", f"{name}[{i}]: must be {{type: 'function', function: {{name, description, "
                                      "parameters}}}} (only function tools are supported)")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad(f"{name}[{i}].function.parameters", f"{name}[{i}].function.parameters: must be a JSON schema")
    names = [t["function"]["name"] for t in tools]
    parallel = boolean(body, "parallel_tool_calls", True)
    choice = body.get(choice_name)
    named = None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        named = fn.get("name") if isinstance(fn, dict) else choice.get("name")  # Responses: {type, name}
        if choice.get("type") != "function" or not isinstance(named, str):
            raise bad(choice_name, f"{choice_name}: must be 'auto', 'none', 'required' or "
                                   "{type: 'function', function: {name}}")
        if named not in names:
            raise bad(choice_name, f"{choice_name}: function {named!r} is not in {name} ({', '.join(names) or 'none'})")
        choice = "function"
    elif choice not in ("auto", "none", "required"):
        raise bad(choice_name, f"{choice_name}={choice!r}: must be 'auto', 'none', 'required' or a named function")
    if choice == "required" and not tools:
        raise bad(choice_name, f"{choice_name}: 'required' needs {name}")
    return ChatTools([{"type": "function", "function": t["function"]} for t in tools], choice, named, parallel)


def forced_calls(text: str, tools: ChatTools) -> Optional[List[ToolCall]]:
    """The calls of an answer the grammar forced (``required``, a named function); None when it does not parse
    (the answer was cut by ``max_tokens``)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if tools.choice == "function":
        args = arguments_text(value)
        return None if args is None else [ToolCall(tools.named, args)]
    if not isinstance(value, list):
        return None
    calls = [call_of(v, ("parameters", "arguments")) for v in value]
    return None if not calls or any(c is None for c in calls) else calls
