"""Routers to compare the swap-aware one with (pure, same interface as ``policy.Router``).

- ``RoundRobinRouter``: the next alive group that serves the model, in turn, whatever it holds.
- ``StaticRouter``: a fixed placement (model -> groups, e.g. one ``planner.plan`` made once); among the model's
  groups, the one with the fewest queued tokens.
- ``RayMuxRouter``: Ray Serve model multiplexing's rules as its router applies them (``MultiplexMixin`` with
  ``PowerOfTwoChoicesRequestRouter``, Ray 2.x): the candidates are the replicas that report the model loaded;
  when there are none, or the two picked among them are both full, the replicas with the fewest models
  loaded; if those are full too, every replica. Among the candidates, two are picked at random and the one
  with the shorter queue (requests in flight) takes the request; a replica at ``max_ongoing`` requests refuses.
  (Ray backs off and retries until one accepts; here the least-queued replica of all takes it and the request
  waits in its queue.) Replicas evict whole models in LRU order beyond ``max_num_models_per_replica`` and serve
  request by request: that is the groups' behaviour, which the simulator models, not the router's.
  The router's view of which models a replica holds comes from the replicas' pushes, as in Ray.
"""
from __future__ import annotations

import random
from typing import Collection, Dict, List, Mapping, Optional, Sequence

from computron.cluster.policy import GroupState, NoGroupError, Router, _Group

__all__ = ["RoundRobinRouter", "StaticRouter", "RayMuxRouter"]


class RoundRobinRouter(Router):
    """Each model's requests go to the groups that serve it in turn."""

    def __init__(self, n_groups: int):
        super().__init__(n_groups)
        self._next: Dict[str, int] = {}

    def route(self, model_id: str, tokens: int, now: float, exclude: Collection[int] = ()) -> int:
        usable = self._usable(model_id, exclude)
        i = self._next.get(model_id, 0)
        self._next[model_id] = i + 1
        return self._sent(usable[i % len(usable)], model_id, tokens, now)

    def replicas(self, model_id: str) -> List[int]:
        return sorted(i for i, g in self._groups.items() if g.state.alive and model_id in g.state.served)


class StaticRouter(Router):
    """A fixed placement: ``placement[model]`` lists the groups that serve it; the least queued one of those
    takes each request. A model left out of ``placement`` may go to any group that serves it."""

    def __init__(self, n_groups: int, placement: Mapping[str, Sequence[int]]):
        super().__init__(n_groups)
        bad = {m: list(gs) for m, gs in placement.items() if not gs or any(not 0 <= g < n_groups for g in gs)}
        if bad:
            raise ValueError(f"placement: each model needs groups in 0..{n_groups - 1}; got {bad}")
        self.placement = {m: list(gs) for m, gs in placement.items()}

    def route(self, model_id: str, tokens: int, now: float, exclude: Collection[int] = ()) -> int:
        usable = self._usable(model_id, exclude)
        placed = self.placement.get(model_id)
        mine = [g for g in usable if placed is None or g.state.group in placed]
        if not mine:
            raise NoGroupError(f"model {model_id!r} is placed on groups {placed}, none of them usable "
                               f"(alive, serving it, not excluded {sorted(exclude) or 'none'})")
        return self._sent(min(mine, key=lambda g: g.total), model_id, tokens, now)

    def replicas(self, model_id: str) -> List[int]:
        alive = sorted(i for i, g in self._groups.items() if g.state.alive and model_id in g.state.served)
        placed = self.placement.get(model_id)
        return alive if placed is None else [g for g in alive if g in placed]


class RayMuxRouter(Router):
    """Ray Serve multiplexing's replica choice (see the module docstring). ``max_ongoing``: Ray's
    ``max_ongoing_requests`` per replica (its default, 5); ``seed``: the random picks'."""

    def __init__(self, n_groups: int, *, max_ongoing: int = 5, seed: int = 0):
        super().__init__(n_groups)
        if max_ongoing < 1:
            raise ValueError(f"max_ongoing={max_ongoing}: must be >= 1")
        self.max_ongoing = max_ongoing
        self._rng = random.Random(seed)
        self._ongoing: Dict[int, int] = {}
        self._loaded: Dict[int, set] = {}
        """Per replica: the models its last push reported, plus those sent to it since (it loads them)."""

    def update(self, state: GroupState) -> None:
        old = self._groups.get(state.group)
        super().update(state)
        if self._groups[state.group] is not old:
            self._loaded[state.group] = set(state.resident) | set(state.loading)

    def finished(self, group: int, model_id: str, tokens: int) -> None:
        super().finished(group, model_id, tokens)
        if self._ongoing.get(group, 0) > 0:
            self._ongoing[group] -= 1

    def _pick_two(self, cands: List[_Group]) -> Optional[_Group]:
        """Power of two choices: two at random, the shorter queue; None when both are full."""
        if len(cands) <= 2:
            two = list(cands)
            self._rng.shuffle(two)
        else:
            two = self._rng.sample(cands, 2)
        ok = [g for g in two if self._ongoing.get(g.state.group, 0) < self.max_ongoing]
        return min(ok, key=lambda g: self._ongoing.get(g.state.group, 0)) if ok else None

    def route(self, model_id: str, tokens: int, now: float, exclude: Collection[int] = ()) -> int:
        usable = self._usable(model_id, exclude)
        held = [g for g in usable if model_id in self._loaded.get(g.state.group, ())]
        chosen = self._pick_two(held) if held else None
        if chosen is None:
            fewest = min(len(self._loaded.get(g.state.group, ())) for g in usable)
            chosen = self._pick_two([g for g in usable if len(self._loaded.get(g.state.group, ())) == fewest])
        if chosen is None:
            chosen = self._pick_two(usable)
        if chosen is None:  # every replica full: Ray would retry with backoff; it waits in the shortest queue
            chosen = min(usable, key=lambda g: self._ongoing.get(g.state.group, 0))
        i = chosen.state.group
        self._ongoing[i] = self._ongoing.get(i, 0) + 1
        self._loaded.setdefault(i, set()).add(model_id)
        return self._sent(chosen, model_id, tokens, now)

    def replicas(self, model_id: str) -> List[int]:
        return sorted(i for i, ms in self._loaded.items() if model_id in ms and self._groups[i].state.alive)
