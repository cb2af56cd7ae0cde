"""Which CPU cores a worker process runs on (``EngineConfig.pin_workers``), policy apart from the call.

``worker_cores`` is the policy (no torch, no system calls): with ``'auto'``, local worker ``r`` of ``n``, each
with ``t`` intra-op threads, gets its own ``t`` cores counted from the end of the cores this process may use,
so that the first core stays free for the master (its event loop, the HTTP server, tokenizing) as vLLM
keeps one for its API server; where the cores do not suffice for that (workers x threads + 1 > cores), no
worker is pinned: pinning two busy processes to one core would make them take turns. ``'off'`` never pins.
``pin`` applies it to the calling thread, before torch starts its intra-op threads (they inherit it).
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence

PIN_MODES = ("off", "auto")


def worker_cores(mode: str, cores: Sequence[int], local_rank: int, local_world: int,
                 threads: int) -> Optional[List[int]]:
    """The cores local worker ``local_rank`` should run on, or None (leave it to the scheduler)."""
    if mode not in PIN_MODES:
        raise ValueError(f"pin_workers={mode!r}: must be one of {PIN_MODES}")
    cores = sorted(cores)
    if mode == "off" or local_world * threads + 1 > len(cores):
        return None
    start = len(cores) - (local_world - local_rank) * threads
    return cores[start:start + threads]


def pin(mode: str, local_rank: int, local_world: int, threads: int) -> Optional[List[int]]:
    """Pin the calling process's thread as ``worker_cores`` says; return the cores (None: not pinned)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    chosen = worker_cores(mode, os.sched_getaffinity(0), local_rank, local_world, threads)
    if chosen:
        os.sched_setaffinity(0, chosen)
    return chosen
