"""The master's start-up read-ahead: while the workers start and import (seconds in which the disk would
sit idle), the kernel is asked to read the checkpoint files they will read first."""
from __future__ import annotations

import os
import threading
from typing import Optional

from ..loading import checkpoint_of
from ..storage.checkpoint import Unsupported, weight_files


def prefetch_startup(model_configs, host_budget: Optional[int], n_workers: int, paper_mode: bool = False):
    """Have the kernel read, in the background (``POSIX_FADV_WILLNEED`` on a thread of its own), the
    checkpoint files the workers read at start-up, while they start and import (seconds in which the
    disk would sit idle): the files of the models read slice-wise, in order, as long as their bytes over
    ``n_workers`` fit in ``host_budget``, at most half the memory available. Returns the thread that asks
    (None when there is nothing to ask for)."""
    if paper_mode:
        return None
    files, total, per_rank = [], 0, 0
    cap = _available_memory() // 2
    for mc in model_configs:
        where = checkpoint_of(mc)
        if where is None:
            continue
        try:
            mine = [(f, os.path.getsize(f)) for f in weight_files(where[0])]
        except (Unsupported, OSError):
            continue
        size = sum(n for _, n in mine)
        per_rank += size // max(1, n_workers)
        if (host_budget is not None and per_rank > host_budget) or total + size > cap:
            break
        files += mine
        total += size
    if not files:
        return None

    def advise():
        for f, n in files:
            try:
                fd = os.open(f, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, n, os.POSIX_FADV_WILLNEED)
            except OSError:  # advice only
                pass
            finally:
                os.close(fd)
    thread = threading.Thread(target=advise, name="computron-prefetch", daemon=True)
    thread.start()
    return thread


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


__all__ = ["prefetch_startup"]
