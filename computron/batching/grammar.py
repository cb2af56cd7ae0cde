"""Structured output on the master: a request's ``grammar`` checked and compiled (xgrammar) before any worker.

A grammar is one of ``{"type": "json_object"}``, ``{"type": "json_schema", "schema": {...}, "strict": bool}``,
``{"type": "regex", "pattern": str}``, ``{"type": "ebnf", "grammar": str}``. ``GrammarCompiler`` compiles
it against the model's tokenizer (its vocabulary padded to the model's logits, its EOS ids as the
grammar's stop tokens) into a ``comm.messages.GrammarBlob`` the sampling rank rebuilds its matcher from
(``models.grammar``). Compiled grammars are cached by their canonical JSON. JSON grammars are compiled
without free whitespace (the compact form), so that a model cannot fill its tokens with blanks.

xgrammar is imported only when a grammar is asked for: the engine imports and serves without it.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any, Mapping, Optional, Sequence, Tuple

from ..comm.messages import GrammarBlob
from ..errors import PayloadError

GRAMMAR_TYPES = {"json_object": (), "json_schema": ("schema", "strict", "name"), "regex": ("pattern",),
                 "ebnf": ("grammar",)}


def grammar_key(grammar: Any) -> str:
    """The canonical JSON of a well-formed grammar field; ``PayloadError`` ("grammar") for a malformed one."""
    if not isinstance(grammar, Mapping):
        raise PayloadError(f"grammar must be an object with a 'type', got {type(grammar).__name__}", "grammar")
    kind = grammar.get("type")
    if kind not in GRAMMAR_TYPES:
        raise PayloadError(f"grammar type {kind!r}: must be one of {sorted(GRAMMAR_TYPES)}", "grammar")
    extra = sorted(set(grammar) - {"type", *GRAMMAR_TYPES[kind]})
    if extra:
        raise PayloadError(f"grammar of type {kind!r}: unknown fields {extra}", "grammar")
    if kind == "json_schema":
        if not isinstance(grammar.get("schema"), Mapping):
            raise PayloadError("grammar of type 'json_schema' needs a 'schema' object", "grammar")
        if not isinstance(grammar.get("strict", False), (bool, type(None))):
            raise PayloadError("grammar 'strict' must be true or false", "grammar")
    need = {"regex": "pattern", "ebnf": "grammar"}.get(kind)
    if need is not None and (not isinstance(grammar.get(need), str) or not grammar.get(need)):
        raise PayloadError(f"grammar of type {kind!r} needs a non-empty string {need!r}", "grammar")
    try:
        return json.dumps(dict(grammar), sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"grammar is not JSON: {exc}", "grammar") from None


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as exc:
        raise PayloadError(f"structured output (grammar) needs the 'xgrammar' package, which is not installed "
                           f"({exc}): pip install xgrammar", "grammar") from None
    return xgrammar


_INFOS: dict = {}
_INFOS_LOCK = threading.Lock()


def tokenizer_info(path: str, vocab_size: Optional[int], stop_ids: Tuple[int, ...]):
    """xgrammar's tokenizer info of a tokenizer directory, its vocabulary padded to ``vocab_size`` (the
    model's logits) and ``stop_ids`` as its stop tokens (none: the tokenizer's EOS); made once per process."""
    key = (path, vocab_size, stop_ids)
    with _INFOS_LOCK:
        if key not in _INFOS:
            xgr = import_xgrammar()
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            _INFOS[key] = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size,
                                                             stop_token_ids=list(stop_ids) or None)
        return _INFOS[key]


class GrammarCompiler:
    """Compiles grammars for one model (its tokenizer directory, its logits' vocabulary, its EOS ids)."""

    def __init__(self, tokenizer_path: str, vocab_size: Optional[int], stop_ids: Sequence[int] = (),
                 cache_size: int = 128):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        self.cache_size = cache_size
        self._cache: "OrderedDict[str, GrammarBlob]" = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None

    def _setup(self):
        if self._compiler is None:
            self._compiler = import_xgrammar().GrammarCompiler(
                tokenizer_info(self.tokenizer_path, self.vocab_size, tuple(self.stop_ids)), max_threads=1)
        return self._compiler

    def compile(self, grammar: Any) -> GrammarBlob:
        """The compiled grammar (cached); ``PayloadError`` ("grammar") if it is malformed or does not compile."""
        key = grammar_key(grammar)
        with self._lock:
            blob = self._cache.get(key)
            if blob is not None:
                self._cache.move_to_end(key)
                return blob
            compiler = self._setup()
            try:
                compiled = self._compile(compiler, json.loads(key))
            except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError of many kinds
                msg = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                raise PayloadError(f"grammar does not compile: {msg}", "grammar") from None
            blob = GrammarBlob(key=hashlib.sha256(key.encode()).hexdigest()[:32],
                               grammar_json=compiled.serialize_json(), tokenizer_path=self.tokenizer_path,
                               vocab_size=self.vocab_size, stop_ids=tuple(self.stop_ids))
            self._cache[key] = blob
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return blob

    @staticmethod
    def _compile(compiler, g: dict):
        kind = g["type"]
        if kind == "json_object":
            return compiler.compile_json_schema({"type": "object"}, any_whitespace=False)
        if kind == "json_schema":
            return compiler.compile_json_schema(json.dumps(g["schema"]), any_whitespace=False,
                                                strict_mode=bool(g.get("strict", True)))
        if kind == "regex":
            return compiler.compile_regex(g["pattern"])
        return compiler.compile_grammar(g["grammar"])


__all__ = ["GRAMMAR_TYPES", "GrammarCompiler", "grammar_key", "import_xgrammar", "tokenizer_info"]
