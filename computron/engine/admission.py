"""The engine's admission control: refusing a request before any work on it, and counting the refusals.

``Admission`` puts together what the master knows of a model when a request arrives (``sched.admission.
Outlook``: the requests waiting for a batch, being prepared included; the model's bound; its measured
seconds per answered request, load time and prefill rate; whether it is resident) and asks the pure
policy (``sched/admission.py``) whether to admit it. A refusal raises ``QueueFullError`` with its reason
and ``Retry-After`` and is counted in ``Telemetry.counters["rejections"]`` by (served id, reason)
(``computron_rejections_total``). Called under the engine's lock; it only reads and counts.
"""
from __future__ import annotations

from typing import Optional

from ..config import EngineConfig
from ..errors import QueueFullError
from ..sched import admission as policy
from ..sched.scheduler import ModelState, Scheduler
from .requests import RequestTable
from .telemetry import Telemetry


class Admission:
    def __init__(self, config: EngineConfig, requests: RequestTable, sched: Scheduler, telemetry: Telemetry):
        self._requests, self._sched, self._telemetry = requests, sched, telemetry
        factor = config.ttft_refusal_factor
        self.ttft_limit_s: Optional[float] = factor * config.ttft_slo_s if factor else None
        """Predicted time to first token over which requests are refused (None: no TTFT check)."""

    def outlook(self, key: str, arriving: int = 0) -> policy.Outlook:
        load = self._telemetry.last_swap.get(key, {}).get("load")
        return policy.Outlook(
            waiting=self._requests.waiting(key) + arriving, bound=self._requests.queue_sizes.get(key, 0),
            per_request_s=self._requests.service.per_request_s(key),
            resident=self._sched.state(key) in (ModelState.LOADED, ModelState.LOADING),
            load_s=load["seconds"] if load else None,
            prefill_tokens_per_s=self._telemetry.prefill_rate.get(key))

    def check(self, key: str, label: str, prompt_tokens: Optional[int] = None, arriving: int = 0) -> None:
        """Raise (and count) the refusal of a request for ``key`` (``label``: the id it asked for: a model's,
        or a LoRA adapter's), if it is refused now; ``prompt_tokens`` once known (the TTFT's prefill);
        ``arriving``: requests let through and not yet submitted (the server's), counted as waiting."""
        refusal = policy.admit(label, self.outlook(key, arriving), self.ttft_limit_s, prompt_tokens)
        if refusal is not None:
            self._telemetry.counters["rejections"][(label, refusal.reason)] += 1
            raise QueueFullError(refusal.message, refusal.reason, refusal.retry_after_s)


def prompt_tokens(prepared) -> Optional[int]:
    """The prompt length of a prepared generation request (None for other kinds of request)."""
    ids = prepared.get("input_ids") if isinstance(prepared, dict) else None
    return len(ids) if ids is not None and hasattr(ids, "__len__") else None
