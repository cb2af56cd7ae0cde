"""Text on the master: tokenizers, incremental detokenization, stop strings, chat templates.

Each model's tokenizer is loaded from its checkpoint directory (local files only).
Prompts are tokenized here; the engine only ever sees token ids. Output ids are
turned back into text one token at a time (:class:`IncrementalDetokenizer`),
which must be right when a character spans several byte-level tokens or a merged
token changes how its neighbour decodes; :class:`TextStream` adds stop strings on
top and is used for streamed and non-streamed answers alike.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

_REPLACEMENT = "\ufffd"


class ChatTemplateError(ValueError):
    """The model's tokenizer has no chat template (or the template failed on these messages)."""


class ModelText:
    """A model's tokenizer with what the server needs from it."""

    def __init__(self, model_id: str, path: str, tokenizer=None):
        self.model_id = model_id
        self.path = path
        if tokenizer is None:
            tokenizer = load_tokenizer(path)
        self.tokenizer = tokenizer
        # the Rust tokenizer directly where there is one: decode is on the per-token path
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.eos_token_id = tokenizer.eos_token_id
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self._token_strs: Dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=True)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_str(self, token_id: int) -> str:
        """One token's own text, special tokens included (logprobs' ``token``)."""
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tokenizer.decode([int(token_id)], skip_special_tokens=False)
            if len(self._token_strs) < 1 << 16:
                self._token_strs[token_id] = s
        return s

    @property
    def chat_template(self) -> Optional[str]:
        t = getattr(self.tokenizer, "chat_template", None)
        return t if isinstance(t, str) else None

    def chat_ids(self, messages: List[Dict[str, Any]], tools: Optional[List[Dict[str, Any]]] = None,
                 kwargs: Optional[Dict[str, Any]] = None) -> List[int]:
        """The prompt ids of a chat: the tokenizer's chat template with the generation prompt (unless
        ``kwargs``, the request's ``chat_template_kwargs``, say otherwise), rendering ``tools`` if given."""
        if not self.has_chat_template:
            raise ChatTemplateError(f"model {self.model_id!r} has no chat template: its tokenizer "
                                    f"({self.path}) defines none; use /v1/completions")
        kw = dict(kwargs or {})
        kw.setdefault("add_generation_prompt", True)
        if tools:
            kw["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, **kw)
        except Exception as exc:  # noqa: BLE001 - a template error is the request's problem
            raise ChatTemplateError(f"model {self.model_id!r}: the chat template failed on these messages: "
                                    f"{type(exc).__name__}: {exc}") from None
        return self.encode(text, add_special_tokens=False)  # templates write their own special tokens


def load_tokenizer(path: str):
    """The tokenizer saved in a checkpoint directory; never the hub."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class IncrementalDetokenizer:
    """Text of a growing token sequence, a piece at a time (the offsets method of TGI and vLLM).

    It decodes a short window of tokens before and after the last emitted point
    and emits the difference, holding it back while it ends in an incomplete
    character (U+FFFD): a multi-byte character split over byte-level tokens comes
    out whole, and a token whose text depends on its left neighbour (merges,
    SentencePiece's leading spaces) decodes in context. ``finish()`` flushes what
    was held back. The pieces concatenate to ``decode(all generated ids)`` for
    byte-level tokenizers; the server uses these pieces for both streamed and
    non-streamed answers, so the two always agree.
    """

    def __init__(self, text: ModelText, prompt_ids: Sequence[int] = (), context: int = 5):
        self._text = text
        self._ids: List[int] = list(prompt_ids[-context:]) if context else []
        self._prefix = 0
        self._read = len(self._ids)

    def add(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        return self._step(final=False)

    def finish(self) -> str:
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        if self._read >= len(self._ids):
            return ""
        decode = self._text.decode
        prefix_text = decode(self._ids[self._prefix:self._read])
        new_text = decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith(_REPLACEMENT)):
            piece = new_text[len(prefix_text):]
            self._prefix = self._read
            self._read = len(self._ids)
            return piece
        if final:
            self._read = len(self._ids)
        return ""


class TextStream:
    """Generated text with stop strings: ``push`` each token id, get the text that is safe to send.

    Text that could be the start of a stop string is held back until it is known
    not to be one; when a stop string appears the text is cut before it and
    ``stopped`` is set (the caller then stops the sequence).
    """

    def __init__(self, text: ModelText, prompt_ids: Sequence[int] = (), stop: Sequence[str] = ()):
        self._detok = IncrementalDetokenizer(text, prompt_ids)
        self._stop = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self.text = ""
        self._sent = 0
        self.stopped = False
        self.n_tokens = 0

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.n_tokens += 1
        return self._take(self._detok.add(token_id), final=False)

    def count(self) -> None:
        """A token that ends the answer without adding to its text (a ``stop_token_ids`` id)."""
        if not self.stopped:
            self.n_tokens += 1

    def finish(self) -> str:
        if self.stopped:
            return ""
        return self._take(self._detok.finish(), final=True)

    def _take(self, piece: str, final: bool) -> str:
        if not piece and not final:
            return ""
        start = max(0, len(self.text) - self._max_stop + 1)
        self.text += piece
        if self._stop:
            hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True
                final = True
        end = len(self.text) if final else len(self.text) - self._held_back()
        out = self.text[self._sent:end]
        self._sent = max(self._sent, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        text = self.text
        for n in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0
