"""A worker's host tier under ``EngineConfig.host_budget``: which shards leave host memory for disk, and the
models kept there by plan (``messages.SetHostModels``, sent by ``Engine.set_host_models``).

Host memory caches the shards read from checkpoints: a model read from disk for its load stays there, and
when the budget is short the least recently used shards go back to disk first, the planned ones last of
all. Planned models on disk are read ahead of their next load, in the plan's order, on a thread of their
own (``shard_builder.BackgroundJobs``: one read at a time, at a lower CPU priority), making room only by
sending unplanned copies to disk, never one resident on the device or loading; a planned model with no
such room stays on disk. The command loop (loads, removals) and that thread change which stores hold host
memory under one lock, held for bookkeeping only, never during a read: a step never waits for a read ahead.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Dict, FrozenSet, List, Tuple

import torch

from ..comm import messages as msg
from .shard_builder import BackgroundJobs

log = logging.getLogger("computron.worker")

_NO_ROOM = "no room"


class HostTier:
    """Mixed into ``worker.Worker``: uses its ``rank``, ``device``, ``config``, ``stores``, ``host_pool`` and
    ``channel``; ``_init_host_tier`` runs in its constructor."""

    def _init_host_tier(self) -> None:
        self.host_kept: FrozenSet[str] = frozenset()
        """The models kept in host memory by plan (the last ``SetHostModels``)."""
        self._kept_order: Tuple[str, ...] = ()
        """``host_kept`` in the plan's order: the order of the reads ahead."""
        self._host_lock = threading.Lock()
        """Held by whoever changes which stores hold host memory: the command loop (loads, removals) and the
        read-ahead thread."""
        self._reading_ahead: Dict[str, int] = {}
        """Models being read ahead -> the host bytes their read takes (counted against the budget)."""
        self._building: Dict[str, int] = {}
        """Models being built (at start-up or added while serving) -> the host bytes ``_reserve_host`` let
        their read take, counted until the built store is registered (``_settle_host``)."""
        self._read_ahead = BackgroundJobs(self.rank, what="read-ahead", switch_interval_s=None)

    def _host_used(self) -> int:
        """Host bytes held, or about to be: a store resident on the device holds its whole copy (or is reading
        it on its load thread), a read ahead or a build the copy it is reading. The one count of host memory
        every check against ``host_budget`` makes (call it under ``_host_lock``)."""
        return (sum(s.nbytes if s.resident else s.host_bytes() for s in self.stores.values())
                + sum(self._reading_ahead.values()) + sum(self._building.values()))

    def _reserve_host(self, mid: str, nbytes: int) -> bool:
        """A build's room check (``shard_builder``'s ``host_room``): whether ``nbytes`` more fit in
        ``host_budget`` now; if so they stay counted until ``_settle_host(mid)``, so that a read ahead
        claimed meanwhile cannot take the same room."""
        with self._host_lock:
            budget = self.config.host_budget
            if budget is not None and self._host_used() + nbytes > budget:
                return False
            self._building[mid] = nbytes
            return True

    def _settle_host(self, mid: str) -> None:
        """``mid``'s build is over: its store counts its own bytes from now on (or it failed)."""
        with self._host_lock:
            self._building.pop(mid, None)

    def _to_disk_first(self, exclude) -> List[Tuple[str, object]]:
        """(id, store) of the models whose host copy may go back to disk now, the first to go first:
        unplanned before planned, each least recently used first."""
        return sorted(((m, s) for m, s in self.stores.items() if s.evictable and s is not exclude),
                      key=lambda ms: (ms[0] in self.host_kept, ms[1].last_used))

    def _release_until_fits(self, victims, used: int, need: int, why: str) -> int:
        """Send ``victims``' host copies to disk, in order, until ``need`` more bytes fit ``host_budget``;
        returns the host bytes used then."""
        for name, v in victims:
            if used + need <= self.config.host_budget:
                break
            used -= v.release_host()
            log.info("rank %d: %s leaves host memory for disk (%s)", self.rank, name, why)
        return used

    def _make_host_room(self, mid: str, store) -> None:
        """Before ``mid`` comes from disk for its load (the caller holds ``_host_lock``): send other models
        to disk (``_to_disk_first``) until it fits in ``host_budget``."""
        budget = self.config.host_budget
        if budget is None or store.host_resident:
            return
        # a read ahead of this very model gives its buffers back once it sees the load: the load reads its own
        used = self._host_used() - self._reading_ahead.get(mid, 0)
        used = self._release_until_fits(self._to_disk_first(store), used, store.nbytes, "host LRU, planned last")
        if self.host_pool is not None:  # what the pool keeps besides the buffers this model will reuse
            self.host_pool.trim(max(0, budget - used - store.nbytes), keep_for=store.host_numels)
        if used + store.nbytes > budget:
            log.warning("rank %d: %s needs %.1f MB of host memory but only %.1f MB of host_budget is free "
                        "(the rest is resident or loading): it goes over the budget", self.rank, mid,
                        store.nbytes / 2**20, max(0, budget - used) / 2**20)

    # ---- the plan ------------------------------------------------------------
    def _on_set_host_models(self, cmd: msg.SetHostModels) -> None:
        t0 = time.perf_counter()
        self._kept_order = tuple(m for m in dict.fromkeys(cmd.model_ids) if m in self.stores)
        self.host_kept = frozenset(self._kept_order)
        if self.config.host_budget is None:  # every shard stays in host memory anyway
            self._reply_kept(cmd.seq, t0)
            return
        self._read_ahead.submit(lambda: self._read_planned(cmd.seq, t0))

    def _read_planned(self, seq: int, t0: float) -> None:
        """On the read-ahead thread: read the planned models that are on disk while there is room, then
        answer. Each read takes the plan in force when it starts (a newer command's, if one came since)."""
        read: List[str] = []
        no_room: List[str] = []
        failed: Dict[str, str] = {}
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # before pinning host memory (a thread starts on device 0)
            for mid in self._kept_order:
                with self._host_lock:
                    store = self._claim_read_ahead(mid)
                if store is _NO_ROOM:
                    no_room.append(mid)
                elif store is not None and self._read_into_host(mid, store, failed):
                    read.append(mid)
        except Exception as exc:  # noqa: BLE001 - a bug: said to the master, the rank keeps serving
            log.exception("rank %d: reading planned models ahead failed", self.rank)
            self.channel.reply(self._failure(seq, None, exc))
            return
        self._reply_kept(seq, t0, read=tuple(read), no_room=tuple(no_room), failed=failed)

    def _claim_read_ahead(self, mid: str):
        """Under ``_host_lock``: the store of ``mid`` to read ahead, with its bytes counted and room made
        for them; None when there is nothing to read; ``_NO_ROOM`` when only models on the device,
        loading, or planned hold the room it needs."""
        store = self.stores.get(mid)
        if mid not in self.host_kept or store is None or store.host_resident or store.resident:
            return None
        victims = [(m, s) for m, s in self._to_disk_first(store) if m not in self.host_kept]
        used = self._host_used()
        if used - sum(s.host_bytes() for _, s in victims) + store.nbytes > self.config.host_budget:
            return _NO_ROOM
        used = self._release_until_fits(victims, used, store.nbytes, f"room for planned {mid}")
        if self.host_pool is not None:
            self.host_pool.trim(max(0, self.config.host_budget - used - store.nbytes), keep_for=store.host_numels)
        self._reading_ahead[mid] = store.nbytes
        return store

    def _read_into_host(self, mid: str, store, failed: Dict[str, str]) -> bool:
        """Read ``store``'s shard from its checkpoint and make it its host copy, unless a load or a removal
        came first (then the buffers go back). False when it did not become the host copy."""
        try:
            try:
                host, seconds, nbytes = store.read_host_copy()
            except Exception as exc:  # noqa: BLE001 - the model's next load reads (and reports) again
                failed[mid] = f"{type(exc).__name__}: {exc}"
                log.warning("rank %d: reading planned %s ahead failed: %s", self.rank, mid, failed[mid])
                return False
            with self._host_lock:
                if self.stores.get(mid) is store and not store.resident and not store.host_resident:
                    store.adopt_host(host)
                    log.info("rank %d read planned %s ahead of its load: %.1f MB in %.2fs", self.rank, mid,
                             nbytes / 2**20, seconds)
                    return True
                store.give_host(host)
                return False
        finally:
            with self._host_lock:
                self._reading_ahead.pop(mid, None)

    def _reply_kept(self, seq: int, t0: float, **outcome) -> None:
        self.channel.reply(msg.HostModelsSet(seq=seq, rank=self.rank, start=t0, end=time.perf_counter(),
                                             host_resident=self.host_resident(), **outcome))

    def _close_host_tier(self, timeout: float) -> None:
        """Shutting down: the read in hand ends (within ``timeout``), the others are dropped."""
        self._read_ahead.close(timeout)
