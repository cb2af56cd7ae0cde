"""Admission: whether a request may join its model's queue, and when a refused client should come back.

Pure policy (no torch, no locks, no clocks of its own): the engine asks ``admit`` under its lock, before
any work on the request beyond reading its model id (again, with the prompt's length, when the request
is queued), and answers a refusal at once: ``QueueFullError`` with the ``Refusal``'s reason and
``Retry-After``, 429 over HTTP.

Two reasons to refuse:

- ``queue_full``: the model already holds ``queue_size`` requests that wait for a batch, counting those
  admitted and still being prepared (tokenized), so a burst cannot overshoot the bound while it is prepared;
- ``ttft_late``: the model has a time-to-first-token objective (``EngineConfig.ttft_slo_s`` with
  ``ttft_refusal_factor``) and the predicted time to first token exceeds the factor times the objective.
  The prediction is what the master knows without waiting: the requests ahead in the queue at the model's
  measured seconds per answered request (``ServiceClock``), a load if the model is not resident (its
  measured load time), and the prompt's prefill at the model's measured prefill rate (once the prompt's
  length is known; the first check, before tokenizing, leaves it out, so it only refuses what is late
  whatever the prompt).

``Retry-After`` says the expected wait: the requests ahead times the per-request time, rounded up to whole
seconds and at least one (before any answer was measured: one second). A client told to come back then
finds the queue drained of what was ahead of it, instead of retrying into the same full queue at once.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, Optional

QUEUE_FULL = "queue_full"
TTFT = "ttft_late"
REASONS = (QUEUE_FULL, TTFT)

WINDOW = 32
"""Answers per model the per-request time is measured over (the latest ones of the current busy period)."""


@dataclass(frozen=True)
class Refusal:
    reason: str
    """``queue_full`` or ``ttft_late`` (the label of ``computron_rejections_total``)."""
    retry_after_s: int
    """Whole seconds, at least 1: the expected wait of the requests ahead."""
    message: str


@dataclass(frozen=True)
class Outlook:
    """What the master knows of a model when a request for it arrives."""
    waiting: int
    """Requests ahead of this one that wait for a batch (being prepared included)."""
    bound: int
    """The model's ``queue_size`` (0: unbounded)."""
    per_request_s: Optional[float]
    """Measured seconds per answered request (``ServiceClock``); None before any was measured."""
    resident: bool = True
    load_s: Optional[float] = None
    """The model's measured load time (None: never loaded, or unknown)."""
    prefill_tokens_per_s: Optional[float] = None


def retry_after(ahead: int, per_request_s: Optional[float]) -> int:
    """Whole seconds until the ``ahead`` requests are expected to be answered, at least 1."""
    if per_request_s is None or per_request_s <= 0:
        return 1
    return max(1, math.ceil(ahead * per_request_s))


def predicted_ttft(o: Outlook, prompt_tokens: Optional[int] = None) -> float:
    """Seconds until a request admitted now would get its first token: the queue ahead, a load if the model
    is not resident, its prefill (left out while ``prompt_tokens`` is unknown)."""
    wait = o.waiting * (o.per_request_s or 0.0)
    load = 0.0 if o.resident else (o.load_s or 0.0)
    prefill = (prompt_tokens / o.prefill_tokens_per_s
               if prompt_tokens and o.prefill_tokens_per_s and o.prefill_tokens_per_s > 0 else 0.0)
    return wait + load + prefill


def admit(model_id: str, o: Outlook, ttft_limit_s: Optional[float] = None,
          prompt_tokens: Optional[int] = None) -> Optional[Refusal]:
    """None to admit; else why not and when to come back. ``ttft_limit_s``: the objective times the
    refusal factor (None: no TTFT check)."""
    if o.bound and o.waiting >= o.bound:
        return Refusal(QUEUE_FULL, retry_after(o.waiting, o.per_request_s),
                       f"model {model_id!r} already has {o.waiting} waiting requests (queue_size={o.bound})")
    if ttft_limit_s is not None:
        ttft = predicted_ttft(o, prompt_tokens)
        if ttft > ttft_limit_s:
            return Refusal(TTFT, retry_after(o.waiting, o.per_request_s) if o.waiting else max(1, math.ceil(ttft)),
                           f"model {model_id!r}: predicted time to first token {ttft:.2f}s exceeds "
                           f"{ttft_limit_s:.2f}s (ttft_refusal_factor x ttft_slo_s); {o.waiting} requests ahead")
    return None


class ServiceClock:
    """Each model's measured seconds per answered request: the span of its latest answers over their count,
    within one busy period (an answer after which the model had nothing left restarts the window, so idle
    time never counts as service). Batching is in the figure: eight answers a second from batches of eight
    are 0.125 s per request."""

    def __init__(self, window: int = WINDOW):
        self._answers: Dict[str, Deque[float]] = {}
        self._idle_after_last: Dict[str, bool] = {}
        self._estimate: Dict[str, float] = {}
        self._window = window

    def answered(self, model_id: str, now: float, more_left: bool) -> None:
        """A request of ``model_id`` was answered at ``now``; ``more_left``: others still wait or run."""
        answers = self._answers.setdefault(model_id, deque(maxlen=self._window))
        if self._idle_after_last.get(model_id, True):
            answers.clear()
        answers.append(now)
        self._idle_after_last[model_id] = not more_left
        if len(answers) >= 2 and answers[-1] > answers[0]:
            self._estimate[model_id] = (answers[-1] - answers[0]) / (len(answers) - 1)

    def per_request_s(self, model_id: str) -> Optional[float]:
        return self._estimate.get(model_id)

    def forget(self, model_id: str) -> None:
        for d in (self._answers, self._idle_after_last, self._estimate):
            d.pop(model_id, None)
