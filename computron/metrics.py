"""Structured records of everything the engine did, for experiments and benchmarks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple


class _Timed:
    """Master-side ``start``/``end`` and per-rank ``rank_times`` of a command sent to every worker."""
    start: float
    end: float
    rank_times: Dict[int, Tuple[float, float]]

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def rank_durations(self) -> Dict[int, float]:
        return {r: b - a for r, (a, b) in self.rank_times.items()}


@dataclass(frozen=True)
class SwapRecord(_Timed):
    kind: str  # "load" or "offload"
    model_id: str
    start: float  # master clock (time.perf_counter) when the command was sent
    end: float  # master clock when the last rank reported
    rank_times: Dict[int, Tuple[float, float]] = field(default_factory=dict)
    """Per rank (start, end) on that rank's clock; on one host the clocks agree."""
    nbytes: int = 0
    """Bytes moved by all ranks together (load only)."""
    device_bytes: Dict[int, int] = field(default_factory=dict)
    """Per rank, bytes held on its device right after the command."""
    error: Optional[str] = None



@dataclass(frozen=True)
class BatchRecord(_Timed):
    model_id: str
    start: float
    end: float
    batch_size: int
    uids: Tuple[int, ...]
    rank_times: Dict[int, Tuple[float, float]] = field(default_factory=dict)
    error: Optional[str] = None
    seq: Optional[int] = None
    """The batch's command number; RequestRecord.batch_uid points here."""
    kind: str = "batch"



@dataclass(frozen=True)
class RequestRecord:
    uid: int
    model_id: str
    submitted: float
    finished: float
    batch_uid: Optional[int] = None
    """``seq`` of the BatchRecord that answered it (None if it never reached a batch)."""
    error: Optional[str] = None
    kind: str = "request"

    @property
    def latency(self) -> float:
        return self.finished - self.submitted
