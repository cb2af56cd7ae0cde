"""The front's read-only side (``ClusterEngine``'s ``EngineClient`` state): answered from the groups' last
pushes (``board.Board``), never by a call per request; ``metrics`` alone asks the alive groups."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from .board import ClusterSnapshot


class ViewsMixin:
    """Needs ``_lock``, ``_board``, ``_views``, ``_closed``, ``_catalog`` and ``_groups`` (``ClusterEngine``)."""

    # ---- EngineClient: state (from the last pushes) ------------------------------------------------
    @property
    def is_alive(self) -> bool:
        """True while some group serves."""
        with self._lock:
            return not self._closed and any(v.alive for v in self._views)

    @property
    def dead_reason(self) -> Optional[str]:
        with self._lock:
            if self._closed:
                return "the cluster is shut down"
            return None if any(v.alive for v in self._views) else f"every engine group is down: {self._board.reasons()}"

    @property
    def model_ids(self) -> List[str]:
        with self._lock:
            return list(self._catalog)

    def model_states(self) -> Dict[str, str]:
        snap = self.snapshot()
        return {m: s.state for m, s in snap.models.items()}

    def snapshot(self) -> ClusterSnapshot:
        """Each model merged over the alive groups (best state, summed queues; its ``groups`` says which
        group holds it how), and every group's own snapshot under ``groups``."""
        with self._lock:
            return self._board.snapshot(list(self._catalog), self.is_alive, self.dead_reason)

    def counters(self) -> Dict[str, Dict]:
        """Every group's totals summed (each group's earlier incarnations included, so they never go down)."""
        with self._lock:
            return self._board.counters()

    def events(self, since: int = 0) -> Tuple[int, List[Dict[str, Any]]]:
        """Every group's timeline (each event names its ``group``); see ``board.Timeline``."""
        with self._lock:
            return self._board.timeline.since(since)

    def group_states(self) -> Dict[int, Dict[str, Any]]:
        """Per group: alive, why not, restarts, incarnation, worker pids, node, and its last ``GroupState``."""
        with self._lock:
            return self._board.states()

    @property
    def groups(self) -> List[Any]:
        """The groups' actor handles."""
        return list(self._groups)

    def metrics(self, kind: Optional[str] = None, timeout: float = 60.0) -> Dict[int, List[Any]]:
        """Each alive group's records (``Engine.metrics``). Blocks: not from an event loop."""
        import ray
        with self._lock:
            alive = self._board.alive_ids()
        refs = [self._groups[i].metrics.remote(kind) for i in alive]
        return dict(zip(alive, ray.get(refs, timeout=timeout)))
