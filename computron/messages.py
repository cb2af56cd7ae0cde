"""Typed messages between the master (Engine) and the workers.

Commands go from the master to every worker at once, in one total order that
all workers see; replies go from a worker back to the master. Every command
carries a ``seq`` so replies can be matched to it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, Optional


class Command(enum.Enum):
    LOAD = "load"
    OFFLOAD = "offload"
    RUN = "run"
    STATS = "stats"
    SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class Load:
    seq: int
    model_id: str
    kind = Command.LOAD


@dataclass(frozen=True)
class Offload:
    seq: int
    model_id: str
    kind = Command.OFFLOAD


@dataclass(frozen=True)
class RunBatch:
    seq: int
    model_id: str
    batch: Any
    kind = Command.RUN


@dataclass(frozen=True)
class QueryStats:
    """Ask every worker for its device memory accounting (tests, benchmarks)."""
    seq: int
    kind = Command.STATS


@dataclass(frozen=True)
class Shutdown:
    seq: int = -1
    kind = Command.SHUTDOWN


# ---- worker -> master -------------------------------------------------------


@dataclass(frozen=True)
class WorkerReady:
    rank: int
    pid: int
    host: str
    device: str
    host_bytes: Dict[str, int] = field(default_factory=dict)  # model_id -> shard bytes
    batching: Dict[str, dict] = field(default_factory=dict)
    """model_id -> OPTBatchManager arguments for causal LMs (pad/eos ids, vocabulary, positions)."""


@dataclass(frozen=True)
class WorkerStartFailed:
    rank: int
    error: str


@dataclass(frozen=True)
class Loaded:
    seq: int
    rank: int
    model_id: str
    start: float
    end: float
    nbytes: int
    device_bytes: int


@dataclass(frozen=True)
class Offloaded:
    seq: int
    rank: int
    model_id: str
    start: float
    end: float
    device_bytes: int


@dataclass(frozen=True)
class BatchDone:
    """Sent by every rank; only the output rank carries ``output``."""
    seq: int
    rank: int
    model_id: str
    start: float
    end: float
    output: Any = None
    has_output: bool = False


@dataclass(frozen=True)
class CommandFailed:
    """A command raised on a worker; the worker keeps serving."""
    seq: int
    rank: int
    model_id: Optional[str]
    error: str


@dataclass(frozen=True)
class Bye:
    """A worker's last message after SHUTDOWN: the master stops listening for it."""
    rank: int


@dataclass(frozen=True)
class Stats:
    seq: int
    rank: int
    device_bytes: int
    device_reserved_bytes: int
    host_bytes: int
    resident: tuple
