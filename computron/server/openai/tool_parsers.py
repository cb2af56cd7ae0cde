"""Tool calls in a model's answer: pluggable parsers, whole and streamed. Pure Python.

Each ``ToolCallParser`` reads the format a family of chat templates teaches its models:

- ``hermes`` (alias ``qwen``): Hermes, Qwen 2.5/3, SmolLM2 and most tool-tuned models:
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them, text around them;
- ``llama3_json`` (alias ``llama3``): Llama 3.1-3.3's JSON tool calls, the whole answer
  ``{"name": ..., "parameters": {...}}`` (``<|python_tag|>`` first, several joined by ``;``).

``parse(text)`` splits a whole answer into its content and its calls; ``stream()`` returns a ``ToolStream``
that takes the answer's text a piece at a time and says what may be sent: content pieces (text that could
still begin a call is held back) and each call once its text is complete. Text that looks like a call but
does not parse stays content. A model's parser is its config's ``tool_call_parser``, else ``detect``'s
reading of its chat template, else ``hermes``.
"""
from __future__ import annotations

import abc
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text (what OpenAI's ``function.arguments`` holds)."""
    id: str = field(default_factory=call_id)

    def openai(self, index: Optional[int] = None) -> Dict[str, Any]:
        """As ``message.tool_calls[i]`` (with ``index``: as a streamed delta's ``tool_calls[i]``)."""
        out: Dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


Event = Union[str, ToolCall]
"""What a ``ToolStream`` lets out: a piece of content, or a complete call."""


def arguments_text(args: Any) -> Optional[str]:
    """A call's arguments as JSON text: an object dumped, a string holding JSON kept; None otherwise."""
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    if isinstance(args, str):
        try:
            return args if isinstance(json.loads(args), dict) else None
        except ValueError:
            return None
    return None


def call_of(obj: Any, keys: Tuple[str, ...] = ("arguments", "parameters")) -> Optional[ToolCall]:
    """A ``{"name": ..., "arguments"|"parameters": {...}}`` object as a ToolCall (None if it is not one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    text = arguments_text(args)
    return None if text is None else ToolCall(obj["name"], text)


class ToolStream(abc.ABC):
    """One answer's text, a piece at a time: ``push`` returns the events it completes, ``finish`` the rest."""

    @abc.abstractmethod
    def push(self, piece: str) -> List[Event]:
        """The events ``piece`` completes (text to show, finished tool calls)."""

    @abc.abstractmethod
    def finish(self) -> List[Event]:
        """The events left when the answer ends."""


class ToolCallParser(abc.ABC):
    name = ""

    @abc.abstractmethod
    def parse(self, text: str) -> Tuple[str, List[ToolCall]]:
        """(content, calls) of a whole answer."""

    @abc.abstractmethod
    def stream(self) -> ToolStream:
        """A parser of one answer streamed a piece at a time."""


def _joined(events: List[Event]) -> Tuple[str, List[ToolCall]]:
    content = "".join(e for e in events if isinstance(e, str))
    calls = [e for e in events if isinstance(e, ToolCall)]
    return (content.strip() if calls else content), calls


# ---- Hermes / Qwen: <tool_call>{json}</tool_call> -------------------------------------------------------

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _hermes_call(body: str) -> Optional[ToolCall]:
    try:
        return call_of(json.loads(body.strip()))
    except ValueError:
        return None


class HermesParser(ToolCallParser):
    name = "hermes"

    def parse(self, text: str) -> Tuple[str, List[ToolCall]]:
        s = self.stream()
        return _joined(s.push(text) + s.finish())

    def stream(self) -> ToolStream:
        return _HermesStream()


class _HermesStream(ToolStream):
    def __init__(self):
        self.buf = ""
        self.in_call = False
        self.calls = 0
        self.blank = ""
        """Whitespace held back: sent only when content follows it (none around calls)."""

    def push(self, piece: str) -> List[Event]:
        self.buf += piece
        out: List[Event] = []
        while True:
            if self.in_call:
                end = self.buf.find(_CLOSE)
                if end < 0:
                    return out
                body, self.buf, self.in_call = self.buf[:end], self.buf[end + len(_CLOSE):], False
                call = _hermes_call(body)
                self.calls += call is not None
                out += [call] if call else self._content(_OPEN + body + _CLOSE)
                continue
            start = self.buf.find(_OPEN)
            if start >= 0:
                out += self._content(self.buf[:start])
                self.buf, self.in_call = self.buf[start + len(_OPEN):], True
                self.blank = ""
                continue
            keep = _partial_suffix(self.buf, _OPEN)
            out += self._content(self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return out

    def _content(self, text: str) -> List[Event]:
        """Content to send, less the whitespace it ends with (held: sent only if more content follows)."""
        text = self.blank + text
        body = text.rstrip()
        self.blank = text[len(body):]
        return [body] if body else []

    def finish(self) -> List[Event]:
        if self.in_call:  # an answer that ended inside a call (no closing tag): a call if its JSON is whole
            body, self.buf, self.in_call = self.buf, "", False
            call = _hermes_call(body)
            return [call] if call else self._content(_OPEN + body)
        out = self._content(self.buf)
        self.buf = ""
        if self.blank and not self.calls:  # an answer without calls keeps its text whole
            out.append(self.blank)
        self.blank = ""
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held back: it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# ---- Llama 3 JSON: {"name": ..., "parameters": {...}} ---------------------------------------------------

_PYTHON_TAG = "<|python_tag|>"


def llama3_calls(text: str) -> Optional[List[ToolCall]]:
    """The calls of an answer that is only JSON calls (``;``-separated, ``<|python_tag|>`` first); else None."""
    s = text.strip()
    if s.startswith(_PYTHON_TAG):
        s = s[len(_PYTHON_TAG):].lstrip()
    dec, calls, i = json.JSONDecoder(), [], 0
    while i < len(s):
        try:
            obj, i = dec.raw_decode(s, i)
        except ValueError:
            return None
        call = call_of(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        while i < len(s) and (s[i].isspace() or s[i] == ";"):
            i += 1
    return calls or None


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"

    def parse(self, text: str) -> Tuple[str, List[ToolCall]]:
        calls = llama3_calls(text) if text.lstrip().startswith(("{", _PYTHON_TAG)) else None
        return ("", calls) if calls else (text, [])

    def stream(self) -> ToolStream:
        return _Llama3Stream(self)


class _Llama3Stream(ToolStream):
    """Content is sent as it comes unless the answer begins like a call: then it is held to the end."""

    def __init__(self, parser: Llama3JsonParser):
        self.parser = parser
        self.buf = ""
        self.mode: Optional[str] = None  # None: undecided; "text"; "call"

    def push(self, piece: str) -> List[Event]:
        if self.mode == "text":
            return [piece] if piece else []
        self.buf += piece
        head = self.buf.lstrip()
        if not head or (_PYTHON_TAG.startswith(head) and len(head) < len(_PYTHON_TAG)):
            return []
        if self.mode is None:
            self.mode = "call" if head.startswith(("{", _PYTHON_TAG)) else "text"
        if self.mode == "text":
            out, self.buf = self.buf, ""
            return [out]
        return []

    def finish(self) -> List[Event]:
        text, self.buf = self.buf, ""
        if not text:
            return []
        content, calls = self.parser.parse(text)
        return list(calls) if calls else [content]


# ---- choosing a model's parser ----------------------------------------------------------------------------

PARSERS = {"hermes": HermesParser, "qwen": HermesParser, "llama3_json": Llama3JsonParser,
           "llama3": Llama3JsonParser}
"""Every ``tool_call_parser`` name a model's config may give."""
DEFAULT_PARSER = "hermes"


def detect(chat_template: Optional[str]) -> Optional[str]:
    """The parser a chat template teaches its model, when it says: ``<tool_call>`` tags are Hermes', a
    ``<|python_tag|>`` or ``"parameters"`` JSON call Llama 3's."""
    if not chat_template or not isinstance(chat_template, str):
        return None
    if _OPEN in chat_template:
        return "hermes"
    if _PYTHON_TAG in chat_template or ('"parameters"' in chat_template and "ipython" in chat_template):
        return "llama3_json"
    return None


def get_parser(name: Optional[str]) -> ToolCallParser:
    cls = PARSERS.get(name or DEFAULT_PARSER)
    if cls is None:
        raise ValueError(f"unknown tool_call_parser {name!r} (known: {', '.join(sorted(PARSERS))})")
    return cls()
