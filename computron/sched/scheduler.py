"""Which model runs next and which one leaves: pure policy, no torch, no processes.

The engine tells the scheduler what happened (``on_loaded``, ``on_offloaded``, ``on_batch_done``,
``on_load_failed``) and asks it what to do next with ``decide(heads)``, where ``heads`` maps each model that
has waiting requests to the arrival time of its oldest one. ``decide`` returns actions in the order they
must be sent to the workers; the workers execute commands in that order, which is what makes queuing an
offload behind a running batch safe.

Rules:
- models are visited oldest head first; a model mid-transition is skipped;
- a resident model gets a batch if it has fewer than ``max_inflight`` in flight, one more if
  ``ahead`` and alone with work (only one once an older model is waiting for a slot, so it drains);
- a model that is not resident is loaded into a free slot, or into the slot of a resident model that has
  nothing in flight (the first in eviction order); a model with batches in flight is never offloaded;
- with ``prefetch``, when every resident model is busy, the first in eviction order whose queue is empty
  gets its offload queued right behind its last batch and the waiting model's load right behind that;
- with ``overlap``, a batch may be sent to a model still loading (the worker starts each layer once its
  weights arrived), only while no other model is resident (workers run commands in order);
- a model fits when the resident count stays within ``max_loaded`` (None: no count cap) and, with a
  ``device_budget``, the resident models' ``sizes`` (bytes per rank, KV reserve included) stay within it;
  idle victims are evicted until the waiting model fits, in the order of the ``eviction`` policy
  (``eviction.py``: least recently used, or lowest expected reload cost); ``pinned`` models are never
  evicted; a higher ``priority`` is visited first and evicted last, whatever the policy;
- a model that has just loaded is not evicted before its first batch;
- token-level generation (``running``: models with live sequences): such a model is never evicted by the
  rules above, only preempted under the policy (``policies.py``: when, and which model goes first).
  Preemption queues the victim's offload behind its step in flight and the waiting model's load right
  behind that; its sequences pause, and resume once it is back.

Models come and go while serving (``add_model``, ``remove_model``, ``set_pinned``, ``set_priority``);
``note_arrival`` and ``record_load`` feed the eviction policy's estimates; ``release`` offloads an idle
model whose keep-alive is up.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Set, Union

# absolute: the purity check allows no package-relative import here
from computron.sched.eviction import EVICTIONS, LruEviction, make_eviction
from computron.sched.policies import (MIN_TURN_STEPS, POLICIES, POLICY_RULES, Action, ActionKind, ModelState,
                                      Policy, Reason, choose_recompute)

__all__ = ["Scheduler", "ModelState", "ActionKind", "Reason", "Action", "MIN_TURN_STEPS", "POLICIES", "EVICTIONS",
           "Policy", "choose_recompute"]

_RESIDENT = (ModelState.LOADING, ModelState.LOADED, ModelState.OFFLOADING)


class Scheduler:
    def __init__(self, model_ids: Iterable[str], max_loaded: Optional[int], *, prefetch: bool = False,
                 overlap: bool = False, max_inflight: int = 2, policy: str = "run_to_completion",
                 quantum_s: float = 0.2, ttft_slo_s: float = 1.0, sizes: Optional[Mapping[str, int]] = None,
                 device_budget: Optional[int] = None, pinned: Iterable[str] = (),
                 priority: Optional[Mapping[str, int]] = None, eviction: Union[str, LruEviction] = "lru"):
        self.model_ids = list(model_ids)
        self._order = {m: i for i, m in enumerate(self.model_ids)}  # ties between equal heads
        if len(set(self.model_ids)) != len(self.model_ids):
            raise ValueError("model ids must be unique")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded={max_loaded}: must be >= 1 or None")
        if max_loaded is None and device_budget is None:
            raise ValueError("max_loaded=None needs a device_budget")
        if max_inflight < 1:
            raise ValueError(f"max_inflight={max_inflight}: must be >= 1")
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: must be one of {POLICIES}")
        self.rules = POLICY_RULES[Policy(policy)](quantum_s, ttft_slo_s)
        self.max_loaded, self.prefetch, self.overlap, self.max_inflight = max_loaded, prefetch, overlap, max_inflight
        self.policy, self.quantum_s, self.ttft_slo_s = Policy(policy).value, quantum_s, ttft_slo_s
        self.sizes = {m: int((sizes or {}).get(m, 0)) for m in self.model_ids}
        self.device_budget = device_budget
        self.pinned: Set[str] = set(pinned)
        self.priority = {m: int((priority or {}).get(m, 0)) for m in self.model_ids}
        if device_budget is not None:
            too_big = {m: b for m, b in self.sizes.items() if b > device_budget}
            if too_big:
                raise ValueError(f"device_budget={device_budget} bytes per rank cannot hold "
                                 + ", ".join(f"model {m!r} ({b} bytes per rank with its KV reserve)"
                                             for m, b in too_big.items()))
        self.states: Dict[str, ModelState] = {m: ModelState.OFFLOADED for m in self.model_ids}
        self.inflight: Dict[str, int] = {m: 0 for m in self.model_ids}
        self._eviction = make_eviction(eviction, self.sizes)
        self.eviction = self._eviction.name
        for m in self.model_ids:
            self._eviction.add(m)
        self._now: Optional[float] = None  # the latest caller's clock seen (decide, arrivals): for the eviction
        self._slot_promised: Dict[str, str] = {}  # victim -> model whose load waits for the victim's slot
        self._offload_queued: set = set()  # models whose OFFLOAD is already queued behind their batches
        self._turn_start: Dict[str, float] = {}
        """When each resident model's turn began (its first batch after loading), on the caller's clock."""
        self._turn_runs: Dict[str, int] = {}
        """Batches (steps) each resident model got since it loaded."""
        self._unserved: set = set()
        """Loaded models that have had no batch since: not evicted before their first."""

    # ---- queries -------------------------------------------------------------
    def _known(self, m: str) -> None:
        if m not in self.states:
            raise KeyError(f"unknown model id {m!r} (known: {self.model_ids})")

    def state(self, model_id: str) -> ModelState:
        self._known(model_id)
        return self.states[model_id]

    def resident(self) -> List[str]:
        return [m for m in self.model_ids if self.states[m] in _RESIDENT]

    def _fits(self, m: str, leaving: Iterable[str] = ()) -> bool:
        """Would ``m`` fit beside the resident models, not counting those in ``leaving``?"""
        leaving = set(leaving)
        staying = [v for v in self.resident() if v not in leaving and v != m]
        if self.max_loaded is not None and len(staying) + 1 > self.max_loaded:
            return False
        if self.device_budget is not None and \
                sum(self.sizes[v] for v in staying) + self.sizes[m] > self.device_budget:
            return False
        return True

    def _touch(self, model_id: str) -> None:
        self._eviction.touch(model_id, self._now)

    def _runnable(self, m: str) -> bool:
        s = self.states[m]
        if m in self._offload_queued:
            return False
        return s is ModelState.LOADED or (s is ModelState.LOADING and self._may_overlap(m))

    def _may_overlap(self, m: str) -> bool:
        """A batch may follow ``m``'s load directly only if no other model is (staying) resident."""
        return self.overlap and all(v == m or v in self._offload_queued for v in self.resident())

    def _victim(self, candidates: List[str]) -> Optional[str]:
        """The candidate to evict first: the lowest priority, then the eviction policy's order."""
        return min(candidates, key=lambda m: (self.priority[m],) + self._eviction.key(m)) if candidates else None

    def _spare(self, m: str, victims: List[str], leaving: Set[str]) -> None:
        """Keep victims that ``m`` turns out not to need (a later, bigger one made the room), most
        valuable first."""
        for v in sorted(victims[:-1], key=lambda v: (self.priority[v],) + self._eviction.key(v), reverse=True):
            if self._fits(m, leaving - {v}):
                victims.remove(v)
                leaving.discard(v)

    def _starving(self, m: str, heads: Mapping[str, float], now: Optional[float]) -> bool:
        return now is not None and self.rules.starving(now - heads[m])

    def _preemptible(self, m: str, heads: Mapping[str, float], running: Set[str],
                     now: Optional[float]) -> List[str]:
        """Resident models with live sequences that ``m`` may preempt now, under the policy."""
        if now is None:
            return []
        waited = now - heads[m]
        out = []
        for v in self.model_ids:
            if (v == m or v not in running or v in self.pinned or v in self._offload_queued
                    or self.states[v] is not ModelState.LOADED or v in self._unserved
                    or self.priority[v] > self.priority[m]):
                continue
            turn = now - self._turn_start.get(v, now)
            if self._turn_runs.get(v, 0) < MIN_TURN_STEPS:
                continue  # every turn makes progress, however short the quantum
            if self.rules.may_preempt(waited, turn):
                out.append(v)
        return out

    # ---- decisions -----------------------------------------------------------
    def decide(self, heads: Mapping[str, float], running: Iterable[str] = (),
               now: Optional[float] = None, ahead: Iterable[str] = ()) -> List[Action]:
        """``heads``: each model with work and the arrival time of its oldest request (for a model whose sequences
        are paused: when they paused). ``running``: models with live sequences on the workers (token-level
        generation); they are evicted only by preemption. ``now``: the caller's clock, on the scale of ``heads``;
        without it nothing is preempted. ``ahead``: models that may send a step ahead of the one running."""
        running, ahead = set(running), set(ahead) if len(heads) == 1 else set()
        unknown = [m for m in heads if m not in self.states]
        if unknown:
            raise KeyError(f"unknown model ids in heads: {unknown}")
        if now is not None:
            self._now = now if self._now is None else max(self._now, now)
        actions: List[Action] = []
        waiting_for_slot = False
        order = sorted(heads, key=lambda k: (not self._starving(k, heads, now), -self.priority[k], heads[k],
                                             self._order[k]))
        for m in order:
            state = self.states[m]
            if self._runnable(m):
                limit = 1 if waiting_for_slot else self.max_inflight + (m in ahead)
                if self.inflight[m] < limit:
                    self.inflight[m] += 1
                    self._unserved.discard(m)
                    self._turn_runs[m] = self._turn_runs.get(m, 0) + 1
                    if now is not None:
                        self._turn_start.setdefault(m, now)
                    self._touch(m)
                    actions.append(Action(ActionKind.RUN, m))
                continue
            if state is not ModelState.OFFLOADED or waiting_for_slot:
                continue
            promised = [v for v, w in self._slot_promised.items() if w == m]
            if promised and not self._fits(m):
                waiting_for_slot = True
                continue
            if self._fits(m):
                # room (another model left): take it rather than wait for the victims
                for v in promised:
                    del self._slot_promised[v]
                actions.extend(self._start_load(m, heads, now))
                continue
            # evict idle models, first in eviction order first, until m fits
            leaving, victims = set(), []
            idle = [v for v in self.model_ids if self.states[v] is ModelState.LOADED and self.inflight[v] == 0
                    and v not in self._offload_queued and v not in running and v not in self.pinned
                    and not (v in self._unserved and v in heads)]
            while idle and not self._fits(m, leaving):
                v = self._victim(idle)
                idle.remove(v)
                victims.append(v)
                leaving.add(v)
            if self._eviction.spare_unneeded:
                self._spare(m, victims, leaving)
            if victims and self._fits(m, leaving):
                for v in victims:
                    self.states[v] = ModelState.OFFLOADING
                    self._slot_promised[v] = m
                    self._eviction.evicted(v)
                    actions.append(Action(ActionKind.OFFLOAD, v, Reason.EVICT_IDLE, m))
                waiting_for_slot = True
                continue
            # otherwise queue offloads behind batches in flight: models draining their last batch
            # (prefetch), then models whose turn is over (preemption); m's load goes right behind
            draining = [v for v in self.model_ids if self.states[v] is ModelState.LOADED and v not in heads
                        and v not in self._offload_queued and v not in running
                        and v not in self.pinned] if self.prefetch else []
            preemptible = self._preemptible(m, heads, running, now)
            # offloads already sent or queued free their slots before a load sent now (command order)
            queued: Dict[str, Reason] = {}
            gone = self._offload_queued | {v for v in self.model_ids if self.states[v] is ModelState.OFFLOADING}
            for pool, reason in ((victims, Reason.EVICT_IDLE), (draining, Reason.DRAIN),
                                 (preemptible, Reason.PREEMPT)):
                pool = [v for v in pool if v not in queued]
                while pool and not self._fits(m, gone | set(queued)):
                    v = self._victim(pool)
                    pool.remove(v)
                    queued[v] = reason
            if queued and self._fits(m, gone | set(queued)):
                for v, reason in queued.items():
                    if self.inflight[v]:
                        self._offload_queued.add(v)  # OFFLOADING once its last batch is answered
                    else:
                        self.states[v] = ModelState.OFFLOADING
                    self._eviction.evicted(v)
                    actions.append(Action(ActionKind.OFFLOAD, v, reason, m))
                actions.extend(self._start_load(m, heads, now))
                continue
            waiting_for_slot = True
        return actions

    def _start_load(self, m: str, heads: Mapping[str, float], now: Optional[float] = None) -> List[Action]:
        self.states[m] = ModelState.LOADING
        self._unserved.add(m)
        out = [Action(ActionKind.LOAD, m)]
        if m in heads and self._may_overlap(m):
            self.inflight[m] += 1
            self._unserved.discard(m)
            self._turn_runs[m] = 1
            if now is not None:
                self._turn_start[m] = now
            self._touch(m)
            out.append(Action(ActionKind.RUN, m))
        return out

    # ---- events --------------------------------------------------------------
    def _expect(self, m: str, *states: ModelState) -> None:
        self._known(m)
        if self.states[m] not in states:
            raise RuntimeError(f"model {m!r} is {self.states[m].value}, expected "
                               f"{'/'.join(s.value for s in states)}")

    def on_loaded(self, m: str) -> None:
        self._expect(m, ModelState.LOADING)
        self.states[m] = ModelState.LOADED
        self._touch(m)

    def on_load_failed(self, m: str) -> None:
        self._expect(m, ModelState.LOADING)
        self.states[m] = ModelState.OFFLOADED
        self._unserved.discard(m)
        # with overlap, batches sent to the loading model are still in flight: each
        # one is answered (as a failure) and brings its own on_batch_done

    def on_offloaded(self, m: str) -> None:
        # LOADED only for a model whose offload is queued behind its batches (prefetch, preemption)
        queued = m in self._offload_queued
        self._expect(m, ModelState.OFFLOADING, *((ModelState.LOADED,) if queued else ()))
        self.states[m] = ModelState.OFFLOADED
        self._slot_promised.pop(m, None)
        self._offload_queued.discard(m)
        self._unserved.discard(m)
        self._turn_start.pop(m, None)
        self._turn_runs.pop(m, None)

    def on_batch_done(self, m: str) -> None:
        self._known(m)
        if self.inflight[m] <= 0:
            raise RuntimeError(f"model {m!r} has no batch in flight")
        self.inflight[m] -= 1
        if self.inflight[m] == 0 and m in self._offload_queued:
            self.states[m] = ModelState.OFFLOADING

    def release(self, m: str) -> Optional[Action]:
        """The OFFLOAD of ``m``, idle with its keep-alive up; None unless it is loaded with nothing in flight,
        no offload queued or slot promised, and not pinned."""
        self._known(m)
        if (self.states[m] is not ModelState.LOADED or self.inflight[m] or m in self._offload_queued
                or m in self.pinned or m in self._slot_promised):
            return None
        self.states[m] = ModelState.OFFLOADING
        self._eviction.evicted(m)
        return Action(ActionKind.OFFLOAD, m, Reason.KEEP_ALIVE)

    def can_accept_batches(self, m: str) -> bool:
        self._known(m)
        return self._runnable(m)

    def in_flight(self, m: str) -> int:
        """Batches (steps) of ``m`` sent and not yet answered."""
        self._known(m)
        return self.inflight[m]

    def is_pinned(self, m: str) -> bool:
        self._known(m)
        return m in self.pinned

    def note_arrival(self, m: str, now: float) -> None:
        """A request for ``m`` was admitted at ``now`` (time.perf_counter()): the recent request rate."""
        self._known(m)
        self._now = now if self._now is None else max(self._now, now)
        self._eviction.note_arrival(m, now)

    def record_load(self, m: str, seconds: float, nbytes: int) -> None:
        """``m`` loaded in ``seconds`` (slowest rank), ``nbytes`` over all ranks: the reload cost estimate.
        Bandwidths are kept in the scheduler's own unit (``sizes``, bytes per rank), so that a model not
        yet measured is estimated from its size; ``nbytes`` stands in only for a model without a size."""
        self._known(m)
        if seconds < 0 or nbytes < 0:
            raise ValueError(f"record_load({m!r}, seconds={seconds}, nbytes={nbytes}): must be >= 0")
        self._eviction.record_load(m, seconds, self.sizes[m] or nbytes)

    # ---- models changing while serving ----------------------------------------
    def add_model(self, m: str, size: int = 0, *, pinned: bool = False, priority: int = 0) -> None:
        """A new model, OFFLOADED; ``size``: its bytes per rank (KV reserve included) for the device budget.
        Among equal heads it comes after every model already known."""
        if m in self.states:
            raise ValueError(f"model id {m!r} is already known")
        size = int(size)
        if size < 0:
            raise ValueError(f"model {m!r}: size={size} must be >= 0")
        if self.device_budget is not None and size > self.device_budget:
            raise ValueError(f"device_budget={self.device_budget} bytes per rank cannot hold "
                             f"model {m!r} ({size} bytes per rank with its KV reserve)")
        self._order[m] = max(self._order.values(), default=-1) + 1
        self.model_ids.append(m)
        self.states[m] = ModelState.OFFLOADED
        self.inflight[m] = 0
        self.sizes[m] = size
        self.priority[m] = int(priority)
        if pinned:
            self.pinned.add(m)
        self._eviction.add(m)

    def remove_model(self, m: str) -> None:
        """Forget ``m``: it must be offloaded, or loaded with nothing in flight and no offload queued. A
        loaded model's slot is free at once: the engine sends the command that frees its memory before
        any later load (workers run commands in order). A load promised ``m``'s victims' slots is dropped."""
        self._known(m)
        state = self.states[m]
        queued = m in self._offload_queued and state is ModelState.LOADED
        busy = " and ".join(([f"{self.inflight[m]} batches in flight"] if self.inflight[m] else [])
                            + (["its offload queued"] if queued else []))
        if state not in (ModelState.OFFLOADED, ModelState.LOADED) or busy:
            raise RuntimeError(f"model {m!r} is {state.value}{' with ' + busy if busy else ''}: it can be "
                               "removed once offloaded, or loaded with nothing in flight")
        self._slot_promised = {v: w for v, w in self._slot_promised.items() if m not in (v, w)}
        for d in (self.states, self.inflight, self.sizes, self.priority, self._order, self._turn_start,
                  self._turn_runs):
            d.pop(m, None)
        for s in (self.pinned, self._offload_queued, self._unserved):
            s.discard(m)
        self.model_ids.remove(m)
        self._eviction.remove(m)

    def set_pinned(self, m: str, pinned: bool) -> None:
        """Pin ``m`` (never evicted once loaded) or unpin it."""
        self._known(m)
        (self.pinned.add if pinned else self.pinned.discard)(m)

    def set_priority(self, m: str, n: int) -> None:
        """``m``'s priority: a higher one is visited first and evicted last."""
        self._known(m)
        self.priority[m] = int(n)
