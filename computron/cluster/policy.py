"""Which engine group serves a request: the swap-aware router (pure: no torch, no Ray, no processes).

Groups push a ``GroupState`` whenever their residency or queues change (``Router.update``); the router never
polls. Between two pushes of a group it keeps its own estimate of what it sent there (``route`` adds the
request's tokens to the group's queue, ``finished`` takes them off), so a burst spreads before the next push
arrives. A push with a ``seq`` not above the last one seen from that group is stale and ignored.

``SwapAwareRouter.route(model, tokens, now)``:

1. The model's *replica set* (the groups the router currently sends it to) is kept per model. A model without
   one gets a first group: one where it is resident, else loading (or has work for it queued: the group
   brings it in anyway), else in host memory, else any; among several groups of the same kind, the one with
   the least expected TTFT (below) plus ``evict_cost`` (on a group whose ``max_loaded`` slots are all taken,
   the reload the evicted model will need: light traffic over several models fills every group's slots
   before it makes one group swap).
2. A request goes to the first replica, in the order (resident, loading, host, other; then age), that is not
   *congested*: where the model's expected queue wait is within its load time from host memory. When every
   replica is congested, the one with the least expected TTFT takes it, unless another group's expected TTFT
   (swap included, and the ``evict_cost`` it puts on a model already there) is lower still: then that group
   becomes one more replica (``replicate``, at most ``max_replicas``) and takes the request.
3. Extra replicas take only what the first non-congested one cannot, so when a burst ends they get nothing;
   a replica that got no request for ``cold_after_s`` leaves the set (its group's own eviction then frees the
   device slot), as long as one remains.

Expected TTFT of a model on a group = its queue wait + the swap it costs there. Queue wait: the group steps
its models with work in turn, so the model's next step comes after one *cycle* (``step_s`` x the models with
work there); if the model already has ``max_batch`` requests in flight there (the router's own count), the new
one waits besides for a slot: (requests over the batch) / batch x (their mean remaining tokens) cycles. Swap:
0 when resident, half a load when loading, else ``load_s`` (in host memory) or ``disk_load_s`` (not),
plus ``MIN_TURN_STEPS`` cycles when every one of its ``max_loaded`` slots holds a model with work (a
preemption must wait for a turn to end). A figure the group did not report is estimated from the other
groups' reports for that model, else from the group's other models, else from the fleet's figures for any
model (a group that has loaded nothing yet is costed like the others, not at a constant), else
``DEFAULT_LOAD_S``.

``expected_wait(group)`` is the time a group needs to drain what it holds: its queued tokens x ``step_s`` /
``batch`` (sequences decoded per step).

Every ``route`` looks at each group once (no per-model scan), so its cost grows with groups, not models.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Collection, Dict, FrozenSet, List, Mapping, Optional

# absolute, and pure (no torch): the turn a model keeps its slot before a waiting one may preempt it
from computron.sched.policies import MIN_TURN_STEPS

__all__ = ["GroupState", "NoGroupError", "Router", "SwapAwareRouter", "DEFAULT_LOAD_S", "DEFAULT_STEP_S", "TIERS"]

DEFAULT_LOAD_S = 1.0
"""The load time assumed for a model no group has reported a figure for (seconds)."""

DEFAULT_STEP_S = 0.02
"""The seconds per step assumed while no group has measured one."""

TIERS = ("resident", "loading", "host", "disk")
"""Where a model is on a group, best first (the index is the tier)."""


class NoGroupError(LookupError):
    """No alive group serves the model (or every one that does was excluded)."""


@dataclass(frozen=True)
class GroupState:
    """What a group pushes whenever its residency or queues change."""
    group: int
    """The group's index, 0 .. n_groups - 1."""
    alive: bool = True
    """False once the group died (it serves nothing until a push says alive again)."""
    resident: FrozenSet[str] = frozenset()
    """Models on its devices."""
    loading: FrozenSet[str] = frozenset()
    """Models being loaded onto its devices."""
    host: FrozenSet[str] = frozenset()
    """Models in its host memory (not on its devices): a load from host, no disk read."""
    served: FrozenSet[str] = frozenset()
    """Every model id the group can serve (registered there)."""
    queued_tokens: Mapping[str, int] = field(default_factory=dict)
    """Per model: tokens still to generate on the group (waiting and running requests)."""
    load_s: Mapping[str, float] = field(default_factory=dict)
    """Per model: expected seconds to load it from host memory on this group (its own records)."""
    disk_load_s: Mapping[str, float] = field(default_factory=dict)
    """Per model: expected seconds to load it from disk (for models not in its host memory)."""
    step_s: float = 0.02
    """Recent seconds per decode step; 0: not measured yet (the router uses the other groups' figures)."""
    seq: int = 0
    """Push counter of this group; a push whose seq is not above the last one seen is ignored."""
    batch: float = 1.0
    """Recent mean sequences decoded per step (tokens per step); ``expected_wait`` divides by it."""
    max_batch: int = 0
    """Sequences one model's step decodes at most (``EngineConfig.max_batch_size``); 0: unknown (no cap)."""
    max_loaded: int = 0
    """Models resident at once (``EngineConfig.max_loaded``); 0: unknown (a free slot assumed)."""


class _Group:
    """The router's view of one group: its last push plus its own estimate of the queue since."""
    __slots__ = ("state", "queued", "total", "active")

    def __init__(self, state: GroupState):
        self.state = state
        self.queued: Dict[str, int] = {m: max(0, int(t)) for m, t in state.queued_tokens.items()}
        self.total = sum(self.queued.values())
        self.active = sum(1 for t in self.queued.values() if t > 0)
        """Models with work queued there."""

    def add(self, m: str, tokens: int) -> None:
        had = self.queued.get(m, 0)
        self.queued[m] = had + tokens
        self.total += tokens
        if had <= 0 < tokens:
            self.active += 1

    def take(self, m: str, tokens: int) -> None:
        had = self.queued.get(m, 0)
        gone = min(had, tokens)  # a push may already have counted the request out: never below zero
        self.queued[m] = had - gone
        self.total -= gone
        if had > 0 and had - gone <= 0:
            self.active -= 1

    def wait(self, step_s: float) -> float:
        return self.total * step_s / max(1.0, self.state.batch)

    def tier(self, m: str) -> int:
        s = self.state
        if m in s.resident:
            return 0
        if m in s.loading or self.queued.get(m, 0) > 0:
            return 1  # work for it waits there: the group brings it in anyway
        return 2 if m in s.host else 3


class Router(abc.ABC):
    """What every router shares: pushes with stale ones ignored, the groups' queue estimates, finish."""

    def __init__(self, n_groups: int):
        if n_groups < 1:
            raise ValueError(f"n_groups={n_groups}: must be >= 1")
        self.n_groups = n_groups
        self._groups: Dict[int, _Group] = {}
        self._now: float = float("-inf")
        self._inflight: Dict[int, Dict[str, int]] = {}
        """Per group and model: requests this router sent there that have not finished (pushes do not reset it)."""

    def update(self, state: GroupState) -> None:
        """A group's push; ignored when stale (``seq`` not above the last one seen from that group)."""
        if not 0 <= state.group < self.n_groups:
            raise ValueError(f"GroupState.group={state.group}: must be in 0..{self.n_groups - 1}")
        old = self._groups.get(state.group)
        if old is not None and state.seq <= old.state.seq:
            return
        self._groups[state.group] = _Group(state)

    def finished(self, group: int, model_id: str, tokens: int) -> None:
        """A request this router sent to ``group`` ended (answered, failed or cancelled)."""
        g = self._groups.get(group)
        if g is not None:
            g.take(model_id, tokens)
        counts = self._inflight.get(group)
        if counts and counts.get(model_id, 0) > 0:
            counts[model_id] -= 1

    def _usable(self, model_id: str, exclude: Collection[int]) -> List[_Group]:
        """Alive groups that serve the model, not excluded; ``NoGroupError`` (naming why) when none."""
        out = [g for i, g in sorted(self._groups.items())
               if g.state.alive and model_id in g.state.served and i not in exclude]
        if not out:
            serving = sorted(i for i, g in self._groups.items() if model_id in g.state.served)
            alive = [i for i in serving if self._groups[i].state.alive]
            raise NoGroupError(
                f"no alive group serves model {model_id!r}: groups that serve it {serving or 'none'}, "
                f"alive {alive or 'none'}, excluded {sorted(exclude) or 'none'} (of {self.n_groups} groups, "
                f"{len(self._groups)} pushed a state)")
        return out

    def _sent(self, g: _Group, model_id: str, tokens: int, now: float) -> int:
        g.add(model_id, tokens)
        counts = self._inflight.setdefault(g.state.group, {})
        counts[model_id] = counts.get(model_id, 0) + 1
        self._now = max(self._now, now)
        return g.state.group

    @abc.abstractmethod
    def route(self, model_id: str, tokens: int, now: float, exclude: Collection[int] = ()) -> int:
        """The group a request of ``tokens`` tokens for ``model_id`` goes to (none of ``exclude``)."""

    @abc.abstractmethod
    def replicas(self, model_id: str) -> List[int]:
        """The groups this router currently sends ``model_id`` to."""

    def expected_wait(self, group: int) -> float:
        """Seconds the group needs to drain what it holds, as the router estimates it."""
        return self._groups[group].wait(self.step_s(group))

    def step_s(self, group: int) -> float:
        """The group's seconds per step: its own figure, else (not measured yet) the mean of the others',
        else ``DEFAULT_STEP_S``."""
        own = self._groups[group].state.step_s
        if own > 0:
            return own
        fleet = [g.state.step_s for g in self._groups.values() if g.state.step_s > 0]
        return sum(fleet) / len(fleet) if fleet else DEFAULT_STEP_S


class SwapAwareRouter(Router):
    """Routes by where the model is (resident, loading, host, disk) and by expected TTFT; replicates a model
    whose queue wait exceeds its load time, and drops a replica when it turns cold."""

    def __init__(self, n_groups: int, *, replicate: bool = True, cold_after_s: float = 30.0,
                 max_replicas: Optional[int] = None):
        super().__init__(n_groups)
        if cold_after_s <= 0:
            raise ValueError(f"cold_after_s={cold_after_s}: must be > 0")
        self.replicate = replicate
        self.cold_after_s = cold_after_s
        self.max_replicas = max_replicas if max_replicas is not None else n_groups
        if self.max_replicas < 1:
            raise ValueError(f"max_replicas={max_replicas}: must be >= 1")
        self._replicas: Dict[str, List[int]] = {}
        self._last: Dict[str, Dict[int, float]] = {}
        """model -> replica -> the latest ``now`` at which it got a request of the model."""

    # ---- costs ---------------------------------------------------------------
    def _load_estimate(self, g: _Group, m: str, disk: bool) -> float:
        """The group's own figure for ``m``, else the fleet's for ``m``, else the group's own for its other
        models, else the fleet's for all models (so a group that has measured nothing yet is costed like
        those that have, not at a constant), else, for a disk load, its host-load estimate; ``DEFAULT_LOAD_S``
        when no group measured anything."""
        def table(o: _Group):
            return o.state.disk_load_s if disk else o.state.load_s
        own = table(g)
        if m in own:
            return float(own[m])
        same = [float(table(o)[m]) for o in self._groups.values() if m in table(o)]
        if same:
            return sum(same) / len(same)
        if own:
            return sum(own.values()) / len(own)
        fleet = [float(v) for o in self._groups.values() for v in table(o).values()]
        if fleet:
            return sum(fleet) / len(fleet)
        if disk:  # no disk figure anywhere: not faster than a host load
            return self._load_estimate(g, m, False)
        return DEFAULT_LOAD_S

    def swap_cost(self, group: int, model_id: str) -> float:
        """Seconds of swap the model costs on ``group``: 0 resident, half a load loading, else a host or disk
        load, plus a wait for a turn to end when every slot holds a model with work."""
        g = self._groups[group]
        tier = g.tier(model_id)
        if tier == 0:
            return 0.0
        load = self._load_estimate(g, model_id, disk=model_id not in g.state.host)
        if tier == 1:
            return load / 2
        s = g.state
        if s.max_loaded and len(s.resident) + len(s.loading) >= s.max_loaded and \
                all(g.queued.get(v, 0) > 0 for v in s.resident):
            load += MIN_TURN_STEPS * self._cycle(g, model_id)
        return load

    def evict_cost(self, group: int) -> float:
        """Seconds a new model costs the models already on ``group`` when every one of its ``max_loaded`` slots
        is taken: the cheapest reload of a resident model the router sends there (it will be wanted back); 0
        with a free slot, an unknown ``max_loaded``, or no resident model routed there."""
        g = self._groups[group]
        s = g.state
        if not s.max_loaded or len(s.resident) + len(s.loading) < s.max_loaded:
            return 0.0
        routed = [v for v in s.resident if group in self._replicas.get(v, ())]
        return min((self._load_estimate(g, v, disk=False) for v in routed), default=0.0)

    def _cycle(self, g: _Group, m: str) -> float:
        """Seconds between two steps of ``m`` on the group: one step of each model with work there."""
        return self.step_s(g.state.group) * (g.active + (0 if g.queued.get(m, 0) > 0 else 1))

    def queue_wait(self, group: int, model_id: str) -> float:
        """Seconds until a new request of the model gets its first step there, once the model is resident."""
        g = self._groups[group]
        cycle = self._cycle(g, model_id)
        n = self._inflight.get(group, {}).get(model_id, 0)
        b = g.state.max_batch
        if not b or n < b:
            return cycle
        per_request = g.queued.get(model_id, 0) / n
        return cycle * (1 + (n - b + 1) / b * per_request)

    def expected_ttft(self, group: int, model_id: str) -> float:
        """Queue wait plus swap cost of a new request of the model on ``group``."""
        return self.queue_wait(group, model_id) + self.swap_cost(group, model_id)

    # ---- routing -------------------------------------------------------------
    def _prune(self, m: str, usable_ids: Collection[int]) -> List[int]:
        """The model's replicas that are usable now; cold ones dropped while another remains."""
        reps = self._replicas.get(m, [])
        last = self._last.setdefault(m, {})
        keep = [r for r in reps if self._now - last.get(r, self._now) <= self.cold_after_s]
        if not keep and reps:
            keep = [max(reps, key=lambda r: last.get(r, self._now))]
        for r in reps:
            if r not in keep:
                last.pop(r, None)
        if keep != reps:
            self._replicas[m] = keep
        return [r for r in keep if r in usable_ids]

    def _models_on(self, group: int) -> int:
        return sum(1 for reps in self._replicas.values() if group in reps)

    def route(self, model_id: str, tokens: int, now: float, exclude: Collection[int] = ()) -> int:
        """The group that should serve this request (see the module docstring). ``tokens``: tokens it asks to
        generate; ``exclude``: groups to avoid (a retry after one died)."""
        usable = self._usable(model_id, exclude)
        self._now = max(self._now, now)
        by_id = {g.state.group: g for g in usable}
        reps = self._prune(model_id, by_id)
        ttft = self.expected_ttft
        if not reps:
            best = min(g.tier(model_id) for g in usable)
            # equal expected TTFTs (every group idle): the group the router gives fewest models to, so that
            # light traffic spreads over the groups instead of filling the first one's slots
            g = min((g for g in usable if g.tier(model_id) == best),
                    key=lambda g: (ttft(g.state.group, model_id) + self.evict_cost(g.state.group),
                                   self._models_on(g.state.group)))
            self._replicas[model_id] = [g.state.group] + [r for r in self._replicas.get(model_id, [])
                                                          if r != g.state.group]
            return self._send(g, model_id, tokens, now)
        order = sorted(reps, key=lambda r: by_id[r].tier(model_id))  # stable: age breaks ties
        for r in order:  # the first replica that is not congested
            g = by_id[r]
            if g.tier(model_id) <= 1 and self.queue_wait(r, model_id) <= self._load_estimate(g, model_id, False):
                return self._send(g, model_id, tokens, now)
        best = min(order, key=lambda r: ttft(r, model_id))
        if self.replicate and len(self._replicas[model_id]) < self.max_replicas:
            others = [g.state.group for g in usable if g.state.group not in reps]
            if others:
                extra = min(others, key=lambda r: ttft(r, model_id) + self.evict_cost(r))
                if ttft(extra, model_id) + self.evict_cost(extra) < ttft(best, model_id):
                    self._replicas[model_id].append(extra)
                    return self._send(by_id[extra], model_id, tokens, now)
        return self._send(by_id[best], model_id, tokens, now)

    def _send(self, g: _Group, m: str, tokens: int, now: float) -> int:
        self._last.setdefault(m, {})[g.state.group] = now
        return self._sent(g, m, tokens, now)

    def replicas(self, model_id: str) -> List[int]:
        """The groups the router currently sends ``model_id`` to, first replica first (cold ones dropped)."""
        alive = {i for i, g in self._groups.items() if g.state.alive}
        return self._prune(model_id, alive)
