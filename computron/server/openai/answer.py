"""The OpenAI objects of one completion or chat completion answer: whole, or as stream chunks. No I/O.

``Answer`` (one id and creation time) turns its ``ChoiceRun``s into ``text_completion`` /
``chat.completion`` objects, or their ``Piece``s into chunks. In chat, when the request has tools, the
text goes through the model's tool-call parser (``tool_parsers``): streamed, content deltas and then
``delta.tool_calls[{index, id, type, function: {name, arguments}}]`` as each call completes; a forced call
(``tool_choice`` ``required`` or named: the grammar made the answer JSON) is read whole at the end. An answer
with tool calls finishes with ``tool_calls``.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Dict, List, Optional

from .chat import ChatTools, forced_calls
from .choices import ChoiceRun, Piece
from .logprobs import TokenText, chat_content, completion_logprobs
from .tool_parsers import ToolCall, ToolCallParser, ToolStream


class _ChatChoice:
    """A streamed chat choice's tool-call state."""

    def __init__(self, tools: Optional[ChatTools], parser: Optional[ToolCallParser]):
        self.tools = tools
        self.forced = bool(tools and tools.forced)
        self.stream: Optional[ToolStream] = parser.stream() if parser and tools and tools.parsed and not self.forced \
            else None
        self.held = ""
        self.calls = 0


class Answer:
    def __init__(self, model: str, chat: bool, tok: TokenText, tools: Optional[ChatTools] = None,
                 parser: Optional[ToolCallParser] = None):
        self.model, self.chat, self.tok = model, chat, tok
        self.tools, self.parser = tools, parser
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self._choices: Dict[int, _ChatChoice] = {}

    def _head(self, obj: str) -> Dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # ---- whole ---------------------------------------------------------------------------------------
    def split_calls(self, text: str) -> tuple:
        """(content, tool calls) of a chat answer's text."""
        if self.tools is None or not self.tools.parsed:
            return text, []
        if self.tools.forced:
            calls = forced_calls(text, self.tools)
            return (None, calls) if calls else (text, [])
        content, calls = self.parser.parse(text) if self.parser else (text, [])
        return (content or None, calls) if calls else (text, [])

    def whole(self, runs: List[ChoiceRun], counts: Dict[str, int]) -> Dict[str, Any]:
        choices = []
        for run in runs:
            reason = run.finish_reason()
            if self.chat:
                content, calls = self.split_calls(run.body_text)
                msg: Dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    msg["tool_calls"] = [c.openai() for c in calls]
                    reason = "tool_calls"
                lp = {"content": chat_content(self.tok, run.logprobs)} if run.want_logprobs else None
                choices.append({"index": run.index, "message": msg, "logprobs": lp, "finish_reason": reason})
            else:
                lp = None
                if run.want_logprobs:
                    a = run.answer_logprobs()
                    lp = completion_logprobs(self.tok, a.ids, a.logprobs, a.offsets)
                choices.append({"index": run.index, "text": run.full_text, "logprobs": lp, "finish_reason": reason})
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": counts}

    # ---- chunks --------------------------------------------------------------------------------------
    def _chunk(self, choice: Dict[str, Any]) -> Dict[str, Any]:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}

    def start(self, run: ChoiceRun) -> List[Dict[str, Any]]:
        """The chunks that open a choice: chat's role; completions' echoed prompt."""
        if self.chat:
            self._choices[run.index] = _ChatChoice(self.tools, self.parser)
            return [self._chunk({"index": run.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None})]
        if run.echo is None:
            return []
        return self.piece(run, run.head, force=True)

    def piece(self, run: ChoiceRun, piece: Piece, force: bool = False) -> List[Dict[str, Any]]:
        if not piece and not force:
            return []
        if not self.chat:
            lp = completion_logprobs(self.tok, piece.ids, piece.logprobs, piece.offsets) if run.want_logprobs \
                else None
            if not piece.text and not (lp and lp["tokens"]):
                return []
            return [self._chunk({"index": run.index, "text": piece.text, "logprobs": lp, "finish_reason": None})]
        return self._chat_piece(run, piece)

    def _chat_piece(self, run: ChoiceRun, piece: Piece) -> List[Dict[str, Any]]:
        st = self._choices[run.index]
        lp = {"content": chat_content(self.tok, [x for x in piece.logprobs if x is not None])} \
            if run.want_logprobs and piece.logprobs else None
        out = []
        if st.forced:
            st.held += piece.text
            events: List[Any] = []
        elif st.stream is not None:
            events = st.stream.push(piece.text) if piece.text else []
        else:
            events = [piece.text] if piece.text else []
        for e in events:
            out.append(self._event(run.index, st, e, lp))
            lp = None
        if lp is not None:  # tokens whose text is held back (or forced JSON): their logprobs go now
            out.append(self._chunk({"index": run.index, "delta": {}, "logprobs": lp, "finish_reason": None}))
        return out

    def _event(self, index: int, st: _ChatChoice, e: Any, lp: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        if isinstance(e, ToolCall):
            delta: Dict[str, Any] = {"tool_calls": [e.openai(st.calls)]}
            st.calls += 1
        else:
            delta = {"content": e}
        return self._chunk({"index": index, "delta": delta, "logprobs": lp, "finish_reason": None})

    def end(self, run: ChoiceRun, piece: Piece) -> List[Dict[str, Any]]:
        """The last chunks of a choice: what was held back, then its finish reason."""
        out = self.piece(run, piece)
        reason = run.finish_reason()
        if self.chat:
            st = self._choices[run.index]
            events: List[Any] = []
            if st.forced:
                calls = forced_calls(st.held, st.tools)
                events = list(calls) if calls else ([st.held] if st.held else [])
            elif st.stream is not None:
                events = st.stream.finish()
            out += [self._event(run.index, st, e, None) for e in events]
            if st.calls:
                reason = "tool_calls"
            out.append(self._chunk({"index": run.index, "delta": {}, "logprobs": None, "finish_reason": reason}))
        else:
            out.append(self._chunk({"index": run.index, "text": "", "logprobs": None, "finish_reason": reason}))
        return out

    def usage_chunk(self, counts: Dict[str, int]) -> Dict[str, Any]:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": counts}
