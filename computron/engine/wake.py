"""A thread that calls the engine back at a time it names: when a step is due to be sent ahead.

``at(t)`` asks for a call at ``t`` (``time.perf_counter``), or sooner where an earlier call is already
asked for; the thread waits on a condition until then (nothing polls), calls ``fn`` without holding its
own lock (``fn`` takes the engine's, under which ``at`` is called), and waits for the next ``at``. It
starts on the first ``at``, so an engine that never sends a step ahead has no such thread; ``stop`` ends it.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

log = logging.getLogger("computron.engine")


class WakeAt:
    def __init__(self, fn: Callable[[], None], name: str):
        self._fn, self._name = fn, name
        self._cond = threading.Condition()
        self._due: Optional[float] = None
        self._stopped = False
        self._thread: Optional[threading.Thread] = None

    def at(self, t: float) -> None:
        with self._cond:
            if self._stopped or (self._due is not None and self._due <= t):
                return
            self._due = t
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                if self._due is None:
                    self._cond.wait()
                    continue
                left = self._due - time.perf_counter()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._due = None
                self._cond.release()
                try:
                    self._fn()
                except Exception:  # noqa: BLE001 - the next call must still come
                    log.exception("%s: the callback failed", self._name)
                finally:
                    self._cond.acquire()
