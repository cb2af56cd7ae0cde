"""What one engine group measures of itself and pushes to the router (pure: no torch, no Ray).

``GroupCosts`` folds the engine's records (``load`` by tier, ``step``) into the moving figures the router's
costs use; ``group_state`` builds the ``GroupState`` of one push from them, the engine's snapshot and its
config. Both serve ``EngineGroup`` (``groups.py``) and are tested apart from it.

From the group's first push the router knows its ``max_loaded`` and ``max_batch`` (the engine's config) and
every load and step the engine did before the group subscribed to it (``GroupCosts.seed`` with the engine's
records so far): a router that saw 0 ("unknown") there assumed a free slot and no batch cap.
"""
from __future__ import annotations

import re
import threading
from collections import Counter
from typing import Any, Dict, Iterable, Mapping

from .policy import GroupState

EWMA = 0.3
"""Weight of the newest measurement in the load, step and batch figures."""

_VERSION_KEY = re.compile(r"^(.*)@v\d+$")


def model_of(key: str) -> str:
    """The model id of an engine version key (``m@v2`` -> ``m``; ids never contain ``@``)."""
    m = _VERSION_KEY.match(key)
    return m.group(1) if m else key


class GroupCosts:
    """A group's measured load, step and batch figures (thread-safe: engine threads record, the actor's
    loop reads)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.load_s: Dict[str, float] = {}
        self.disk_load_s: Dict[str, float] = {}
        self.step_s = 0.0
        """0 until a step is measured: the router then uses the other groups' figure (``GroupState.step_s``)."""
        self.batch = 1.0

    def record(self, rec: Any) -> bool:
        """One engine record; True when it changed a figure."""
        kind = getattr(rec, "kind", None)
        if getattr(rec, "error", None) is not None:
            return False
        with self._lock:
            if kind == "load":
                table = self.disk_load_s if getattr(rec, "tier", "host") == "disk" else self.load_s
                m = model_of(rec.model_id)
                table[m] = rec.duration if m not in table else (1 - EWMA) * table[m] + EWMA * rec.duration
                return True
            if kind == "step":
                self.step_s = rec.duration if not self.step_s else (1 - EWMA) * self.step_s + EWMA * rec.duration
                self.batch = (1 - EWMA) * self.batch + EWMA * max(1, rec.running)
                return True
        return False

    def seed(self, records: Iterable[Any]) -> None:
        """The records the engine made before the group observed it (its start-up's loads), oldest first."""
        for rec in records:
            self.record(rec)

    def figures(self):
        """``(load_s, disk_load_s, step_s, batch)``, copied."""
        with self._lock:
            return dict(self.load_s), dict(self.disk_load_s), self.step_s, self.batch


def group_state(group: int, snap: Any, served: Iterable[str], costs: GroupCosts, queued: Mapping[str, int],
                seq: int, config: Any) -> GroupState:
    """One push's ``GroupState``: ``snap`` the engine's ``EngineSnapshot``, ``config`` its ``EngineConfig``
    (``max_loaded`` None, a byte budget alone, is pushed as 0: unknown)."""
    models = snap.models
    load_s, disk_load_s, step_s, batch = costs.figures()
    return GroupState(
        group=group, alive=snap.alive,
        resident=frozenset(m for m, s in models.items() if s.state == "loaded"),
        loading=frozenset(m for m, s in models.items() if s.state == "loading"),
        host=frozenset(m for m, s in models.items() if s.state in ("offloaded", "offloading") and s.tier == "host"),
        served=frozenset(served), queued_tokens={m: t for m, t in Counter(queued).items() if t > 0},
        load_s=load_s, disk_load_s=disk_load_s, step_s=step_s, seq=seq, batch=batch,
        max_batch=int(config.max_batch_size or 0), max_loaded=int(config.max_loaded or 0))
