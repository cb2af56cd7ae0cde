"""A worker's watchdog on its master: leave, saying why in one line, when the master is gone or cut off.

A worker hears from its master in two ways: a command (or the ``Keepalive`` the master broadcasts while it has
none to send), and each heartbeat the worker sends, which completes only once the master's receiver took it.
Heartbeats go out every ``min(heartbeat_timeout_s / 4, 1 s)`` from a thread of their own, so a worker executing
a long command still hears from a live master. A worker that has heard nothing at all for
``EngineConfig.master_timeout_s`` (twice ``heartbeat_timeout_s`` unless set), or whose control plane breaks (the
master's process ended and its connections closed), leaves with ``MASTER_GONE_EXIT``: nobody will send it
another command, and its memory (on a GPU, what a restarted group needs) must not wait for a cut-off network to
come back.

``MasterSilence`` is the policy (no thread, no clock of its own): the deadline, reset by every contact, and
when to look next. Time this process itself had no CPU (the watchdog woke far past its deadline) is not the
master's silence. Where the master's process is on this host (its pid known), a master that runs or waits for
a CPU is late, not gone (up to ``EngineConfig.heartbeat_late_limit_s``); a stopped or exited one is gone.
``MasterWatch`` is the mechanism: one thread asleep on a condition until the deadline, which ends the process
even when the main thread is stuck in a receive that never returns (a collective with a cut-off peer).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable, Optional, Tuple

from ..comm import process_probe
from ..comm.process_probe import RUNS, ProcessSample, process_sign

log = logging.getLogger("computron.worker")

MASTER_GONE_EXIT = 3
"""The exit status of a worker that left because its master was gone."""

CLEANUP_S = 2.0
"""How long a leaving worker's best-effort clean-up may take before the process ends regardless."""


def exit_master_gone(rank: int, why: str, cleanup: Optional[Callable[[], None]] = None, who: str = "rank",
                     cleanup_s: float = CLEANUP_S) -> None:
    """Say why in one line, clean up within ``cleanup_s`` where ``cleanup`` is given, then end the process at
    once: its main thread may sit in a receive that never returns. ``who``: "rank" (a worker) or "group" (an
    engine group on Ray, whose master is the front)."""
    if who == "group":
        log.error("group %d: the front is gone (%s): stopping the engine and exiting", rank, why)
    else:
        log.error("rank %d: the master is gone (%s): exiting", rank, why)
    if cleanup is not None:
        def run():
            try:
                cleanup()
            except Exception:  # noqa: BLE001 - leaving anyway; the process's end frees what this did not
                log.warning("rank %d: clean-up before leaving failed", rank, exc_info=True)
        helper = threading.Thread(target=run, name=f"computron-leave-{rank}", daemon=True)
        helper.start()
        helper.join(cleanup_s)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(MASTER_GONE_EXIT)


class MasterSilence:
    """When the master counts as gone, on the caller's clock: ``heard(now)`` at every contact, ``check(now,
    due)`` at the time the previous check asked for (``due``); it returns why the master is gone (or None) and
    when to check next."""

    def __init__(self, timeout_s: float, late_limit_s: float, now: float, master_pid: Optional[int] = None,
                 probe: Callable[[int], ProcessSample] = process_probe.sample,
                 contacts: str = "no command, no keepalive, no heartbeat taken", start_s: Optional[float] = None):
        self.timeout_s = timeout_s
        self.start_s = timeout_s if start_s is None else max(timeout_s, start_s)
        """The limit until the first contact: a master still starting (its own workers building their shards,
        ``EngineConfig.start_timeout_s``) has not spoken yet."""
        self._heard_once = False
        self.contacts = contacts
        """What did not come, as the verdict words it."""
        self.late_limit_s = late_limit_s
        self.master_pid = master_pid
        self._probe = probe
        self._last = now
        """The last contact with the master."""
        self._sample: Optional[ProcessSample] = None
        """The master process's look at half the timeout (a local master only)."""
        self._late = False

    def heard(self, now: float) -> None:
        self._heard_once = True
        if now > self._last:
            self._last = now

    @property
    def heard_once(self) -> bool:
        return self._heard_once

    @property
    def limit_s(self) -> float:
        return self.timeout_s if self._heard_once else self.start_s

    def first_due(self) -> float:
        return self._last + (self.limit_s / 2 if self.master_pid is not None else self.limit_s)

    def _forgive_own_stall(self, now: float, due: float) -> None:
        """A check far past its due time: this process had no CPU, so its heartbeats could not go out either.
        Now that it runs again, the master gets half the timeout to be heard from before it counts as gone."""
        if now - due > self.limit_s / 2:
            self._last = max(self._last, now - self.limit_s / 2)

    def check(self, now: float, due: float) -> Tuple[Optional[str], float]:
        self._forgive_own_stall(now, due)
        quiet, limit = now - self._last, self.limit_s
        if quiet < limit / 2:
            self._sample, self._late = None, False
            return None, self.first_due()
        before = self._sample
        if self.master_pid is not None and (before is None or quiet >= limit):
            self._sample = self._probe(self.master_pid)
        if quiet < limit:
            return None, self._last + limit
        sign = None if self.master_pid is None else process_sign(before, self._sample)
        if sign == RUNS and quiet <= self.late_limit_s:
            if not self._late:
                self._late = True
                log.warning("nothing from the master for %.1fs, but its process runs or waits for a CPU (a busy "
                            "machine): waiting up to EngineConfig.heartbeat_late_limit_s=%s", quiet,
                            self.late_limit_s)
            return None, now + limit / 4
        said = f"; its process {sign}" if sign else ""
        setting = (f"EngineConfig.master_timeout_s={self.timeout_s:g}" if self._heard_once
                   else f"not once since this process began serving; EngineConfig.start_timeout_s={self.start_s:g}")
        return f"nothing heard from it for {quiet:.1f}s: {self.contacts} ({setting}){said}", now


class MasterWatch:
    """The watchdog thread of one worker: asleep until ``MasterSilence``'s next due time; every contact
    (``heard``) moves the deadline without waking it, except the first, which shortens the limit."""

    def __init__(self, rank: int, silence: MasterSilence,
                 on_gone: Callable[[int, str], None] = exit_master_gone,
                 clock: Callable[[], float] = time.monotonic):
        self.rank = rank
        self.silence = silence
        self._on_gone = on_gone
        self._clock = clock
        self._cond = threading.Condition()
        self._stopped = False
        self._replan = False

    def heard(self) -> None:
        with self._cond:
            first = not self.silence.heard_once
            self.silence.heard(self._clock())
            if first:  # the limit shrinks from the start timeout to the master timeout: plan again
                self._replan = True
                self._cond.notify_all()

    def _watch(self) -> None:
        with self._cond:
            due = self.silence.first_due()
            while True:
                self._cond.wait(max(0.0, due - self._clock()))
                if self._stopped:
                    return
                if self._replan:
                    self._replan = False
                    due = self.silence.first_due()
                    continue
                now = self._clock()
                if now < due:
                    continue
                why, due = self.silence.check(now, due)
                if why is not None:
                    break
        self._on_gone(self.rank, why)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._watch, name=f"computron-master-watch-{self.rank}", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def broken(self, exc: BaseException) -> None:
        """The control plane failed under the command loop's receive."""
        self.stop()
        first = (str(exc).strip().splitlines() or [""])[0]
        self._on_gone(self.rank, f"its connection broke: {type(exc).__name__}: {first[:200]}")
