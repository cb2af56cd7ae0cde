"""Lowering the CPU priority of one thread (Linux: every thread has a nice value of its own).

Threads that do background work in a process whose other threads serve (the master's preparation threads,
a worker's builds of models added while serving) lower their own priority, so that on a machine whose
cores are busy the serving threads go first and only the background work waits.
"""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("computron")

NICENESS = 10
"""How much lower than the process's other threads background work runs (a nice increment)."""


def lower_this_thread(what: str) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
    except (AttributeError, OSError) as exc:  # not Linux, or not allowed: the work still gets done
        log.debug("%s keeps the default priority: %s", what, exc)
