"""Which model runs next and which one leaves: pure policy, no torch, no processes.

The engine tells the scheduler what happened (``on_loaded``, ``on_offloaded``,
``on_batch_done``, ``on_load_failed``) and asks it what to do next with
``decide(heads)``, where ``heads`` maps each model that has waiting requests to
the arrival time of its oldest one. ``decide`` returns actions in the order
they must be sent to the workers; the workers execute commands in that order,
which is what makes queuing an offload behind a running batch safe.

Rules:
- models are visited oldest head first; a model mid-transition is skipped;
- a resident model gets a batch if it has fewer than ``max_inflight`` in flight
  (only one once an older model is waiting for a slot, so it drains);
- a model that is not resident is loaded into a free slot, or into the slot of
  the least recently used resident model that has nothing in flight; a model
  with batches in flight is never offloaded;
- with ``prefetch``, when every resident model is busy, the least recently
  used one whose queue is empty gets its offload queued right behind its last
  batch and the waiting model's load right behind that, saving a round trip;
- with ``overlap``, a batch may be sent to a model that is still loading
  (the worker starts each layer once its weights have arrived), but only
  while no other model is resident: workers run batches in command order, so
  such a batch would hold up other models' batches until the load ends.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional


class ModelState(enum.Enum):
    OFFLOADED = "offloaded"
    LOADING = "loading"
    LOADED = "loaded"
    OFFLOADING = "offloading"


class ActionKind(enum.Enum):
    LOAD = "load"
    OFFLOAD = "offload"
    RUN = "run"


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    model_id: str


_RESIDENT = (ModelState.LOADING, ModelState.LOADED, ModelState.OFFLOADING)


class Scheduler:
    def __init__(self, model_ids: Iterable[str], max_loaded: int, *, prefetch: bool = False,
                 overlap: bool = False, max_inflight: int = 2):
        self.model_ids = list(model_ids)
        self._order = {m: i for i, m in enumerate(self.model_ids)}  # ties between equal heads
        if len(set(self.model_ids)) != len(self.model_ids):
            raise ValueError("model ids must be unique")
        if max_loaded < 1:
            raise ValueError(f"max_loaded={max_loaded}: must be >= 1")
        if max_inflight < 1:
            raise ValueError(f"max_inflight={max_inflight}: must be >= 1")
        self.max_loaded = max_loaded
        self.prefetch = prefetch
        self.overlap = overlap
        self.max_inflight = max_inflight
        self.states: Dict[str, ModelState] = {m: ModelState.OFFLOADED for m in self.model_ids}
        self.inflight: Dict[str, int] = {m: 0 for m in self.model_ids}
        self._last_used: Dict[str, int] = {m: -1 for m in self.model_ids}
        self._clock = 0
        # victim -> model whose load waits for the victim's slot
        self._slot_promised: Dict[str, str] = {}
        # models whose OFFLOAD is already queued behind their in-flight batches
        self._offload_queued: set = set()

    # ---- queries -------------------------------------------------------------
    def state(self, model_id: str) -> ModelState:
        return self.states[model_id]

    def resident(self) -> List[str]:
        return [m for m in self.model_ids if self.states[m] in _RESIDENT]

    def _slots_used(self) -> int:
        return sum(1 for m in self.model_ids if self.states[m] in _RESIDENT)

    def _touch(self, model_id: str) -> None:
        self._clock += 1
        self._last_used[model_id] = self._clock

    def _runnable(self, m: str) -> bool:
        s = self.states[m]
        if m in self._offload_queued:
            return False
        return s is ModelState.LOADED or (s is ModelState.LOADING and self._may_overlap(m))

    def _may_overlap(self, m: str) -> bool:
        """A batch may follow ``m``'s load directly only if no other model is (staying) resident."""
        return self.overlap and all(v == m or v in self._offload_queued for v in self.resident())

    def _lru(self, candidates: List[str]) -> Optional[str]:
        return min(candidates, key=lambda m: self._last_used[m]) if candidates else None

    # ---- decisions -----------------------------------------------------------
    def decide(self, heads: Mapping[str, float], running: Iterable[str] = ()) -> List[Action]:
        """``running``: models with sequences generating on the workers (token-level); they are never
        evicted, as a model with batches in flight is not."""
        running = set(running)
        unknown = [m for m in heads if m not in self.states]
        if unknown:
            raise KeyError(f"unknown model ids in heads: {unknown}")
        actions: List[Action] = []
        waiting_for_slot = False
        for m in sorted(heads, key=lambda k: (heads[k], self._order[k])):
            state = self.states[m]
            if self._runnable(m):
                limit = 1 if waiting_for_slot else self.max_inflight
                if self.inflight[m] < limit:
                    self.inflight[m] += 1
                    self._touch(m)
                    actions.append(Action(ActionKind.RUN, m))
                continue
            if state is not ModelState.OFFLOADED or waiting_for_slot:
                continue
            promised = [v for v, w in self._slot_promised.items() if w == m]
            if promised and self._slots_used() >= self.max_loaded:
                waiting_for_slot = True
                continue
            if self._slots_used() < self.max_loaded:
                # a slot is free (another model left): take it rather than wait for the victim
                for v in promised:
                    del self._slot_promised[v]
                actions.extend(self._start_load(m, heads))
                continue
            idle = [v for v in self.model_ids if self.states[v] is ModelState.LOADED
                    and self.inflight[v] == 0 and v not in self._offload_queued and v not in running]
            victim = self._lru(idle)
            if victim is not None:
                self.states[victim] = ModelState.OFFLOADING
                self._slot_promised[victim] = m
                actions.append(Action(ActionKind.OFFLOAD, victim))
                waiting_for_slot = True
                continue
            if self.prefetch:
                draining = [v for v in self.model_ids if self.states[v] is ModelState.LOADED
                            and v not in heads and v not in self._offload_queued and v not in running]
                victim = self._lru(draining)
                if victim is not None:
                    self._offload_queued.add(victim)
                    actions.append(Action(ActionKind.OFFLOAD, victim))
                    actions.extend(self._start_load(m, heads))
                    continue
            waiting_for_slot = True
        return actions

    def _start_load(self, m: str, heads: Mapping[str, float]) -> List[Action]:
        self.states[m] = ModelState.LOADING
        out = [Action(ActionKind.LOAD, m)]
        if m in heads and self._may_overlap(m):
            self.inflight[m] += 1
            self._touch(m)
            out.append(Action(ActionKind.RUN, m))
        return out

    # ---- events --------------------------------------------------------------
    def _expect(self, m: str, *states: ModelState) -> None:
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
        # with overlap, batches sent to the loading model are still in flight: each
        # one is answered (as a failure) and brings its own on_batch_done

    def on_offloaded(self, m: str) -> None:
        # LOADED only for a model whose offload is queued behind its batches (prefetch)
        queued = m in self._offload_queued
        self._expect(m, ModelState.OFFLOADING, *((ModelState.LOADED,) if queued else ()))
        self.states[m] = ModelState.OFFLOADED
        self._slot_promised.pop(m, None)
        self._offload_queued.discard(m)

    def on_batch_done(self, m: str) -> None:
        if self.inflight[m] <= 0:
            raise RuntimeError(f"model {m!r} has no batch in flight")
        self.inflight[m] -= 1
        if self.inflight[m] == 0 and m in self._offload_queued:
            self.states[m] = ModelState.OFFLOADING

    def can_accept_batches(self, m: str) -> bool:
        return self._runnable(m)
