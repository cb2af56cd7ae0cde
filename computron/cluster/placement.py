"""Which models each engine group keeps in host memory, re-planned as the traffic changes (issue 21).

``HostPlacement`` is the front's re-planning state, pure (no Ray, no clock of its own: each call says
``now``): the request rates it observes (every routed request, counted with an exponential decay over
``rate_window_s``), what the groups push (their ``host_budget``, each model's largest shard, measured load
times from host and from disk), the plan in force and what each group has been told. ``replan`` calls
``planner.plan(..., previous=<what the groups hold by plan>)`` and returns only the groups whose set
changed; the front sends each its set (``EngineGroup.set_host_models`` -> ``Engine.set_host_models``) and
says how that went (``applied`` / ``failed``).

When: ``next_plan_at`` is asked on every routed request and every push (event-driven, no loop of its
own; when a plan is called for within ``min_interval_s`` of the last, the front sets one timer for the end
of it). A plan is called for once the groups have started (the first plan: equal rates, as at launch), then
when the mix of the rates moved by ``change`` or more since the last plan (total variation distance of the
rate shares: the plan depends on the rates' proportions only), when the inputs changed (a group came up,
went down or came back from a restart with nothing planned, a budget, a model or a first load figure
appeared), or when a group still has to be told (a call failed); never twice within ``min_interval_s``. Groups
without ``host_budget`` keep every shard in host memory: they are left out of the plan, and when none has one
nothing is planned (said once).

``HostPlanning`` is ``ClusterEngine``'s half that drives it: it feeds the placement under the front's lock
and sends the changes from the front's event loop.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Mapping, Optional, Tuple

from .planner import plan

log = logging.getLogger("computron.cluster")

DISK_BYTES_PER_S = 1e9
"""The disk read rate assumed for a model no group has measured a load of (when none has been measured)."""


class DecayedRates:
    """Requests per second per model, each arrival weighing ``exp(-age / window_s)``: for a steady rate r
    the decayed count tends to ``r * window_s``."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._counts: Dict[str, Tuple[float, float]] = {}  # model -> (decayed count, as of when)

    def add(self, model: str, now: float) -> None:
        count, then = self._counts.get(model, (0.0, now))
        self._counts[model] = (count * math.exp(-(now - then) / self.window_s) + 1.0, now)

    def rates(self, now: float) -> Dict[str, float]:
        return {m: c * math.exp(-(now - t) / self.window_s) / self.window_s for m, (c, t) in self._counts.items()}


def shares(rates: Mapping[str, float]) -> Dict[str, float]:
    total = sum(rates.values())
    return {m: r / total for m, r in rates.items()} if total > 0 else {}


def mix_change(a: Mapping[str, float], b: Mapping[str, float]) -> float:
    """Total variation distance between two rate mixes (0: the same proportions, 1: disjoint)."""
    return 0.5 * sum(abs(a.get(m, 0.0) - b.get(m, 0.0)) for m in set(a) | set(b))


@dataclass
class GroupFigures:
    """What a group's last push says of its host memory and its models."""
    host_budget: Optional[int] = None
    sizes: Dict[str, int] = field(default_factory=dict)
    served: FrozenSet[str] = frozenset()
    load_s: Dict[str, float] = field(default_factory=dict)
    disk_load_s: Dict[str, float] = field(default_factory=dict)


class HostPlacement:
    def __init__(self, n_groups: int, *, rate_window_s: float = 30.0, min_interval_s: float = 2.0,
                 change: float = 0.1, max_copies: int = 2):
        self.n_groups = n_groups
        self.min_interval_s = min_interval_s
        self.change = change
        self.max_copies = max_copies
        self.rates = DecayedRates(rate_window_s)
        self.started = False
        """Set by the front once every group has started: no plan before (it would move copies at once)."""
        self.plan: Dict[int, FrozenSet[str]] = {}
        """The plan in force: group -> the models it should keep in host memory."""
        self.told: Dict[int, Optional[FrozenSet[str]]] = {g: None for g in range(n_groups)}
        """What each group has been told and confirmed (None: nothing, or it died or restarted since)."""
        self._figures: Dict[int, GroupFigures] = {}
        self._sending: Dict[int, int] = {}  # group -> the epoch of its call in flight
        self._epoch = [0] * n_groups  # bumped when a group goes down: an answer from before is stale
        self._planned_at = -math.inf
        self._planned_mix: Dict[str, float] = {}
        self._inputs_changed = True
        self._said_no_budget = False

    # ---- what the front observes ---------------------------------------------------------------
    def arrival(self, model: str, now: float) -> None:
        self.rates.add(model, now)

    def observe(self, group: int, host_budget: Optional[int], sizes: Mapping[str, int], served: FrozenSet[str],
                load_s: Mapping[str, float], disk_load_s: Mapping[str, float]) -> None:
        """A push of ``group`` (alive): its figures. Only what can change the plan marks the inputs changed
        (not a new measurement of a load already measured)."""
        old = self._figures.get(group)
        new = GroupFigures(host_budget, {m: int(b) for m, b in sizes.items() if b > 0}, frozenset(served),
                           dict(load_s), dict(disk_load_s))
        if (old is None or old.host_budget != new.host_budget or old.sizes != new.sizes or old.served != new.served
                or set(old.load_s) != set(new.load_s) or set(old.disk_load_s) != set(new.disk_load_s)):
            self._inputs_changed = True
        self._figures[group] = new

    def down(self, group: int) -> None:
        """``group`` died, or came back from a restart (rebuilt: nothing planned, its host copies in launch
        order): it is told again once it is up."""
        self._figures.pop(group, None)
        self.told[group] = None
        self._sending.pop(group, None)
        self._epoch[group] += 1
        self._inputs_changed = True

    # ---- when ----------------------------------------------------------------------------------
    def next_plan_at(self, now: float) -> Optional[float]:
        """When the next plan is due: ``now``, or the end of ``min_interval_s`` after the last one (the caller
        sets a timer for it: the requests that call for a plan may all come before); None when nothing
        calls for one."""
        if not self.started:
            return None
        if not (self._inputs_changed or self._untold() or self._mix_moved(now)):
            return None
        return max(now, self._planned_at + self.min_interval_s)

    def due(self, now: float) -> bool:
        at = self.next_plan_at(now)
        return at is not None and at <= now

    def _mix_moved(self, now: float) -> bool:
        """The rate mix moved by ``change`` since the last plan (never before the first request: the launch
        plan stands; never without a plan: no group has a budget, and that has not changed)."""
        mix = shares(self.rates.rates(now))
        return bool(self.plan) and bool(mix) and mix_change(mix, self._planned_mix) >= self.change

    def _untold(self) -> List[int]:
        """Alive groups not holding the plan in force, with no call in flight."""
        return [g for g, want in self.plan.items()
                if g in self._figures and g not in self._sending and self.told[g] != self._wanted(g, want)]

    def _wanted(self, group: int, models: FrozenSet[str]) -> FrozenSet[str]:
        """What ``group`` is told of its plan: the models it serves (one being added is told once it is)."""
        return frozenset(m for m in models if m in self._figures[group].served)

    # ---- the plan ------------------------------------------------------------------------------
    def replan(self, now: float) -> Dict[int, Tuple[Tuple[str, ...], int]]:
        """Plan again; returns ``{group: (its models busiest first, epoch)}`` for each group to tell (its set
        changed, or it was not told yet): pass the epoch back to ``applied`` / ``failed``."""
        self._planned_at, self._inputs_changed = now, False
        budgets = {g: f.host_budget for g, f in self._figures.items() if f.host_budget is not None}
        if not budgets:
            if self._figures and not self._said_no_budget:
                log.info("host placement: no engine group has a host_budget (every shard stays in host memory); "
                         "nothing to plan")
                self._said_no_budget = True
            return {}
        sizes: Dict[str, int] = {}
        for g in budgets:
            for m, b in self._figures[g].sizes.items():
                sizes[m] = max(b, sizes.get(m, 0))
        measured = {m: r for m, r in self.rates.rates(now).items() if m in sizes and r > 0}
        rates = measured or {m: 1.0 for m in sizes}  # nothing observed yet: equal rates, as at launch
        previous = {g: set(self.told[g] or ()) for g in budgets}
        self.plan = {g: frozenset(ms) for g, ms in plan(rates, sizes, self.disk_extra_s(sizes), budgets,
                                                         previous=previous, max_copies=self.max_copies).items()}
        self._planned_mix = shares(rates)
        log.info("host placement (rates %s): %s", {m: round(r, 3) for m, r in sorted(rates.items())},
                 {g: sorted(ms) for g, ms in sorted(self.plan.items())})
        out = {}
        for g in self._untold():
            order = sorted(self._wanted(g, self.plan[g]), key=lambda m: (-rates.get(m, 0.0), m))
            out[g] = (tuple(order), self._epoch[g])
            self._sending[g] = self._epoch[g]
        return out

    def disk_extra_s(self, sizes: Mapping[str, int]) -> Dict[str, float]:
        """Per model, the seconds a load costs more from disk than from host memory: measured (the mean
        over the groups that measured both), else the disk load alone, else its size at the read rate of
        the measured models (``DISK_BYTES_PER_S`` when none was)."""
        extra: Dict[str, List[float]] = {}
        disk: Dict[str, List[float]] = {}
        for f in self._figures.values():
            for m, d in f.disk_load_s.items():
                disk.setdefault(m, []).append(d)
                if m in f.load_s:
                    extra.setdefault(m, []).append(max(d - f.load_s[m], 0.1 * d))
        measured = {m: sum(v) / len(v) for m, v in extra.items()}
        measured.update({m: sum(v) / len(v) for m, v in disk.items() if m not in measured})
        rates = [sizes[m] / s for m, s in measured.items() if m in sizes and s > 0]
        bytes_per_s = sum(rates) / len(rates) if rates else DISK_BYTES_PER_S
        return {m: measured.get(m, sizes[m] / bytes_per_s) for m in sizes}

    def applied(self, group: int, models: Tuple[str, ...], epoch: int) -> None:
        """``group`` holds ``models`` by plan now (ignored if it went down since the call was sent)."""
        if self._epoch[group] == epoch:
            self.told[group] = frozenset(models)
            self._sending.pop(group, None)

    def failed(self, group: int, epoch: int) -> None:
        """Telling ``group`` failed: it is told again at the next plan."""
        if self._epoch[group] == epoch:
            self._sending.pop(group, None)


class HostPlanning:
    """``ClusterEngine``'s half that re-plans host memory: needs its ``_lock``, ``_loop``, ``_closed``,
    ``_catalog``, ``_placement`` and ``_call``. ``_note_arrival``, ``_observe_for_plan`` and ``_plan_if_due``
    are called under the lock; ``_tell_host_plan`` runs on the front's loop."""

    _plan_scheduled = False

    def host_plan(self) -> Dict[str, Dict[int, List[str]]]:
        """The host placement: per group, the models the plan in force keeps in its host memory (``planned``)
        and those the group confirmed it keeps (``told``; None: nothing yet, or it went down since)."""
        with self._lock:
            p = self._placement
            return {"planned": {g: sorted(ms) for g, ms in p.plan.items()},
                    "told": {g: None if ms is None else sorted(ms) for g, ms in p.told.items()}}

    def _note_arrival(self, model_id: str, now: float) -> None:
        """A routed request, counted for its model (an adapter's for its base: the shards are the base's)."""
        config = self._catalog.get(model_id, (None, 0))[0]
        base = getattr(config, "base", None) if getattr(config, "adapter", None) else None
        self._placement.arrival(base or model_id, now)
        self._plan_if_due(now)

    def _observe_for_plan(self, i: int, upd, served: FrozenSet[str], now: float) -> None:
        """A push of group ``i`` (``served``: the models it holds in the catalog's version)."""
        if not upd.state.alive:
            self._placement.down(i)
            return
        self._placement.observe(i, upd.host_budget, {m: s.host_bytes for m, s in upd.snapshot.models.items()},
                                served, upd.state.load_s, upd.state.disk_load_s)
        self._plan_if_due(now)

    def _plan_if_due(self, now: float) -> None:
        """Plan on the front's loop when the placement says, now or on a timer (one at a time)."""
        if self._closed or self._plan_scheduled:
            return
        at = self._placement.next_plan_at(now)
        if at is None:
            return
        self._plan_scheduled = True
        self._loop.call_soon_threadsafe(self._loop.call_later, max(0.0, at - now), self._plan_hosts)

    def _plan_hosts(self) -> None:
        """Plan, and tell each group whose set changed (concurrently, on the front's loop). Runs on the
        front's loop, or in ``start`` for the first plan."""
        with self._lock:
            self._plan_scheduled = False
            if self._closed:
                return
            changes = self._placement.replan(time.monotonic())
        for g, (models, epoch) in changes.items():
            asyncio.run_coroutine_threadsafe(self._tell_host_plan(g, models, epoch), self._loop)

    async def _tell_host_plan(self, g: int, models: Tuple[str, ...], epoch: int) -> None:
        from .board import short_error
        try:
            await self._call(g, "set_host_models", list(models))
        except Exception as exc:  # noqa: BLE001 - a group down or behind the catalog: told again later
            log.warning("engine group %d: setting its host plan %s failed: %s", g, list(models), short_error(exc))
            with self._lock:
                self._placement.failed(g, epoch)
            return
        with self._lock:
            self._placement.applied(g, models, epoch)
