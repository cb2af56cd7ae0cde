"""The requests the engine holds: each model's waiting queue, and every request until it is answered.

``RequestTable`` prepares a request with its model's batch manager (validation,
tokenizing, image decoding: outside the engine's lock), admits it, bounds each queue, removes a cancelled one, and
answers one: the future and the stream are resolved on the caller's own loop,
and the request leaves a ``RequestRecord``. It also gives the scheduler each
model's oldest waiting request (``heads``). A request admitted and still being prepared holds a place in
its model's queue (``reserve``), so the bound is exact under a burst; each answer feeds the model's
``ServiceClock`` (seconds per answered request: ``Retry-After``'s and the TTFT prediction's unit).
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter, deque
from typing import Any, Callable, Deque, Dict, Optional

from ..batching.base import SubmitEntry
from ..errors import PayloadError, QueueFullError, UnknownModelError
from ..metrics import RequestRecord
from ..sched.admission import ServiceClock
from .sequences import Request
from .telemetry import Telemetry


class RequestTable:
    def __init__(self, batch_managers: Dict[str, Any], queue_sizes: Dict[str, int], telemetry: Telemetry):
        self._batch_managers = batch_managers
        self.queues: Dict[str, Deque[SubmitEntry]] = {m: deque() for m in batch_managers}
        self.requests: Dict[int, Request] = {}
        self.queue_sizes = queue_sizes
        """Each model's bound on waiting requests (0: none): the one admission check, engine and server alike."""
        self._telemetry = telemetry
        self._uids = itertools.count()
        self.preparing: Counter = Counter()
        """Per model: requests admitted and still being prepared (``reserve``), places of its queue."""
        self._open: Counter = Counter()
        """Per model: requests queued or running, not yet answered."""
        self.service = ServiceClock()
        self.on_done: Callable[[str, float], None] = lambda model_id, now: None
        """Told when a request of a model was answered or cancelled (the keep-alive counts from then)."""

    def add_model(self, model_id: str, batch_manager: Any, queue_size: int) -> None:
        """A model added while serving (``catalog.py``)."""
        self._batch_managers[model_id] = batch_manager
        self.queues[model_id] = deque()
        self.queue_sizes[model_id] = queue_size

    def remove_model(self, model_id: str) -> None:
        """A removed model's last trace: its queue is empty and every request of it answered."""
        del self._batch_managers[model_id]
        del self.queues[model_id]
        self.queue_sizes.pop(model_id, None)
        self.service.forget(model_id)

    def check_model(self, model_id: Any) -> None:
        if not isinstance(model_id, str) or model_id not in self.queues:
            raise UnknownModelError(model_id, self.queues)

    def manager(self, model_id: str):
        return self._batch_managers[model_id]

    def prepare(self, model_id: str, data: Any) -> Any:
        """The model's batch manager checks the request and prepares it for batching (no lock held: it may
        tokenize or decode); PayloadError naming the field otherwise."""
        bm = self._batch_managers[model_id]
        prepare = getattr(bm, "prepare", None)  # optional for managers ported from EnergonAI
        validate = getattr(bm, "validate", None)
        try:
            if prepare is not None:
                return prepare(data)
            if validate is not None:
                validate(data)
            return data
        except Exception as exc:  # noqa: BLE001 - whatever the batch manager objects to
            raise PayloadError(f"model {model_id!r}: malformed request: {exc}", getattr(exc, "param", None),
                               str(exc)) from None

    def waiting(self, model_id: str) -> int:
        """Requests of ``model_id`` that wait for a batch: queued, or admitted and being prepared."""
        return len(self.queues[model_id]) + self.preparing[model_id]

    def reserve(self, model_id: str) -> None:
        """A request for ``model_id`` was admitted and goes to be prepared: it holds a place in the queue
        until ``release`` (then ``add``, or its preparation failed)."""
        self.preparing[model_id] += 1

    def release(self, model_id: str) -> None:
        self.preparing[model_id] -= 1
        if self.preparing[model_id] <= 0:
            del self.preparing[model_id]

    def add(self, model_id: str, data: Any, fut: asyncio.Future, loop: asyncio.AbstractEventLoop,
            stream: Optional[asyncio.Queue], adapter: Optional[str] = None) -> int:
        """Queue a prepared request; QueueFullError over the model's ``queue_size`` (the engine's admission
        refuses before: this is the bound itself, for callers that did not reserve)."""
        queue = self.queues[model_id]
        bound = self.queue_sizes.get(model_id, 0)
        if bound and len(queue) >= bound:
            raise QueueFullError(f"model {model_id!r} already has {len(queue)} waiting requests "
                                 f"(queue_size={bound})")
        uid = next(self._uids)
        self._open[model_id] += 1
        self.requests[uid] = Request(uid, model_id, fut, loop, time.perf_counter(), time.time(), stream=stream,
                                     adapter=adapter)
        queue.append(SubmitEntry(uid, data))
        return uid

    def unqueue(self, uid: int, model_id: str) -> None:
        queue = self.queues[model_id]
        for entry in queue:
            if entry.uid == uid:
                queue.remove(entry)
                return

    def forget(self, uid: int) -> Optional[Request]:
        """A cancelled request: gone without an answer (counted as cancelled)."""
        req = self.requests.pop(uid, None)
        if req is not None:
            self._telemetry.counters["requests"][(req.adapter or req.model_id, "cancelled")] += 1
            self._closed(req.model_id)
            self.on_done(req.model_id, time.perf_counter())
        return req

    def _closed(self, model_id: str) -> None:
        self._open[model_id] -= 1
        if self._open[model_id] <= 0:
            del self._open[model_id]

    def busy(self, model_id: str) -> bool:
        """Whether ``model_id`` has requests queued, running or being prepared."""
        return bool(self._open.get(model_id) or self.preparing.get(model_id))

    def finish(self, uid: int, value: Any = None, error: Optional[BaseException] = None,
               batch_seq: Optional[int] = None) -> None:
        """Answer a request (its value or its error) and record it; unknown uids are ignored."""
        req = self.requests.pop(uid, None)
        if req is None:
            return
        now = time.perf_counter()
        first = req.first_token if req.spec is not None else (now if error is None else None)
        self._telemetry.record(RequestRecord(
            uid, req.model_id, req.submitted, now, batch_uid=batch_seq, error=None if error is None else str(error),
            submitted_wall=req.submitted_wall, first_token=first, n_tokens=len(req.tokens),
            preemptions=req.preemptions, adapter=req.adapter))
        self._telemetry.counters["requests"][(req.adapter or req.model_id, "ok" if error is None else "error")] += 1
        self._closed(req.model_id)
        self.on_done(req.model_id, now)
        if error is None:
            self.service.answered(req.model_id, now, self.busy(req.model_id))
        req.resolve(value, error)

    def fail_queue(self, model_id: str, error: BaseException) -> None:
        queue = self.queues[model_id]
        for entry in list(queue):
            self.finish(entry.uid, error=error)
        queue.clear()

    def fail_all(self, error: BaseException) -> None:
        for uid in list(self.requests):
            self.finish(uid, error=error)
        for queue in self.queues.values():
            queue.clear()

    def oldest_waiting(self, model_id: str) -> Optional[float]:
        queue = self.queues[model_id]
        return self.requests[queue[0].uid].submitted if queue else None
