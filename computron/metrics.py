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
    wall_start: float = 0.0
    """``start`` as wall-clock time (time.time())."""
    cause: str = ""
    """Why it happened: which model's request a load serves, which model an eviction makes room for."""
    tier: str = "host"
    """Where the load found the shards: 'host' memory, or 'disk' (read from the checkpoint first, on some rank)."""
    read_s: float = 0.0
    """The longest rank's disk read during a disk-tier load (it overlaps the host-to-device copy)."""
    read_bytes: int = 0
    """Bytes all ranks read from disk for this load."""



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
    wall_start: float = 0.0


@dataclass(frozen=True)
class StepRecord(_Timed):
    """One token-level generation step of one model (every rank ran it)."""
    model_id: str
    start: float
    end: float
    running: int
    """Sequences that got a token in this step (admitted ones included)."""
    admitted: int
    dropped: int
    rank_times: Dict[int, Tuple[float, float]] = field(default_factory=dict)
    error: Optional[str] = None
    seq: Optional[int] = None
    kv_bytes: int = 0
    """KV cache bytes of this model on the output rank after the step."""
    master_s: float = 0.0
    """Master time spent preparing this step and handling its reply (not the forward)."""
    kind: str = "step"
    wall_start: float = 0.0
    prefill_tokens: int = 0
    """Prompt tokens the step's prefill ran (admitted sequences with the same prompt share one row; a paged
    pool's cached prefix is not run)."""



@dataclass(frozen=True)
class PreemptionRecord:
    """A model's turn ended with sequences still running: they paused, and it left the devices."""
    model_id: str
    at: float
    """master clock (perf_counter) when the preemption was decided."""
    for_model: str
    """The model that takes its place."""
    parked: int
    """Sequences whose KV cache went to host memory."""
    recomputed: int
    """Sequences whose KV cache was dropped, to be rebuilt by a prefill on resume."""
    kind: str = "preemption"
    wall_start: float = 0.0


@dataclass(frozen=True)
class KVRecord(_Timed):
    """KV caches moved for preempted sequences: ``kind`` 'kv_offload' (device to host, at the offload)
    or 'kv_restore' (host to device, at the model's first step after it came back); per-rank times."""
    kind: str
    model_id: str
    start: float
    end: float
    nbytes: int
    """Bytes moved by all ranks together."""
    rank_times: Dict[int, Tuple[float, float]] = field(default_factory=dict)
    wall_start: float = 0.0


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
    submitted_wall: float = 0.0
    first_token: Optional[float] = None
    """perf_counter when its first token was produced (token-level generation)."""
    n_tokens: int = 0
    """Tokens it produced (token-level generation)."""
    preemptions: int = 0
    """How often its sequence was paused by a preemption."""
    adapter: Optional[str] = None
    """The LoRA adapter it ran with (``model_id`` is its base's version key)."""

    @property
    def latency(self) -> float:
        return self.finished - self.submitted

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token: from submit to the first token (the whole answer at request level)."""
        return None if self.first_token is None else self.first_token - self.submitted

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first."""
        if self.first_token is None or self.n_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.n_tokens - 1)
