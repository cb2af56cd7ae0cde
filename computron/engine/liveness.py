"""Is every worker still there? Heartbeats, stuck commands, late workers, and the watchdog thread that asks.

Workers send a heartbeat from a thread of their own, saying which command they are executing and for how
long. ``Liveness`` remembers when each rank was last heard from (any reply counts). A rank silent past
``EngineConfig.heartbeat_timeout_s`` is looked at, where its process lives on this host
(``process_probe``): a process that is stopped (SIGSTOP, a debugger) or has exited is dead at once, as is
one that sleeps without running (stuck, or cut off); one that runs or waits on a run queue for a CPU is
*late* (a busy machine starves it): logged once, counted, and given up to
``EngineConfig.heartbeat_late_limit_s``. A rank on another host has no such evidence: silence past the
timeout is death. The report names every silent rank with its host, the longest silent first.

The master's own starvation is not the workers' fault: when the watchdog itself wakes late (its process had
no CPU), the time it missed is not counted as the workers' silence. The thread is started explicitly
(``start``), so an engine can be built and tested without one.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from ..comm import messages as msg
from ..comm import process_probe
from ..comm.process_probe import EXITED, RUNS, SLEEPS, UNKNOWN, ProcessSample, process_sign
from ..comm.process_probe import STOPPED_SIGN as STOPPED

log = logging.getLogger("computron.engine")

_WHY = {EXITED: "its process has exited", STOPPED: "its process is stopped (SIGSTOP or a debugger)",
        SLEEPS: "its process sleeps without running: stuck or cut off"}


def silence_report(silent: List[Tuple[float, int]], signs: Mapping[int, str], hosts: Mapping[int, str],
                   timeout_s: float, late_limit_s: float) -> str:
    """Why the engine dies: every silent rank (``(seconds, rank)``, longest first) with its host and what its
    process showed."""
    parts = []
    for i, (s, r) in enumerate(silent):
        sign = signs.get(r, UNKNOWN)
        why = _WHY.get(sign)
        if sign == RUNS:
            why = f"its process runs, but late past EngineConfig.heartbeat_late_limit_s={late_limit_s}"
        where = f"host {hosts.get(r, '?')}" + (f": {why}" if why else "")
        parts.append(f"rank {r} {'sent no heartbeat ' if i == 0 else ''}for {s:.1f}s ({where})")
    return (f"worker {', '.join(parts)} (EngineConfig.heartbeat_timeout_s={timeout_s}); "
            "it is hung, stopped or gone")


class Liveness:
    def __init__(self, n_workers: int, heartbeat_timeout_s: float, command_timeout_s: float,
                 late_limit_s: float = 300.0, workers: Optional[Mapping[int, msg.WorkerReady]] = None,
                 on_late: Callable[[int], None] = lambda rank: None,
                 probe: Callable[[int], ProcessSample] = process_probe.sample):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.command_timeout_s = command_timeout_s
        self.late_limit_s = late_limit_s
        self.interval_s = min(heartbeat_timeout_s / 4, 0.5)
        now = time.perf_counter()
        self._last_beat: Dict[int, float] = {r: now for r in range(n_workers)}
        workers = workers or {}
        self.hosts = {r: w.host for r, w in workers.items()}
        here = socket.gethostname()
        self._pids = {r: w.pid for r, w in workers.items()
                      if w.host == here and w.pid > 0 and w.pid != os.getpid()}
        """The ranks whose process this host can look at (not the master's own, in attach mode)."""
        self._probe = probe
        self._samples: Dict[int, ProcessSample] = {}
        self._late: Dict[int, float] = {}
        """Ranks reported late, and since when they were silent."""
        self._on_late = on_late
        self._last_check: Optional[float] = None

    @classmethod
    def of(cls, config, n_workers: int, workers: Mapping[int, msg.WorkerReady], late_counter) -> "Liveness":
        """The engine's: ``EngineConfig``'s timeouts; each late episode counted in ``late_counter`` by rank."""
        return cls(n_workers, config.heartbeat_timeout_s, config.command_timeout_s, config.heartbeat_late_limit_s,
                   workers, on_late=lambda rank: late_counter.update((rank,)))

    def heard_from(self, rank: int) -> None:
        self._last_beat[rank] = time.perf_counter()
        if self._late:
            since = self._late.pop(rank, None)
            if since is not None:
                log.info("worker rank %d (host %s) is heard from again after %.1fs of silence", rank,
                         self.hosts.get(rank, "?"), self._last_beat[rank] - since)

    def on_heartbeat(self, beat: msg.Heartbeat) -> Optional[str]:
        """Record the beat; a reason to die if it reports a command stuck past the command timeout."""
        self.heard_from(beat.rank)
        if beat.busy_seq is not None and beat.busy_s > self.command_timeout_s:
            return (f"worker rank {beat.rank} has been executing command {beat.busy_seq} for {beat.busy_s:.0f}s "
                    f"(EngineConfig.command_timeout_s={self.command_timeout_s}); it is stuck")
        return None

    def silent(self, now: float, over_s: float) -> List[Tuple[float, int]]:
        """``(seconds, rank)`` of every rank silent for more than ``over_s``, the longest first."""
        return sorted(((now - seen, r) for r, seen in self._last_beat.items() if now - seen > over_s),
                      key=lambda x: (-x[0], x[1]))

    def _forgive_own_stall(self, now: float) -> None:
        """A watchdog that woke far later than its interval: this process had no CPU; the workers' replies
        may sit unread meanwhile. The time missed does not count as their silence."""
        last, self._last_check = self._last_check, now
        if last is None or now - last <= self.heartbeat_timeout_s / 2:
            return
        missed = now - last - self.interval_s
        log.warning("the master's watchdog woke %.1fs late (this process had no CPU): not counted as the "
                    "workers' silence", missed)
        for r, seen in self._last_beat.items():
            self._last_beat[r] = min(now, seen + missed)

    def _sign(self, rank: int) -> str:
        pid = self._pids.get(rank)
        if pid is None:
            return UNKNOWN
        now = self._probe(pid)
        sign = process_sign(self._samples.get(rank), now)
        self._samples[rank] = now
        return sign

    def verdict(self, now: float) -> Optional[str]:
        """The watchdog's question: a reason for the engine to die, or None (late ranks are only reported)."""
        self._forgive_own_stall(now)
        limit = self.heartbeat_timeout_s
        quiet = {r for _, r in self.silent(now, limit / 2)}
        for r in [r for r in self._samples if r not in quiet]:
            del self._samples[r]
        for r in quiet:  # a first look before the timeout, to tell later whether the process progressed
            if r not in self._samples and r in self._pids:
                self._samples[r] = self._probe(self._pids[r])
        silent = self.silent(now, limit)
        if not silent:
            return None
        signs = {r: self._sign(r) for _, r in silent}
        if all(signs[r] == RUNS and s <= self.late_limit_s for s, r in silent):
            for s, r in silent:
                if r not in self._late:
                    self._late[r] = now - s
                    self._on_late(r)
                    log.warning("worker rank %d (host %s) is late: no heartbeat for %.1fs, but its process runs or "
                                "waits for a CPU (a busy machine): given up to "
                                "EngineConfig.heartbeat_late_limit_s=%s", r, self.hosts.get(r, "?"), s,
                                self.late_limit_s)
            return None
        return silence_report(silent, signs, self.hosts, limit, self.late_limit_s)

    def start(self, check: Callable[[float], bool], stopped: threading.Event) -> threading.Thread:
        """Call ``check(now)`` on a timer until it returns False or ``stopped`` is set."""
        def watch():
            while not stopped.wait(self.interval_s):
                if not check(time.perf_counter()):
                    return
        thread = threading.Thread(target=watch, name="computron-watchdog", daemon=True)
        thread.start()
        return thread
