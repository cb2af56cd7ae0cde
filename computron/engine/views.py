"""What callers can read of the engine: its models and their states, records, counters, the timeline,
snapshots for status pages, and the workers' memory accounting.

``EngineViews`` is the read-only half of ``Engine``'s public API (``core.py`` keeps the state machine and
what changes it). Every view takes the engine's lock, so it sees one consistent state.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any, Callable, Dict, List, Optional

from ..comm import messages as msg
from .commands import CommandKind
from .protocol import EngineSnapshot, ModelSnapshot


class EngineViews:
    @property
    def model_ids(self) -> List[str]:
        """Every served id: models, then LoRA adapters."""
        with self._lock:
            return list(self._catalog.current) + list(self._adapters.base_of)

    @property
    def adapters(self) -> Dict[str, str]:
        """Each served LoRA adapter id -> the id of the model it runs on."""
        with self._lock:
            return dict(self._adapters.base_of)

    def model_states(self) -> Dict[str, str]:
        """Each served id's state (an adapter's is its base's)."""
        with self._lock:
            keys = {**self._catalog.current, **{a: self._adapters.route(a)[0] for a in self._adapters.base_of}}
            return {m: self._sched.state(k).value for m, k in keys.items()}

    # ---- records ---------------------------------------------------------------
    def metrics(self, kind: Optional[str] = None) -> List[Any]:
        """Records of the loads, offloads, batches, steps and requests so far, oldest first
        (the last ``EngineConfig.metrics_history`` of them)."""
        with self._lock:
            return self._telemetry.metrics(kind)

    def add_observer(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(record)`` for every record as it is made (on the engine's threads, under its lock:
        keep it short; an exception is logged and ignored)."""
        with self._lock:
            self._telemetry.add_observer(fn)

    def add_reply_observer(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(reply)`` for every worker reply, heartbeats included, before the engine handles it
        (on the thread that delivers it; keep it short; an exception is logged and ignored)."""
        with self._lock:
            self._telemetry.add_reply_observer(fn)

    def counters(self) -> Dict[str, Dict]:
        """Running totals since start that never expire (for Prometheus counters): ``swaps``,
        ``swap_seconds``, ``swap_bytes`` keyed by (model_id, 'load'|'offload'); ``steps``, ``tokens``,
        ``preemptions`` keyed by model_id; ``requests`` keyed by (model_id, 'ok'|'error'|'cancelled')."""
        with self._lock:
            return self._telemetry.counter_totals()

    def snapshot(self) -> EngineSnapshot:
        """Where every model is and what it is doing, for a status page or a health check."""
        with self._lock:
            models = {}
            planned = self._host_models.keys()
            for m, k in self._catalog.current.items():
                state = self._sched.state(k)
                tb = self._token_level.batches.get(k)
                last = self._telemetry.last_swap[k]
                models[m] = ModelSnapshot(
                    state=state.value, tier=self._swaps.tier(k, state), waiting=len(self._requests.queues[k]),
                    running=len(tb.running) if tb else self._sched.in_flight(k), paused=tb.paused() if tb else 0,
                    token_level=tb is not None, pinned=self._sched.is_pinned(k),
                    last_load=last.get("load"), last_offload=last.get("offload"),
                    version=self._catalog.version(m), draining_versions=len(self._catalog.old_versions(m)),
                    host_plan=k in planned, host_bytes=self._swaps.shard_bytes.get(k, 0),
                    weight_format=self._swaps.weight_formats.get(k, ""), **self._keep_view(k, state))
            for a, base in self._adapters.base_of.items():
                mine = [r for r in self._requests.requests.values() if r.adapter == a]
                running = sum(1 for r in mine if r.spec is not None)
                models[a] = dataclasses.replace(models[base], waiting=len(mine) - running, running=running,
                                                paused=0, base=base, last_load=None, last_offload=None)
            return EngineSnapshot(alive=self._dead is None, dead_reason=self._dead, models=models)

    def _keep_view(self, k: str, state) -> Dict[str, Any]:
        """A model's device bytes (as its ranks measured them at its last load, else its budgeted size), last use
        and keep-alive, for ``computron ps``. Caller holds the lock."""
        last, until = self._keep.last_done(k), self._keep.until(k)
        idle = state.value == "loaded" and not self._requests.busy(k)
        size = self._swaps.device_bytes.get(k) or self._sched.sizes.get(k, 0)
        return {"device_bytes": size if state.value != "offloaded" else 0,
                "last_used": None if last is None else self._telemetry.wall(last), "keep_alive_s": self._keep.keep_s(k),
                "keep_until": self._telemetry.wall(until) if idle and until is not None else None}

    def events(self, since: int = 0):
        """``(cursor, [event, ...])``: timeline events (load, offload, batch, step) with an id above
        ``since``, oldest first; pass the cursor back to get only newer ones."""
        with self._lock:
            return self._telemetry.events(since)

    @property
    def is_alive(self) -> bool:
        return self._dead is None

    @property
    def dead_reason(self) -> Optional[str]:
        return self._dead

    def stats(self, timeout: float = 60.0) -> Dict[int, msg.Stats]:
        """Every worker's device memory accounting, asked for and answered through the control plane
        (blocks the calling thread; ``await engine.stats_async()`` from a loop)."""
        done = threading.Event()
        result: Dict[int, Any] = {}

        def waiter(replies):
            result.update(replies)
            done.set()

        with self._lock:
            self._raise_if_dead()
            self._tracker.send(CommandKind.STATS, None, lambda seq: msg.QueryStats(seq=seq), waiter=waiter)
        if not done.wait(timeout):
            raise TimeoutError(f"workers did not answer a stats query within {timeout}s")
        self._raise_if_dead()
        return result

    async def stats_async(self, timeout: float = 60.0) -> Dict[int, msg.Stats]:
        return await asyncio.get_running_loop().run_in_executor(None, self.stats, timeout)
