"""What the engine did, for people and dashboards: records, the timeline, counters, snapshots.

``Telemetry`` keeps the bounded list of records (``Engine.metrics``), the event
timeline the status page draws (consecutive steps of one model merged into one
bar), running totals that never expire (``Engine.counters``, for Prometheus),
the last load and offload of each model, and two measured rates the KV-cache
policy reads (KV bytes per model, prefill tokens per second). Observers
registered with ``add_observer`` see every record as it is made, and those
registered with ``add_reply_observer`` every worker reply (``observe_reply``);
a failing observer is logged and never disturbs serving.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, defaultdict, deque
from typing import Any, Callable, Deque, Dict, List, Optional


log = logging.getLogger("computron.engine")

EVENT_HISTORY = 2000


class Telemetry:
    def __init__(self, metrics_history: int):
        self._records: Deque[Any] = deque(maxlen=metrics_history or None)
        self._events: Deque[dict] = deque(maxlen=EVENT_HISTORY)
        self._event_ids = itertools.count(1)
        self.counters: Dict[str, Counter] = {k: Counter() for k in (
            "swaps", "swap_seconds", "swap_bytes", "preemptions", "steps", "tokens", "requests", "late_heartbeats",
            "rejections")}
        self.last_swap: Dict[str, Dict[str, dict]] = defaultdict(dict)
        self.kv_bytes: Dict[str, int] = {}
        """Each model's KV cache bytes on the output rank after its last step."""
        self.prefill_rate: Dict[str, float] = {}
        """Prompt tokens per second of each model's prefills (steps that admitted sequences)."""
        self._observers: List[Callable[[Any], None]] = []
        self._reply_observers: List[Callable[[Any], None]] = []
        self._wall_offset = time.time() - time.perf_counter()

    def wall(self, t: float) -> float:
        """A perf_counter time as wall-clock time."""
        return t + self._wall_offset

    # ---- recording -----------------------------------------------------------
    def add_observer(self, fn: Callable[[Any], None]) -> None:
        self._observers.append(fn)

    def add_reply_observer(self, fn: Callable[[Any], None]) -> None:
        self._reply_observers.append(fn)

    def observe_reply(self, reply: Any) -> None:
        """Show a worker's reply to the reply observers, before the engine handles it."""
        for fn in self._reply_observers:
            try:
                fn(reply)
            except Exception:  # noqa: BLE001 - an observer's bug must not stop serving
                log.exception("a reply observer failed on %s", type(reply).__name__)

    def record(self, rec) -> None:
        """Keep a record, tell the observers, and put timed commands on the timeline."""
        self._records.append(rec)
        for fn in self._observers:
            try:
                fn(rec)
            except Exception:  # noqa: BLE001 - an observer's bug must not stop serving
                log.exception("a metrics observer failed on a %s record", rec.kind)
        if rec.kind in ("load", "offload", "batch", "step"):
            self._add_event(rec)

    def _add_event(self, rec) -> None:
        event = {"id": next(self._event_ids), "kind": rec.kind, "model_id": rec.model_id,
                 "start_wall": self.wall(rec.start), "end_wall": self.wall(rec.end),
                 "seconds": rec.end - rec.start, "error": rec.error}
        if rec.kind == "step":
            last = self._events[-1] if self._events else None
            if last and last["kind"] == "step" and last["model_id"] == rec.model_id and not rec.error:
                last.update(end_wall=event["end_wall"], seconds=event["end_wall"] - last["start_wall"],
                            steps=last.get("steps", 1) + 1, running=rec.running)
                return  # consecutive steps of one model: one timeline bar
            event.update(steps=1, running=rec.running)
        elif rec.kind == "batch":
            event["batch_size"] = rec.batch_size
        else:
            event.update(bytes=rec.nbytes, cause=rec.cause)
        self._events.append(event)

    def swap_done(self, model_id: str, kind: str, seconds: float, nbytes: int, now: float, **extra) -> None:
        key = (model_id, kind)
        self.counters["swaps"][key] += 1
        self.counters["swap_seconds"][key] += seconds
        self.counters["swap_bytes"][key] += nbytes
        self.last_swap[model_id][kind] = {"seconds": seconds, "bytes": nbytes, "wall_time": self.wall(now),
                                          "gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0, **extra}

    def prefill_done(self, model_id: str, prompt_tokens: int, seconds: float) -> None:
        rate = prompt_tokens / seconds
        self.prefill_rate[model_id] = 0.8 * self.prefill_rate.get(model_id, rate) + 0.2 * rate

    # ---- reading -------------------------------------------------------------
    def metrics(self, kind: Optional[str] = None) -> List[Any]:
        return [r for r in self._records if kind is None or r.kind == kind]

    def counter_totals(self) -> Dict[str, Dict]:
        return {k: dict(v) for k, v in self.counters.items()}

    def events(self, since: int = 0):
        out = [e for e in self._events if e["id"] > since]
        cursor = self._events[-1]["id"] if self._events else since
        return max(cursor, since), out
