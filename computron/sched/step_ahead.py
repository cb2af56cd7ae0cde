"""When a model's next token step is sent ahead of the one it runs: pure policy, no torch, no threads.

A step sent while the one before it runs waits in the workers' command order and starts the moment that
one ends, so the workers never wait for the master to read a step's tokens, stream them and decide the
next one (on this project's 2-core CPU 1.5-2 ms of a 45 ms step under HTTP load, docs/performance.md).
But a step is formed when it is sent: a request arriving after that joins only the step behind it. So a
step goes ahead as late as it safely can, ``lead`` before the running step is expected to end: the end
from the model's recent decode steps (the answer's time less the step's start), the lead twice the last
steps' overhead beyond the workers' own time (the command's trip there and the answer's back), at least
``MIN_LEAD_S`` (or the one ``EngineConfig.step_ahead_lead_ms`` fixes). A step that prefills has no such
estimate (its time grows with its prompts): the one after it waits for its answer; nor does a step shorter
than twice its measured lead, whose successor would go the moment it is sent: the master would then answer
and send without a pause, and its event loop (the HTTP clients, a client that leaves) fall behind the tokens.

A step sent ahead starts when the one before it is answered, not when it was sent: ``start`` says which,
for the step's records as for the estimate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

MIN_LEAD_S = 0.002
"""The least lead: the command's trip to the workers on an idle machine, with room for a late timer."""
SMOOTHING = 0.5
"""Weight of the newest decode step in the running estimates."""


@dataclass
class _Model:
    step_s: Optional[float] = None
    """Smoothed time of a decode step (no prompt tokens), from its start to its answer."""
    overhead_s: float = 0.0
    """Smoothed part of it outside the workers' own time."""
    answered: Optional[float] = None
    """When the model's last step was answered."""
    sent: Optional[float] = None
    """When the model's last step was sent, None if it prefills."""


class StepAhead:
    def __init__(self, lead_s: Optional[float] = None):
        """``lead_s``: a fixed lead instead of the measured one."""
        self._lead_s = lead_s
        self._models: Dict[str, _Model] = {}

    def _model(self, model_id: str) -> _Model:
        return self._models.setdefault(model_id, _Model())

    def start(self, model_id: str, sent: float) -> float:
        """When a step sent at ``sent`` started: then, or when the step before it was answered."""
        answered = self._model(model_id).answered
        return sent if answered is None else max(sent, answered)

    def sent(self, model_id: str, at: float, prompt_tokens: int) -> None:
        self._model(model_id).sent = None if prompt_tokens else at

    def answered(self, model_id: str, sent: float, at: float, worker_s: float, prompt_tokens: int) -> None:
        """A step sent at ``sent`` was answered at ``at`` after ``worker_s`` on its slowest rank."""
        m = self._model(model_id)
        start = self.start(model_id, sent)
        m.answered = at
        if prompt_tokens or at <= start:
            return
        took, overhead = at - start, max(0.0, at - start - worker_s)
        if m.step_s is None:
            m.step_s, m.overhead_s = took, overhead
        else:
            m.step_s += SMOOTHING * (took - m.step_s)
            m.overhead_s += SMOOTHING * (overhead - m.overhead_s)

    def due(self, model_id: str) -> Optional[float]:
        """When the step after the one in flight should be sent (None: once that one is answered)."""
        m = self._models.get(model_id)
        if m is None or m.sent is None or m.step_s is None:
            return None
        if self._lead_s is not None:
            return self.start(model_id, m.sent) + m.step_s - self._lead_s
        lead = max(MIN_LEAD_S, 2 * m.overhead_s)
        if m.step_s < 2 * lead:
            return None  # every step would go at once: the master, busy all the time, would outrun its clients
        return self.start(model_id, m.sent) + m.step_s - lead

    def forget(self, model_id: str) -> None:
        self._models.pop(model_id, None)
