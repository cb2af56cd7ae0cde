"""What the front knows of its groups, from their pushes: each group's last ``GroupUpdate``, whether it is
up, why not, how often Ray restarted it; and the server's views merged over the groups (``snapshot``,
``counters``, ``events``). Plain data, no Ray: ``ClusterEngine`` (``front.py``) calls it under its lock.
"""
from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ..engine.protocol import ClusterModelSnapshot, ClusterSnapshot, EngineSnapshot, ModelSnapshot
from ..errors import EngineDeadError
from .groups import GroupUpdate

log = logging.getLogger("computron.cluster")

EVENT_HISTORY = 2000
_STATES = ("loaded", "loading", "offloading", "offloaded")  # best first
_TIERS = ("device", "host", "disk")


class GroupDied(EngineDeadError):
    """The group serving a call died before answering it."""

    def __init__(self, group: int, reason: str):
        super().__init__(f"engine group {group} died: {reason}")
        self.group = group
        self.reason = reason


def short_error(exc: BaseException) -> str:
    """An exception's type and first line (Ray's own messages run to dozens of lines)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def add_counters(a: Dict[str, Dict], b: Dict[str, Dict]) -> Dict[str, Dict]:
    """Two ``Engine.counters()`` summed key by key."""
    out = {k: dict(v) for k, v in a.items()}
    for name, vals in b.items():
        tgt = out.setdefault(name, {})
        for key, v in vals.items():
            tgt[key] = tgt.get(key, 0) + v
    return out


def merge_model(per_group: Dict[int, ModelSnapshot]) -> ClusterModelSnapshot:
    """One model over the groups that serve it: the best state and tier, queues summed, the latest swaps;
    ``host_plan`` where some group keeps it in host memory by plan (each group's snapshot says which)."""
    snaps = list(per_group.values())
    best = min(snaps, key=lambda s: _STATES.index(s.state) if s.state in _STATES else 9)
    lasts = {k: [getattr(s, k) for s in snaps if getattr(s, k)] for k in ("last_load", "last_offload")}
    return ClusterModelSnapshot(
        state=best.state, tier=min((s.tier for s in snaps), key=lambda t: _TIERS.index(t) if t in _TIERS else 9),
        waiting=sum(s.waiting for s in snaps), running=sum(s.running for s in snaps),
        paused=sum(s.paused for s in snaps), token_level=any(s.token_level for s in snaps),
        pinned=any(s.pinned for s in snaps),
        **{k: max(v, key=lambda d: d.get("wall_time", 0)) if v else None for k, v in lasts.items()},
        version=max(s.version for s in snaps), draining_versions=sum(s.draining_versions for s in snaps),
        base=best.base, host_plan=any(s.host_plan for s in snaps), host_bytes=max(s.host_bytes for s in snaps),
        groups={i: s.state for i, s in per_group.items()})


class GroupView:
    """The front's picture of one group."""

    def __init__(self):
        self.update: Optional[GroupUpdate] = None
        self.alive = False
        self.gone = False
        """Dead for good: its restarts are spent, or it failed to start."""
        self.reason: Optional[str] = "starting"
        self.incarnation: Optional[str] = None
        self.restarts = 0
        self.seq = 0
        """The front's own push count of this group (a restarted group counts from 0 again)."""
        self.base_counters: Dict[str, Dict] = {}
        """Totals of its earlier incarnations."""
        self.started = threading.Event()
        self.silent = False
        """Taken out of routing by the keepalive (no answer); back when it answers or pushes again."""


class Timeline:
    """The groups' timeline events under ids of the front's own. A group extends its last step event in
    place; every copy received gets a new revision, and ``events(since)`` counts revisions, so an
    extended bar comes again under the same id (the status page replaces events by id)."""

    def __init__(self):
        self._events: "OrderedDict[int, dict]" = OrderedDict()  # front id -> event, by revision
        self._ids: Dict[Tuple[int, str, int], int] = {}
        self._keys: Dict[int, Tuple[int, str, int]] = {}
        self._revs: Dict[int, int] = {}
        self._next_id, self._next_rev = itertools.count(1), itertools.count(1)

    def add(self, group: int, incarnation: str, events: Iterable[dict]) -> None:
        for e in events:
            key = (group, incarnation, e["id"])
            fid = self._ids.get(key)
            if fid is None:
                fid = self._ids[key] = next(self._next_id)
                self._keys[fid] = key
            self._events[fid] = {**e, "id": fid, "group": group}
            self._events.move_to_end(fid)
            self._revs[fid] = next(self._next_rev)
        while len(self._events) > EVENT_HISTORY:
            fid, _ = self._events.popitem(last=False)
            self._ids.pop(self._keys.pop(fid), None)
            self._revs.pop(fid, None)

    def since(self, since: int) -> Tuple[int, List[dict]]:
        out = [e for fid, e in self._events.items() if self._revs[fid] > since]
        return max(max(self._revs.values(), default=since), since), out


class Board:
    """Every group's view and the timeline; not thread-safe (the front's lock guards it)."""

    def __init__(self, n_groups: int):
        self.views = [GroupView() for _ in range(n_groups)]
        self.timeline = Timeline()

    def record(self, i: int, upd: GroupUpdate) -> bool:
        """Group ``i``'s push; True when it comes from a new incarnation (Ray restarted the group)."""
        v = self.views[i]
        restarted = v.incarnation is not None and upd.incarnation != v.incarnation
        if restarted:
            v.restarts += 1
            v.base_counters = add_counters(v.base_counters, v.update.counters)
            log.warning("engine group %d is back (restart %d, incarnation %s)", i, v.restarts, upd.incarnation)
        elif v.silent and upd.state.alive:
            log.warning("engine group %d is back: it pushes again", i)
        if v.alive and not upd.state.alive:
            self._log_down(i, upd.snapshot.dead_reason or "engine dead", "its own push")
        v.update, v.incarnation, v.alive = upd, upd.incarnation, upd.state.alive
        v.reason = None if upd.state.alive else (upd.snapshot.dead_reason or "engine dead")
        v.silent = False
        v.seq += 1
        self.timeline.add(i, upd.incarnation, upd.events)
        v.started.set()
        return restarted

    @staticmethod
    def _log_down(i: int, cause: str, noticed: str, permanent: bool = False) -> None:
        log.error("engine group %d is down%s: %s (noticed by %s)", i, " for good" if permanent else "", cause,
                  noticed)

    def down(self, i: int, reason: Optional[str] = None, permanent: bool = False, noticed: str = "") -> int:
        """Mark group ``i`` down (``reason`` replaces the last one when given); returns its next seq. Logs
        ``engine group N is down: CAUSE`` once per death, whoever noticed it first (``noticed``: a request,
        the keepalive, its push stream)."""
        v = self.views[i]
        if v.alive or v.silent or v.reason == "starting" or (permanent and not v.gone):
            self._log_down(i, reason or v.reason or "unknown cause", noticed or "the front", permanent)
        v.alive = v.silent = False
        v.gone = v.gone or permanent
        if reason is not None:
            v.reason = reason
        if permanent:
            v.started.set()
        v.seq += 1
        return v.seq

    def silence(self, i: int, reason: str) -> Optional[int]:
        """The keepalive got no answer from alive group ``i``: down (logged) and ``silent``; returns the seq
        to push down to the router, or None when it was not up, or when no other group is up (then its
        requests could go nowhere else: on a machine too loaded to answer in time, better late than failed)."""
        v = self.views[i]
        if not v.alive or not any(o.alive for j, o in enumerate(self.views) if j != i):
            return None
        seq = self.down(i, f"silent: {reason}", noticed="the front's keepalive")
        v.silent = True
        return seq

    def revive(self, i: int, incarnation: Any) -> Optional[int]:
        """Silent group ``i`` answered its keepalive again (same incarnation): up again, from its last push;
        returns its next seq, or None when there is nothing to revive."""
        v = self.views[i]
        if not v.silent or v.gone or incarnation != v.incarnation or v.update is None or not v.update.state.alive:
            return None
        v.silent, v.alive, v.reason = False, True, None
        v.seq += 1
        log.warning("engine group %d is back: it answers the front's keepalive again", i)
        return v.seq

    def alive_ids(self) -> List[int]:
        return [i for i, v in enumerate(self.views) if v.alive]

    def reasons(self) -> str:
        return "; ".join(f"group {i}: {'up' if v.alive else v.reason}" for i, v in enumerate(self.views))

    def snapshot(self, model_ids: Iterable[str], alive: bool, dead_reason: Optional[str]) -> ClusterSnapshot:
        per = {i: (v.update.snapshot if v.alive and v.update else EngineSnapshot(False, v.reason))
               for i, v in enumerate(self.views)}
        models = {}
        for m in model_ids:
            here = {i: s.models[m] for i, s in per.items() if s.alive and m in s.models}
            if here:
                models[m] = merge_model(here)
        return ClusterSnapshot(alive=alive, dead_reason=dead_reason, models=models, groups=per,
                               restarts={i: v.restarts for i, v in enumerate(self.views)})

    def counters(self) -> Dict[str, Dict]:
        total: Dict[str, Dict] = {}
        for v in self.views:
            total = add_counters(add_counters(total, v.base_counters), v.update.counters if v.update else {})
        return total

    def states(self) -> Dict[int, Dict[str, Any]]:
        return {i: {"alive": v.alive, "reason": v.reason, "gone": v.gone, "restarts": v.restarts,
                    "incarnation": v.incarnation, "pids": dict(v.update.pids) if v.update else {},
                    "node": v.update.node if v.update else None, "state": v.update.state if v.update else None}
                for i, v in enumerate(self.views)}
