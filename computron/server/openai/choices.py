"""One choice of an answer, from the engine's stream to its text, logprobs and finish reason. No I/O.

A ``ChoiceRun`` takes each item the engine streams for one sequence (``feed``): token ids, or the logprob
objects of ``logprobs.split``; it keeps the tokens, their logprobs and the prompt's, and runs the text
through one ``TextStream`` (incremental detokenizing and stop strings), so a streamed answer and a whole
one are the same text. Each ``feed`` returns a ``Piece``: the text now safe to send and the tokens (with
their logprobs and text offsets) consumed since the last piece. ``done`` is set once a stop string ended
the text: the caller stops the sequence.

The finish reason is ``stop`` for an EOS (unless ``ignore_eos``), a ``stop_token_ids`` id (its text is
not part of the answer), a stop string or a sequence the engine ended early (a completed grammar), else
``length``. With ``echo`` the prompt's text comes first (and with logprobs the prompt's scored tokens);
``max_tokens: 0`` (echo only) answers the prompt alone, the one token the engine made discarded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional, Sequence

from ..text import IncrementalDetokenizer, ModelText, TextStream
from .logprobs import split


@dataclass
class Piece:
    """What one step of a choice adds to its answer."""
    text: str = ""
    ids: List[int] = field(default_factory=list)
    logprobs: List[Optional[Any]] = field(default_factory=list)
    """One per id when logprobs are asked for (None: a prompt's first token); else empty."""
    offsets: List[int] = field(default_factory=list)
    """Where each id's text begins in the answer's text (completions' ``text_offset``)."""

    def __bool__(self) -> bool:
        return bool(self.text or self.ids)


class ChoiceRun:
    def __init__(self, index: int, text: ModelText, data: dict, stop: Sequence[str] = (), eos: Iterable[int] = (),
                 echo: Optional[str] = None, discard: bool = False, want_logprobs: bool = False):
        """``data``: the engine's request; ``echo``: the prompt's text to answer first (None: no echo);
        ``discard``: answer no generated token (``max_tokens: 0``)."""
        self.index, self.text, self.data = index, text, data
        self.max_tokens = data["max_tokens"]
        self.ignore_eos = bool(data.get("ignore_eos"))
        self.stop_ids = set(data.get("stop_token_ids") or ())
        self.eos = set(eos) | ({text.eos_token_id} if text.eos_token_id is not None else set())
        self.ts = TextStream(text, data["input_ids"], stop)
        self.echo, self.discard, self.want_logprobs = echo, discard, want_logprobs
        self.ids: List[int] = []
        self.logprobs: List[Any] = []
        self.prompt_logprobs: Optional[Any] = None
        self.last: Optional[int] = None
        self.done = False
        self.head = Piece()
        """The echoed prompt (text, and its scored tokens with logprobs): the answer's first piece."""
        self.sent = 0
        """Length of the answer's text sent so far (echo included)."""
        if echo is not None:
            self.head.text = echo
            self.sent = len(echo)

    @property
    def n_prompt(self) -> int:
        return len(self.data["input_ids"])

    @property
    def n_generated(self) -> int:
        return self.ts.n_tokens

    def _echo_logprobs(self, prompt_lps: Any) -> None:
        ids = self.data["input_ids"]
        detok, offsets, at = IncrementalDetokenizer(self.text), [], 0
        for t in ids:
            offsets.append(at)
            at += len(detok.add(t))
        self.head.ids, self.head.logprobs, self.head.offsets = list(ids), list(prompt_lps.entries), offsets

    def feed(self, item: Any) -> Piece:
        kind, value = split(item)
        if kind == "prompt":
            self.prompt_logprobs = value
            if self.echo is not None:
                self._echo_logprobs(value)
            return Piece()
        tok = value if kind == "token" else int(value.token)
        self.last = tok
        if self.discard or self.done:
            return Piece()
        lp = value if kind == "logprob" else None
        self.ids.append(tok)
        if lp is not None:
            self.logprobs.append(lp)
        offset = self.sent
        if tok in self.stop_ids:
            self.ts.count()
            piece = ""
        else:
            piece = self.ts.push(tok)
        self.sent += len(piece)
        self.done = self.ts.stopped
        want = self.want_logprobs and lp is not None
        return Piece(piece, [tok], [lp] if want else [], [offset] if want else [])

    def finish(self) -> Piece:
        piece = self.ts.finish()
        self.sent += len(piece)
        return Piece(piece)

    @property
    def body_text(self) -> str:
        """The generated text (no echo)."""
        return self.ts.text

    @property
    def full_text(self) -> str:
        return (self.echo or "") + self.ts.text

    def finish_reason(self) -> str:
        if self.discard:
            return "length"
        if self.ts.stopped or self.ts.n_tokens < self.max_tokens or self.last in self.stop_ids:
            return "stop"
        if self.last in self.eos and not self.ignore_eos:
            return "stop"
        return "length"

    def answer_logprobs(self) -> Piece:
        """Every token of the answer with its logprob and offset (echoed prompt first), for a whole answer."""
        ids, lps, offsets = list(self.head.ids), list(self.head.logprobs), list(self.head.offsets)
        if self.logprobs:
            base = len(self.echo or "")
            detok, at = IncrementalDetokenizer(self.text, self.data["input_ids"]), base
            for lp in self.logprobs:
                ids.append(int(lp.token))
                lps.append(lp)
                offsets.append(min(at, base + len(self.ts.text)))
                at += len(detok.add(int(lp.token)))
        return Piece(self.full_text, ids, lps, offsets)
