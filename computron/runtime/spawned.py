"""The worker processes spawn mode started on this node: waiting on them, their exit codes, stopping them."""
from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import threading
import time
from typing import List, Optional

from ..errors import worker_exit_reason

log = logging.getLogger("computron.launch")


class SpawnedWorkers:
    """The worker processes of this node, and the one way to stop them."""

    def __init__(self, procs: List[mp.Process], first_rank: int):
        self.procs = procs
        self.first_rank = first_rank
        self._reaping = threading.Lock()

    def sentinels(self):
        return [p.sentinel for p in self.procs]

    def _exit_code(self, p: mp.Process, timeout: Optional[float]) -> Optional[int]:
        """Reap ``p`` (waiting up to ``timeout``); its exit code, None while it runs. One thread at a time:
        two threads polling one fork-server child both find its status pipe ready, one reads the code and
        the other the pipe's end, which multiprocessing reports as exit code 255."""
        with self._reaping:
            p.join(timeout)
            return p.exitcode

    def stop(self, grace_s: float) -> None:
        """Let the workers exit within ``grace_s``, then SIGKILL them (they ignore SIGTERM and SIGINT:
        the master decides; a stopped process is ended by SIGKILL too)."""
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            if self._exit_code(p, max(0.0, deadline - time.monotonic())) is None:
                if grace_s > 0:
                    log.warning("%s did not exit within %.1fs: killing it", p.name, grace_s)
                p.kill()
        for p in self.procs:
            self._exit_code(p, None)

    def exited(self, wait_s: float) -> Optional[str]:
        """Which worker exited, waiting up to ``wait_s`` for one (a broken connection comes first)."""
        ready = mpc.wait(self.sentinels(), timeout=wait_s)
        for p in self.procs:
            if p.sentinel in ready:
                return worker_exit_reason(self.first_rank + self.procs.index(p), self._exit_code(p, 1))
        return None

    def monitor(self, on_exit) -> None:
        def watch():
            ready = mpc.wait(self.sentinels())
            for p in self.procs:
                if p.sentinel in ready:
                    on_exit(self.first_rank + self.procs.index(p), self._exit_code(p, 5))
                    return
        threading.Thread(target=watch, name="computron-worker-watch", daemon=True).start()
