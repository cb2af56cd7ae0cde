"""Where requests are prepared: a few threads of low CPU priority, apart from the master's own.

A batch manager that tokenizes text or decodes images (``prepare_off_loop``)
prepares each request on one of these threads: never on the caller's event loop,
never under the engine's lock, never on the thread that delivers replies and
heartbeats. On a machine whose cores the workers keep busy, such a burst would
still take CPU time from the master's control threads; these threads lower their
own scheduling priority (``niceness.py``), so the engine's threads go first and
a burst of preparation only waits longer itself.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from ..niceness import lower_this_thread


def _lower_priority() -> None:
    lower_this_thread("request preparation")


def preparation_pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="computron-prepare",
                              initializer=_lower_priority)


class PumpSoon:
    """Runs ``pump`` (under ``lock``) once per event loop, after the tasks ready on that loop now: requests
    submitted together (the n choices of one request) are queued before the step that admits them, and
    sequences with one prompt admitted in one step share its prefill."""

    def __init__(self, pump: Callable[[], None], lock):
        self._pump, self._lock, self._pending = pump, lock, set()

    def soon(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            if loop in self._pending:
                return
            self._pending.add(loop)
        loop.call_soon(self._run, loop)

    def _run(self, loop) -> None:
        with self._lock:
            self._pending.discard(loop)
            self._pump()

    def now(self) -> None:
        """Run ``pump`` now, on the calling thread."""
        with self._lock:
            self._pump()
