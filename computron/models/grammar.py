"""Structured output on the sampling rank: one xgrammar matcher per sequence, rebuilt from the master's blob.

``matcher_for(blob)`` deserializes the compiled grammar (cached by the blob's key; its tokenizer info made
from the model's tokenizer directory once, ``batching.grammar.tokenizer_info``) into a fresh ``Matcher``:
``fill`` writes the tokens the grammar allows next into a row of a host bitmask, which ``apply_bitmask``
applies to a batch of logits on their device (``sampling_controls``); ``accept`` advances it by the chosen
token, and ``terminated`` says the grammar is complete (its stop token accepted). xgrammar is imported only
when a sequence has a grammar.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from ..batching.grammar import tokenizer_info

_CACHE: "OrderedDict[tuple, object]" = OrderedDict()
_LOCK = threading.Lock()
_CACHE_SIZE = 64


def _xgr():
    try:
        import xgrammar
    except ImportError as exc:
        raise RuntimeError(f"a sequence asks for a grammar, which needs the 'xgrammar' package: {exc}") from None
    return xgrammar


def _compiled(blob):
    xgr = _xgr()
    key = (blob.key, blob.tokenizer_path, blob.vocab_size, tuple(blob.stop_ids))  # one grammar, many models
    with _LOCK:
        got = _CACHE.get(key)
        if got is not None:
            _CACHE.move_to_end(key)
            return got
        info = tokenizer_info(blob.tokenizer_path, blob.vocab_size, tuple(blob.stop_ids))
        got = _CACHE[key] = xgr.CompiledGrammar.deserialize_json(blob.grammar_json, info)
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
        return got


class Matcher:
    def __init__(self, compiled):
        self.vocab = compiled.tokenizer_info.vocab_size
        self._m = _xgr().GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write row ``row`` of a host bitmask (``host_bitmask``): the tokens the grammar allows next."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        if not self._m.is_terminated() and not self._m.accept_token(int(token)):
            raise RuntimeError(f"the grammar rejected token {token}")

    @property
    def terminated(self) -> bool:
        return self._m.is_terminated()


def host_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """A bitmask [rows, ceil(vocab / 32)] in host memory allowing every token (rows no matcher fills)."""
    return _xgr().allocate_token_bitmask(rows, vocab)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, vocab: int) -> None:
    """Set (in place, ``logits`` [B, V] on any device, ``bitmask`` on the same one) the logits of the first
    ``vocab`` ids that the bitmask does not allow to -inf (xgrammar's kernel: CPU, or Triton on CUDA)."""
    _xgr().apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)


def matcher_for(blob) -> Matcher:
    """A fresh matcher of a ``comm.messages.GrammarBlob``."""
    return Matcher(_compiled(blob))


__all__ = ["Matcher", "matcher_for", "host_bitmask", "apply_bitmask"]
