"""Is every worker still there? Heartbeats, stuck commands, and the watchdog thread that asks.

Workers send a heartbeat from a thread of their own, saying which command they
are executing and for how long. ``Liveness`` remembers when each rank was last
heard from (any reply counts) and turns silence or a stuck command into a
reason for the engine to die. Its watchdog thread is started explicitly
(``start``), so an engine can be built and tested without one.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Dict, Optional

from ..comm import messages as msg


class Liveness:
    def __init__(self, n_workers: int, heartbeat_timeout_s: float, command_timeout_s: float):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.command_timeout_s = command_timeout_s
        now = time.perf_counter()
        self._last_beat: Dict[int, float] = {r: now for r in range(n_workers)}

    def heard_from(self, rank: int) -> None:
        self._last_beat[rank] = time.perf_counter()

    def on_heartbeat(self, beat: msg.Heartbeat) -> Optional[str]:
        """Record the beat; a reason to die if it reports a command stuck past the command timeout."""
        self.heard_from(beat.rank)
        if beat.busy_seq is not None and beat.busy_s > self.command_timeout_s:
            return (f"worker rank {beat.rank} has been executing command {beat.busy_seq} for {beat.busy_s:.0f}s "
                    f"(EngineConfig.command_timeout_s={self.command_timeout_s}); it is stuck")
        return None

    def silent_rank(self, now: float) -> Optional[str]:
        limit = self.heartbeat_timeout_s
        for rank, seen in self._last_beat.items():
            if now - seen > limit:
                return (f"worker rank {rank} sent no heartbeat for {now - seen:.1f}s "
                        f"(EngineConfig.heartbeat_timeout_s={limit}); it is hung, stopped or gone")
        return None

    def start(self, check: Callable[[float], bool], stopped: threading.Event) -> threading.Thread:
        """Call ``check(now)`` on a timer until it returns False or ``stopped`` is set."""
        interval = min(self.heartbeat_timeout_s / 4, 0.5)

        def watch():
            while not stopped.wait(interval):
                if not check(time.perf_counter()):
                    return
        thread = threading.Thread(target=watch, name="computron-watchdog", daemon=True)
        thread.start()
        return thread
