"""Which CPU cores a worker process runs on (``EngineConfig.pin_workers``), policy apart from the call.

``worker_cores`` is the policy (no torch, no system calls): with ``'auto'``, local worker ``r`` of ``n``, each
with ``t`` intra-op threads, gets its own ``t`` cores counted from the end of the cores this process may use,
so that the first core stays free for the master (its event loop, the HTTP server, tokenizing) as vLLM
keeps one for its API server; where the cores do not suffice for that (workers x threads + 1 > cores), no
worker is pinned: pinning two busy processes to one core would make them take turns. ``'off'`` never pins.
``claim_order`` is the order a worker tries cores in, where another engine's workers on this host may hold some
(``core_claims``; ``process_setup.pin_and_lend`` pins); ``helper_count`` and ``helper_cores`` say how many
idle-priority helper threads a CPU worker lends its products to (``EngineConfig.cpu_helpers``), and where.
"""
from __future__ import annotations

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


def claim_order(cores: Sequence[int], local_rank: int, local_world: int, threads: int) -> List[int]:
    """The cores a worker to be pinned tries to claim (``core_claims``), in order: ``worker_cores``'s choice
    first, then the others from the last; never the first core (the master's)."""
    cores = sorted(cores)
    first = worker_cores("auto", cores, local_rank, local_world, threads) or []
    return first + [c for c in reversed(cores[1:]) if c not in first]


MAX_HELPERS = 4
"""The most helper threads per worker: a product of a few rows is memory-bound, and a few cores fill the bus."""


def helper_count(enabled: bool, cores: int, local_world: int, threads: int) -> int:
    """How many helper threads each of ``local_world`` CPU workers starts for its products
    (``kernels/cpu/gemm.py``): only workers of one intra-op thread have them (with more, oneDNN's threads do the
    work), one per core beyond the workers' own (the master's included: they run at idle priority, so the
    master's event loop always comes first), shared out evenly, at most ``MAX_HELPERS``."""
    if not enabled or threads != 1 or local_world < 1:
        return 0
    return max(0, min(MAX_HELPERS, (cores - local_world * threads) // local_world))


def helper_cores(helpers: int, cores: Sequence[int], mine: Sequence[int], held: Sequence[int]) -> List[int]:
    """The cores a pinned worker's helpers may run on: those neither it (``mine``) nor another worker of this
    host (``held``) holds. A helper must keep off its worker's core: at idle priority it is not moved by the
    kernel's balancing, and a worker waking finds its core "idle" and lands there: the two would take turns."""
    return [c for c in sorted(cores) if c not in mine and c not in held] if helpers else []
