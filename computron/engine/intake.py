"""Requests in: admission, preparation and queuing, the half of ``Engine`` that takes a request from a caller.

``Intake`` is a mixin of ``Engine`` (``core.py``), like ``EngineViews``: it reads and changes the engine's
components under its lock. A request is admitted or refused first (``admission.py``: before any work on
it), prepared off the lock while holding its place in its model's queue, then queued for the version its
id names.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from .admission import prompt_tokens


class Intake:
    def check_admission(self, model_id: str, arriving: int = 0) -> None:
        """Raise the refusal a request for ``model_id`` would get now (``QueueFullError``: a full queue, or a
        predicted time to first token over the limit; counted), before any work on it: what the server asks
        right after reading a request's model id; ``arriving``: requests it let through that have not reached
        the engine yet, counted as waiting. UnknownModelError for an id not served."""
        with self._lock:
            self._raise_if_dead()
            key = self._key_of(model_id)[0]
            self._admission.check(key, model_id, arriving=arriving)

    def _key_of(self, model_id: str):
        return self._adapters.route(model_id) or (self._catalog.key_of(model_id), None)

    async def _admit(self, model_id: str, data: Any, fut, loop, stream: Optional[asyncio.Queue] = None) -> int:
        """Admit a request (``Admission``: refused at once, before any work on it, when its model's queue is
        full or it would be late), prepare it for the version its id names now holding its place in the
        queue, and queue it there (checked again with its prompt's length). Should that version be freed
        meanwhile (replaced and drained), prepare it again for the current one."""
        while True:
            with self._lock:
                self._raise_if_dead()
                key, adapter = self._key_of(model_id)
                self._admission.check(key, model_id)
                self._requests.reserve(key)
            try:
                prepared = await self._prepare(key, data)
            except BaseException:
                with self._lock:
                    self._requests.release(key)
                raise
            with self._lock:
                self._requests.release(key)
                self._raise_if_dead()
                if self._catalog.accepts(key) and (adapter is None or self._adapters.route(model_id) is not None):
                    self._admission.check(key, model_id, prompt_tokens(prepared))
                    uid = self._requests.add(key, prepared, fut, loop, stream, adapter=adapter)
                    self._sched.note_arrival(key, time.perf_counter())
                    self._pump_soon.soon(loop)
                    return uid

    async def _prepare(self, key: str, data: Any) -> Any:
        """Validate and prepare a request before it is queued: never under the engine's lock, and on the
        preparation threads (``preparation.py``) for batch managers that tokenize or decode
        (``prepare_off_loop``), so neither the loop nor the thread that delivers replies waits for it."""
        if getattr(self._requests.manager(key), "prepare_off_loop", False):
            return await asyncio.get_running_loop().run_in_executor(self._preparation, self._requests.prepare,
                                                                    key, data)
        return self._requests.prepare(key, data)

