"""Loads and offloads: sending them with their cause, and putting their outcome into effect.

A load or offload decided by the scheduler goes out here with the reason the
log and the timeline show (a waiting request, an idle model evicted, a model
preempted between tokens). When every rank has answered, the outcome is
recorded (seconds, bytes, the tier it came from), the scheduler is told, and a
failed load fails its model's waiting requests and releases whatever some ranks
did load. The master's view of where each model's shards sit in host memory
(``tier``) is kept from what the ranks report with each load.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, Mapping, Optional

from ..comm import messages as msg
from ..errors import WorkerError
from ..metrics import SwapRecord
from ..sched.scheduler import Action, ActionKind, ModelState, Reason, Scheduler
from .commands import CommandKind, CommandTracker, PendingCommand
from .requests import RequestTable
from .telemetry import Telemetry
from .token_level import TokenLevel

log = logging.getLogger("computron.engine")


class Swaps:
    def __init__(self, scheduler: Scheduler, tracker: CommandTracker, requests: RequestTable,
                 token_level: TokenLevel, telemetry: Telemetry, n_workers: int, host_budget: Optional[int],
                 workers: Iterable[msg.WorkerReady]):
        self._sched = scheduler
        self._tracker = tracker
        self._requests = requests
        self._token_level = token_level
        self._telemetry = telemetry
        self._n_workers = n_workers
        self._host_budget = host_budget
        workers = list(workers)
        self._host_resident: Dict[int, set] = {w.rank: set(w.host_resident) for w in workers
                                               if w.host_resident is not None}
        """Per rank, the models whose shard it holds in host memory, as its last load reported."""
        self.shard_bytes: Dict[str, int] = {m: max(w.host_bytes.get(m, 0) for w in workers)
                                            for w in workers for m in w.host_bytes}
        """Per model (key), its largest shard: the host memory it takes on the rank it takes the most of."""
        self.weight_formats: Dict[str, str] = {m: f for w in workers for m, f in w.weight_formats.items()}
        """Per model (key), how its weights are held (``gguf:Q4_1``, ``int4-g32``, ``float32``...)."""
        self.device_bytes: Dict[str, int] = {}
        """Per model (key), its bytes on the device on the rank holding the most, as its last load left them."""

    def note_host_resident(self, replies: Iterable[Any]) -> None:
        """What the ranks hold in host memory after a model was added or removed, or a host plan set."""
        replies = list(replies)
        for x in replies:
            if getattr(x, "host_resident", None) is not None:
                self._host_resident[x.rank] = set(x.host_resident)
        added = [x for x in replies if isinstance(x, msg.ModelAdded)]
        if added:
            self.shard_bytes[added[0].model_id] = max(x.host_bytes for x in added)
            self.weight_formats[added[0].model_id] = added[0].weight_format
        for x in replies:
            if isinstance(x, msg.ModelRemoved):
                self.shard_bytes.pop(x.model_id, None)
                self.weight_formats.pop(x.model_id, None)

    def tier(self, model_id: str, state: ModelState) -> str:
        """'device' while resident; else 'host' where every rank holds its shard in host memory, 'disk'
        where some rank would read it from its checkpoint first (EngineConfig.host_budget)."""
        if state is not ModelState.OFFLOADED:
            return "device"
        if self._host_budget is None or not self._host_resident:
            return "host"
        return "host" if all(model_id in held for held in self._host_resident.values()) else "disk"

    # ---- out -----------------------------------------------------------------
    def send(self, action: Action, heads: Mapping[str, float], now: float) -> None:
        m = action.model_id
        if action.kind is ActionKind.LOAD:
            cause = (f"its oldest request has waited {(now - heads[m]) * 1e3:.0f} ms" if m in heads
                     else "prefetch")
            log.info("loading %s (%s; resident: %s)", m, cause, self._sched.resident())
            self._tracker.send(CommandKind.LOAD, m, lambda seq: msg.Load(seq, m), start=now, cause=cause)
            return
        target = action.for_model or "another model"
        recompute: tuple = ()
        if action.reason is Reason.PREEMPT:
            recompute = self._token_level.preempt(m, target, self._sched.policy, now)
            cause = f"preempted ({self._sched.policy} policy) for {target}"
        elif action.reason is Reason.KEEP_ALIVE:
            cause = "idle past its keep_alive"
        else:
            why = "least recently used" if self._sched.eviction == "lru" else "lowest expected reload cost"
            cause = f"evicted ({why}) to make room for {target}"
        log.info("offloading %s: %s", m, cause)
        self._tracker.send(CommandKind.OFFLOAD, m, lambda seq: msg.Offload(seq, m, recompute=recompute),
                           start=now, cause=cause, recompute=recompute)

    # ---- back ----------------------------------------------------------------
    def complete(self, p: PendingCommand, now: float, error: Optional[str]) -> None:
        m, kind = p.model_id, p.kind.value
        loaded = p.of_type(msg.Loaded)
        nbytes = sum(x.nbytes for x in loaded)
        tier = "disk" if any(x.tier == "disk" for x in loaded) else "host"
        read_s = max((x.read_s for x in loaded), default=0.0)
        read_bytes = sum(x.read_bytes for x in loaded)
        self.note_host_resident(loaded)
        if loaded:
            self.device_bytes[m] = max(x.model_device_bytes for x in loaded)
        device_bytes = {r: x.device_bytes for r, x in p.replies.items() if hasattr(x, "device_bytes")}
        self._telemetry.record(SwapRecord(kind, m, p.start, now, p.rank_times(), nbytes=nbytes,
                                          device_bytes=device_bytes, error=error,
                                          wall_start=self._telemetry.wall(p.start), cause=p.cause, tier=tier,
                                          read_s=read_s, read_bytes=read_bytes))
        seconds = now - p.start
        if error is None:
            extra = {"tier": tier, "read_s": read_s,
                     "read_gbps": read_bytes / read_s / 1e9 if read_s > 0 else None} if loaded else {}
            self._telemetry.swap_done(m, kind, seconds, nbytes, now, **extra)
        if p.kind is CommandKind.LOAD:
            slowest = max((end - start for start, end in p.rank_times().values()), default=seconds)
            self._loaded(m, seconds, nbytes, error, slowest)
        else:
            self._offloaded(p, seconds, now, error)

    def _loaded(self, m: str, seconds: float, nbytes: int, error: Optional[str], slowest_s: float) -> None:
        """``seconds``: from sending the load to its last reply (it may have waited behind batches in
        flight); ``slowest_s``: the slowest rank's own copy, what the eviction policy's reload cost uses."""
        if error is None:
            log.info("loaded %s in %.3f s (%.3f GB, %.2f GB/s over %d ranks)", m, seconds, nbytes / 1e9,
                     nbytes / seconds / 1e9 if seconds > 0 else 0.0, self._n_workers)
            self._sched.on_loaded(m)
            self._sched.record_load(m, slowest_s, nbytes)
            return
        log.error("loading %s failed: %s", m, error)
        self._sched.on_load_failed(m)
        failure = WorkerError(f"loading model {m!r} failed: {error}")
        self._requests.fail_queue(m, failure)
        self._tracker.send(CommandKind.CLEANUP, m, lambda seq: msg.Offload(seq, m))  # what some ranks did load
        self._token_level.load_failed(m, failure)

    def _offloaded(self, p: PendingCommand, seconds: float, now: float, error: Optional[str]) -> None:
        if error is not None:  # the store releases its buffers even then; say what went wrong
            log.error("offloading %s reported: %s", p.model_id, error)
        else:
            log.info("offloaded %s in %.1f ms", p.model_id, seconds * 1e3)
        self._token_level.offloaded(p, now)
        self._sched.on_offloaded(p.model_id)
