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

from concurrent.futures import ThreadPoolExecutor

from ..niceness import lower_this_thread


def _lower_priority() -> None:
    lower_this_thread("request preparation")


def preparation_pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="computron-prepare",
                              initializer=_lower_priority)
