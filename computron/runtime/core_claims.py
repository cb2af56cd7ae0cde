"""Owner: which cores of this host the pinned workers running on it hold, one lock file per core.

A worker pinned to a core (``EngineConfig.pin_workers``, or a CPU worker with helpers) takes an exclusive
``flock`` on ``core-<n>.lock`` in a folder of this host's temporary directory (or the one ``CLAIMS_ENV`` names)
and keeps it while it lives (the kernel drops it when the process ends, however it ends: nothing to clean up). A
second engine on the same host then pins its worker to another core, or to none, instead of onto the first one's,
where the two would take turns; and a worker's helpers keep to the cores no worker holds.
"""
from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from typing import Dict, List, Sequence

log = logging.getLogger(__name__)

_HELD: Dict[int, int] = {}
"""core -> the open file descriptor whose lock this process holds."""


CLAIMS_ENV = "COMPUTRON_CORE_CLAIMS_DIR"
"""Names the folder of the claims instead: engines given different folders never see each other's claims (a
test's engine does not yield to one another test runs beside it on the same host)."""


def claims_dir() -> str:
    folder = os.environ.get(CLAIMS_ENV) or os.path.join(tempfile.gettempdir(), f"computron-cores-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return folder


def _open(core: int) -> int:
    return os.open(os.path.join(claims_dir(), f"core-{core}.lock"), os.O_RDWR | os.O_CREAT, 0o600)


def claim(order: Sequence[int], count: int) -> List[int]:
    """Lock the first ``count`` cores of ``order`` that no other process holds; returns them (fewer where
    fewer were free: those this call locked are released again, so a caller that cannot pin holds no more
    than it did)."""
    got: List[int] = []
    new: List[int] = []
    for core in order:
        if len(got) == count:
            break
        if core in _HELD:
            got.append(core)
            continue
        try:
            fd = _open(core)
        except OSError as exc:  # no folder to claim in (a read-only /tmp): pinned as if alone on the host
            log.info("core claims are not kept (%s): core %d taken unclaimed", exc, core)
            got.append(core)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        _HELD[core] = fd
        got.append(core)
        new.append(core)
    if len(got) < count:
        release(new)
        return []
    return got


def held_elsewhere(core: int) -> bool:
    """Whether another process holds ``core`` now."""
    if core in _HELD:
        return False
    try:
        fd = _open(core)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops a lock taken just now
    return False


def release(cores: Sequence[int]) -> None:
    for core in cores:
        fd = _HELD.pop(core, None)
        if fd is not None:
            os.close(fd)


__all__ = ["claim", "held_elsewhere", "release", "claims_dir"]
