"""A worker's watchdog on its master: exit, saying why in one line, when the master is gone.

The master broadcasts a ``Keepalive`` whenever it has had no command to send for a heartbeat interval, so a
worker waiting for a command hears something at least that often. A worker that has waited longer than
``EngineConfig.master_timeout_s`` without hearing anything, or whose control plane breaks (the master's
process ended and its connections closed), exits with ``MASTER_GONE_EXIT``: nobody will ever send it
another command, and a raw transport traceback minutes later (when a cut-off network returns) helps nobody.

Time spent executing a command does not count (the master is not expected to speak meanwhile), nor time
this process itself had no CPU (the watchdog woke late). Where the master's process is on this host (its
pid known), a master that runs or waits for a CPU is late, not gone (up to
``EngineConfig.heartbeat_late_limit_s``); a stopped or exited one is gone.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable, Optional

from ..comm import process_probe
from ..comm.process_probe import RUNS, ProcessSample, process_sign

log = logging.getLogger("computron.worker")

MASTER_GONE_EXIT = 3
"""The exit status of a worker that left because its master was gone."""


def exit_master_gone(rank: int, why: str) -> None:
    """Say why in one line, then leave at once: the main thread sits in a receive that never returns."""
    log.error("rank %d: the master is gone (%s): exiting", rank, why)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(MASTER_GONE_EXIT)


class MasterWatch:
    def __init__(self, rank: int, timeout_s: float, late_limit_s: float, interval_s: float,
                 master_pid: Optional[int] = None, probe: Callable[[int], ProcessSample] = process_probe.sample,
                 on_gone: Callable[[int, str], None] = exit_master_gone):
        self.rank = rank
        self.timeout_s = timeout_s
        self.late_limit_s = late_limit_s
        self.interval_s = interval_s
        self.master_pid = master_pid
        self._probe = probe
        self._on_gone = on_gone
        self._since: Optional[float] = None
        """When the command loop began waiting for its next command (None while it executes one)."""
        self._sample: Optional[ProcessSample] = None
        self._late = False
        self._last_tick: Optional[float] = None
        self._stop = threading.Event()

    def waiting(self) -> None:
        self._since = time.perf_counter()

    def heard(self) -> None:
        self._since = None

    def _forgive_own_stall(self, now: float) -> None:
        last, self._last_tick = self._last_tick, now
        since = self._since
        if last is not None and since is not None and now - last > self.timeout_s / 2:
            self._since = min(now, since + (now - last - self.interval_s))

    def verdict(self, now: float) -> Optional[str]:
        """Why the master is gone, or None."""
        self._forgive_own_stall(now)
        since = self._since
        quiet = 0.0 if since is None else now - since
        if quiet <= self.timeout_s / 2:
            self._sample, self._late = None, False
            return None
        if self.master_pid is None:
            look = None
        else:
            look = self._probe(self.master_pid)
            before, self._sample = self._sample, look
            if before is None and quiet <= self.timeout_s:
                return None
        if quiet <= self.timeout_s:
            return None
        sign = None if look is None else process_sign(before, look)
        if sign == RUNS and quiet <= self.late_limit_s:
            if not self._late:
                self._late = True
                log.warning("rank %d: nothing from the master for %.1fs, but its process runs or waits for a CPU "
                            "(a busy machine): waiting up to EngineConfig.heartbeat_late_limit_s=%s", self.rank,
                            quiet, self.late_limit_s)
            return None
        said = f"; its process {sign}" if sign else ""
        return (f"nothing from it, not even a keepalive, for {quiet:.1f}s while waiting for a command "
                f"(EngineConfig.master_timeout_s={self.timeout_s}){said}")

    def start(self) -> threading.Thread:
        def watch():
            while not self._stop.wait(self.interval_s):
                why = self.verdict(time.perf_counter())
                if why is not None:
                    self._on_gone(self.rank, why)
                    return
        thread = threading.Thread(target=watch, name=f"computron-master-watch-{self.rank}", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()

    def broken(self, exc: BaseException) -> None:
        """The control plane failed under the command loop's receive."""
        self._stop.set()
        first = (str(exc).strip().splitlines() or [""])[0]
        self._on_gone(self.rank, f"its connection broke: {type(exc).__name__}: {first[:200]}")
