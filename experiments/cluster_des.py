"""The discrete-event model of G engine groups behind a router (``cluster_sim.py`` drives it).

Each ``TokenGroup`` behaves like one Computron engine group with token-level generation:

- one compute track: a step of one resident model at a time (its running sequences decode one token each;
  sequences admitted in that step prefill in the same forward), ``Costs.step(running, prefill_tokens)``;
  resident models with work take steps in turn (least recently stepped first);
- one copy track: one load at a time, beside the steps of other models (the engine's LOAD is asynchronous on
  the workers); from host memory (``load_host_s``) or, for a model not in the group's host memory, from disk
  (``load_disk_s``). Offloads cost nothing on the way (the engine copies nothing back; a master-side offload
  record mostly measures the wait behind the model's last step). With the engine's ``overlap``, a model that
  loads alone on the devices may step at once: its step ends ``OVERLAP_TAIL`` of a step after its load;
- at most ``max_loaded`` models resident; a waiting model (oldest head first) takes a free slot, else the
  slot of an idle resident model (least recently used), else, under the engine's policy rules
  (``computron.sched.policies``: ``quantum`` by default, as ``EngineConfig``), preempts a running one whose turn is
  over: its sequences pause (KV parked) and resume when it is back;
- host memory (``host_models`` models): an LRU cache of the models loaded (a disk load leaves the model in host
  memory), in which the planner's models (``set_plan``) are pinned: each newly planned model is read from
  disk in the background, one at a time; models leaving the plan stay until their room is needed.

A ``RequestGroup`` is a Ray Serve multiplexing replica: requests in arrival order; the head request's model
is loaded if needed (``Costs.mux_load``; LRU of whole models beyond ``max_loaded``), then the queued requests
of that model (up to ``max_batch``, as ``@serve.batch`` would) run to completion as one batch, streaming
(each request's first token after the batch's first step, its end after its own last token); the next batch
starts when the longest one ends.

Every group pushes a ``GroupState`` to the router ``push_delay_s`` after it changes (coalesced), and the
router's ``finished`` is called as each request ends. Times are seconds of simulated time.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional

from computron.cluster import GroupState
from computron.sched.policies import MIN_TURN_STEPS, POLICY_RULES, Policy

from cluster_costs import Costs


@dataclass
class Request:
    i: int
    t: float
    model: str
    prompt: int
    tokens: int
    left: int = 0
    group: int = -1
    first: Optional[float] = None
    end: Optional[float] = None
    head: float = 0.0
    """When it started waiting for its model's slot: arrival, or when its sequence was paused."""
    tier: str = ""
    """Where its model was on its group when it arrived: resident, loading, queued (work for it waits
    there already), host or disk."""


OVERLAP_TAIL = 0.1
"""Share of a step left to run after the last weights of a loading model arrive (the engine starts each layer
once its weights are there: roughly the last layers' compute; opt models have 12-32 layers)."""


class Clock:
    """The event heap: ``at(t, fn, *args)`` runs ``fn(*args)`` at simulated time ``t``."""

    def __init__(self):
        self.now = 0.0
        self._heap: list = []
        self._n = itertools.count()
        self.stopped = False

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._n), fn, args))

    def run(self) -> None:
        while self._heap and not self.stopped:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(*args)


class _Group:
    """What both kinds of group share: pushes to the router, finishing requests."""

    def __init__(self, idx: int, clock: Clock, costs: Costs, models: List[str], router, on_done, push_delay_s):
        self.idx, self.clock, self.costs, self.router, self.on_done = idx, clock, costs, router, on_done
        self.models = frozenset(models)
        self.push_delay_s = push_delay_s
        self.seq = 0
        self._push_pending = False
        self.queued: Dict[str, int] = {}
        self.step_ewma, self.batch_ewma = costs.step_s, 1.0
        self._load_s = {m: costs.load_host_s for m in models}
        self._disk_s = {m: costs.load_disk_s for m in models}

    def changed(self) -> None:
        if not self._push_pending:
            self._push_pending = True
            self.clock.at(self.clock.now + self.push_delay_s, self._push)

    def _push(self) -> None:
        self._push_pending = False
        self.seq += 1
        self.router.update(self.state())

    def _queue(self, r: Request, tokens: int) -> None:
        self.queued[r.model] = self.queued.get(r.model, 0) + tokens

    def _finish(self, r: Request) -> None:
        r.end = self.clock.now
        self.router.finished(self.idx, r.model, r.tokens)
        self.on_done(r)
        self.changed()


class TokenGroup(_Group):
    def __init__(self, *a, policy: str = "quantum", quantum_s: float = 0.2, push_limits: bool = True, **kw):
        super().__init__(*a, **kw)
        self.push_limits = push_limits
        """Whether its pushes carry ``max_batch`` and ``max_loaded`` (a real group that leaves them out: 0)."""
        self.rules = POLICY_RULES[Policy(policy)](quantum_s, self.costs.ttft_slo_s)
        self.resident: Dict[str, dict] = {}
        self.loading: Optional[str] = None
        self.waiting: Dict[str, Deque[Request]] = {}
        self.busy: Optional[str] = None  # the model whose step runs
        self.plan: set = set()
        self.host: OrderedDict = OrderedDict()  # models in host memory, least recently used first
        self._reading: Deque[str] = deque()
        self._read_busy = False
        self.loads = {"host": 0, "disk": 0}

    # ---- host memory -------------------------------------------------------------------------
    def in_host(self, m: str) -> bool:
        return m in self.host

    def preload(self, models) -> None:
        """Host memory at launch (read before serving): ``models``, as many as fit."""
        for m in list(models)[: self.costs.host_models]:
            self.host[m] = True

    def _make_room(self) -> bool:
        """Drop the least recently used unplanned model from host memory if it is full; False if all are planned."""
        while len(self.host) >= self.costs.host_models:
            victim = next((m for m in self.host if m not in self.plan), None)
            if victim is None:
                return False
            del self.host[victim]
        return True

    def set_plan(self, models) -> None:
        """The planner's models for this group: read from disk in the background (one at a time) those not in
        host memory yet; models that leave the plan stay until their room is needed."""
        self.plan = set(models)
        self._reading = deque(m for m in sorted(self.plan) if m not in self.host)
        self._read_next()
        self.changed()

    def _read_next(self) -> None:
        if self._read_busy or not self._reading:
            return
        m = self._reading.popleft()
        self._read_busy = True
        self.clock.at(self.clock.now + max(0.0, self.costs.load_disk_s - self.costs.load_host_s), self._read_done, m)

    def _read_done(self, m: str) -> None:
        self._read_busy = False
        if m in self.plan and m not in self.host and self._make_room():
            self.host[m] = True
            self.changed()
        self._read_next()

    def _cache_add(self, m: str) -> None:
        """After a disk load the model stays in host memory (engine: the host tier is a cache) if room can be made."""
        if m not in self.host and self._make_room():
            self.host[m] = True
        if m in self.host:
            self.host.move_to_end(m)

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, r: Request) -> None:
        r.group, r.left, r.head = self.idx, r.tokens, self.clock.now
        m = r.model
        r.tier = ("resident" if m in self.resident else "loading" if m == self.loading else
                  "queued" if self.waiting.get(m) else "host" if self.in_host(m) else "disk")
        self.waiting.setdefault(r.model, deque()).append(r)
        self._queue(r, r.tokens)
        self.kick()
        self.changed()

    def kick(self) -> None:
        if self.loading is None:
            self._maybe_load()
        if self.busy is None:
            self._maybe_step()

    def _has_work(self, m: str) -> bool:
        return bool(self.waiting.get(m)) or bool(self.resident.get(m, {}).get("running"))

    def _maybe_load(self) -> None:
        now = self.clock.now
        want = sorted((q[0].head, m) for m, q in self.waiting.items()
                      if q and m not in self.resident and m != self.loading)
        for head, m in want:
            if len(self.resident) < self.costs.max_loaded:
                return self._load(m)
            idle = [v for v, s in self.resident.items() if v != self.busy and not self._has_work(v)]
            if idle:
                self._evict(min(idle, key=lambda v: self.resident[v]["used"]))
                return self._load(m)
            waited = now - head
            victims = [v for v, s in self.resident.items() if v != self.busy and s["running"]
                       and s["steps"] >= MIN_TURN_STEPS and self.rules.may_preempt(waited, now - s["turn"])]
            if victims:
                self._preempt(min(victims, key=lambda v: self.resident[v]["turn"]))
                return self._load(m)

    def _evict(self, v: str) -> None:
        del self.resident[v]

    def _preempt(self, v: str) -> None:
        s = self.resident.pop(v)
        q = self.waiting.setdefault(v, deque())
        for r in reversed(s["running"]):
            r.head = self.clock.now
            q.appendleft(r)

    def _load(self, m: str) -> None:
        tier = "host" if self.in_host(m) else "disk"
        self.loads[tier] += 1
        self.loading = m
        end = self.clock.now + (self.costs.load_host_s if tier == "host" else self.costs.load_disk_s)
        if not self.resident:  # overlap: alone on the devices, it may step while its layers arrive
            self.resident[m] = self._fresh(end)
        self.clock.at(end, self._loaded, m, tier)
        self.changed()

    def _fresh(self, ready: float) -> dict:
        return {"running": [], "used": self.clock.now, "turn": self.clock.now, "steps": 0, "stepped": -1.0,
                "ready": ready}

    def _loaded(self, m: str, tier: str) -> None:
        self.loading = None
        self._cache_add(m)
        if m in self.resident:
            self.resident[m]["ready"] = self.clock.now
        else:
            self.resident[m] = self._fresh(self.clock.now)
        self.changed()
        self.kick()

    def _maybe_step(self) -> None:
        ready = [(s["stepped"], m) for m, s in self.resident.items() if self._has_work(m)]
        if not ready:
            return
        _, m = min(ready)
        s = self.resident[m]
        q = self.waiting.get(m) or deque()
        admit = []
        while q and len(s["running"]) + len(admit) < self.costs.max_batch:
            admit.append(q.popleft())
        prefill = sum(r.prompt for r in admit if r.first is None)
        s["running"].extend(admit)
        if s["steps"] == 0:
            s["turn"] = self.clock.now
        n = len(s["running"])
        dur = self.costs.step(n, prefill)
        self.busy = m
        self.step_ewma += 0.1 * (dur - self.step_ewma)
        self.batch_ewma += 0.1 * (n - self.batch_ewma)
        # a step sent while the model still loads ends after its last layer's weights (and compute)
        end = max(self.clock.now + dur, s["ready"] + OVERLAP_TAIL * dur)
        self.clock.at(end, self._stepped, m)

    def _stepped(self, m: str) -> None:
        self.busy = None
        now = self.clock.now
        s = self.resident[m]
        s["used"] = s["stepped"] = now
        s["steps"] += 1
        keep = []
        for r in s["running"]:
            if r.first is None:
                r.first = now
            r.left -= 1
            self.queued[m] -= 1
            if r.left <= 0:
                self._finish(r)
            else:
                keep.append(r)
        s["running"] = keep
        self.kick()

    def state(self) -> GroupState:
        return GroupState(self.idx, resident=frozenset(self.resident),
                          loading=frozenset([self.loading]) if self.loading else frozenset(),
                          host=frozenset(self.host), served=self.models,
                          queued_tokens=dict(self.queued), load_s=self._load_s, disk_load_s=self._disk_s,
                          step_s=self.step_ewma, batch=self.batch_ewma, seq=self.seq,
                          max_batch=self.costs.max_batch if self.push_limits else 0,
                          max_loaded=self.costs.max_loaded if self.push_limits else 0)


class RequestGroup(_Group):
    """A Ray Serve multiplexing replica serving request by request (see the module docstring)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.queue: Deque[Request] = deque()
        self.resident: OrderedDict = OrderedDict()
        self.busy = False
        self.loads = {"host": 0, "disk": 0}

    def submit(self, r: Request) -> None:
        r.group, r.left, r.head = self.idx, r.tokens, self.clock.now
        r.tier = "resident" if r.model in self.resident else "disk"
        self.queue.append(r)
        self._queue(r, r.tokens)
        self.changed()
        self.kick()

    def kick(self) -> None:
        if self.busy or not self.queue:
            return
        m = self.queue[0].model
        batch = [r for r in self.queue if r.model == m][: self.costs.max_batch]
        ids = {id(r) for r in batch}
        self.queue = deque(r for r in self.queue if id(r) not in ids)
        t = self.clock.now
        if m not in self.resident:
            while len(self.resident) >= self.costs.max_loaded:
                self.resident.popitem(last=False)
            t += self.costs.mux_load
            self.loads["disk"] += 1
        self.resident[m] = True
        self.resident.move_to_end(m)
        self.busy = True
        self.changed()
        prefill = sum(r.prompt for r in batch)
        ends = sorted(batch, key=lambda r: r.tokens)
        k, alive = 0, len(batch)
        for step in range(1, max(r.tokens for r in batch) + 1):
            t += self.costs.step(alive, prefill if step == 1 else 0)
            if step == 1:
                for r in batch:
                    r.first = t
            while k < len(ends) and ends[k].tokens == step:
                self.clock.at(t, self._done, ends[k])
                k += 1
                alive -= 1
        self.clock.at(t, self._batch_done)

    def _done(self, r: Request) -> None:
        self.queued[r.model] -= r.tokens
        self._finish(r)

    def _batch_done(self) -> None:
        self.busy = False
        self.kick()

    def state(self) -> GroupState:
        return GroupState(self.idx, resident=frozenset(self.resident), served=self.models,
                          queued_tokens=dict(self.queued), load_s=self._load_s, disk_load_s=self._disk_s,
                          step_s=self.step_ewma, batch=self.batch_ewma, seq=self.seq)
