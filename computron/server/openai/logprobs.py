"""Logprobs in OpenAI's shapes, from what the engine streams. Pure Python (the tokenizer is passed in).

With ``logprobs`` or ``prompt_logprobs`` set, the engine yields ``computron.engine.protocol`` objects
instead of bare token ids: one ``PromptLogprobs`` first (``entries``: one per prompt token, the first None)
when the prompt is scored, then one ``TokenLogprob`` (``token``, ``logprob``, ``top``: the k most likely
``(id, logprob)``) per generated token. ``split`` reads either kind without importing the engine.

- completions: ``{tokens, token_logprobs, top_logprobs, text_offset}`` (``completion_logprobs``); with
  ``echo`` the prompt's tokens come first, the first one's logprob and alternatives null (what lm-eval's
  loglikelihood requests read). Each ``top_logprobs`` entry maps token text to logprob: the k alternatives
  and the token itself.
- chat: ``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`` (``chat_content``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

TokenText = Callable[[int], str]
"""A token's own text (special tokens included): ``ModelText.token_str``."""


def split(item: Any) -> Tuple[str, Any]:
    """What one item of the engine's stream is: ``("token", id)``, ``("logprob", TokenLogprob)`` or
    ``("prompt", PromptLogprobs)``."""
    if isinstance(item, int):
        return "token", item
    if hasattr(item, "entries"):
        return "prompt", item
    if hasattr(item, "logprob") and hasattr(item, "token"):
        return "logprob", item
    raise TypeError(f"the engine streamed {type(item).__name__}, not a token id or logprobs")


def _top(tok: TokenText, lp: Any, with_self: bool) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for tid, v in lp.top:
        out.setdefault(tok(tid), float(v))
    if with_self:
        out.setdefault(tok(lp.token), float(lp.logprob))
    return out


def completion_logprobs(tok: TokenText, ids: Sequence[int], lps: Sequence[Optional[Any]],
                        offsets: Sequence[int]) -> Dict[str, Any]:
    """Completions' ``logprobs`` object of these tokens (``lps[i]`` None: a prompt's first token)."""
    return {"tokens": [tok(t) for t in ids],
            "token_logprobs": [None if lp is None else float(lp.logprob) for lp in lps],
            "top_logprobs": [None if lp is None else _top(tok, lp, True) for lp in lps],
            "text_offset": list(offsets)}


def merge_completion(parts: List[Dict[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, List[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in parts:
        for k in out:
            out[k] += p[k]
    return out


def _entry(tok: TokenText, tid: int, logprob: float) -> Dict[str, Any]:
    s = tok(tid)
    return {"token": s, "logprob": float(logprob), "bytes": list(s.encode("utf-8"))}


def chat_content(tok: TokenText, lps: Sequence[Any]) -> List[Dict[str, Any]]:
    """Chat's ``logprobs.content`` entries of these tokens."""
    return [{**_entry(tok, lp.token, lp.logprob), "top_logprobs": [_entry(tok, t, v) for t, v in lp.top]}
            for lp in lps]


def responses_logprobs(tok: TokenText, lps: Sequence[Any]) -> List[Dict[str, Any]]:
    """The Responses API's ``logprobs`` of output text (``{token, logprob, bytes, top_logprobs}``)."""
    return chat_content(tok, lps)
