"""What the kernel says about a worker process on this host (Linux ``/proc``), for the liveness watchdog.

One ``ProcessSample`` per look: whether the process still exists, is stopped (SIGSTOP, a debugger) or a
zombie, and two counters summed over its threads from ``/proc/<pid>/task/<tid>/schedstat``: the CPU time
it ran and the time it waited on a run queue for a CPU; ``process_sign`` says what two looks mean. Used by
the master about its workers (``engine.liveness``) and by a worker about its master (``worker.master_watch``).
No torch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

GONE, STOPPED, ZOMBIE, RUNNING = "gone", "stopped", "zombie", "running"


@dataclass(frozen=True)
class ProcessSample:
    state: str
    """``gone``, ``stopped``, ``zombie`` or ``running`` (any other kernel state: running, sleeping, waiting)."""
    cpu_ns: int = 0
    """CPU time run by all its threads."""
    wait_ns: int = 0
    """Time its threads waited on a run queue for a CPU (a starved process's grows, a stopped one's does not)."""
    runnable: bool = False
    """Some thread is runnable (R: waiting for a CPU or on one) or in uninterruptible sleep (D: paging, I/O)."""


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _thread_state(stat: str) -> str:
    """The one-letter state of a ``/proc/.../stat`` line (the name in parentheses may hold spaces)."""
    return stat.rsplit(")", 1)[1].split()[0]


def sample(pid: int, proc: str = "/proc") -> ProcessSample:
    """Look at process ``pid`` now."""
    stat = _read(f"{proc}/{pid}/stat")
    if stat is None:
        return ProcessSample(GONE)
    if _thread_state(stat) in "ZX":
        return ProcessSample(ZOMBIE)
    try:
        tids = os.listdir(f"{proc}/{pid}/task")
    except OSError:
        return ProcessSample(GONE)
    cpu = wait = 0
    runnable = stopped = False
    for tid in tids:
        tstat = _read(f"{proc}/{pid}/task/{tid}/stat")
        if tstat is None:  # the thread ended meanwhile
            continue
        s = _thread_state(tstat)
        stopped |= s in "Tt"
        runnable |= s in "RD"
        sched = _read(f"{proc}/{pid}/task/{tid}/schedstat")
        if sched:
            parts = sched.split()
            cpu += int(parts[0])
            wait += int(parts[1])
    if stopped:
        return ProcessSample(STOPPED, cpu, wait)
    return ProcessSample(RUNNING, cpu, wait, runnable)


EXITED, STOPPED_SIGN, RUNS, SLEEPS, UNKNOWN = "exited", "stopped", "runs", "sleeps", "unknown"


def process_sign(before: Optional[ProcessSample], now: ProcessSample) -> str:
    """What two looks at a silent peer's process say: ``exited``, ``stopped``, ``runs`` (runnable now, or it
    ran or waited for a CPU since ``before``: slow, not dead) or ``sleeps`` (blocked without progress)."""
    if now.state in (GONE, ZOMBIE):
        return EXITED
    if now.state == STOPPED:
        return STOPPED_SIGN
    if now.runnable:
        return RUNS
    if before is not None and before.state == RUNNING and (
            now.cpu_ns > before.cpu_ns or now.wait_ns > before.wait_ns):
        return RUNS
    return SLEEPS


__all__ = ["ProcessSample", "sample", "process_sign", "GONE", "STOPPED", "ZOMBIE", "RUNNING", "EXITED", "RUNS",
           "SLEEPS", "UNKNOWN"]
