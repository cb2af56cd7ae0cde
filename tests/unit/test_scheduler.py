"""Unit tests for the scheduling policy in ``computron.sched.scheduler`` (pure Python, no workers)."""
import itertools
import random
from collections import Counter, deque

import pytest

from computron.sched.scheduler import Action, ActionKind, ModelState, Scheduler

A, B, C, D, E = "a", "b", "c", "d", "e"
IDS = [A, B, C, D, E]

OFFLOADED, LOADING, LOADED, OFFLOADING = (ModelState.OFFLOADED, ModelState.LOADING, ModelState.LOADED,
                                          ModelState.OFFLOADING)


def load(m):
    return Action(ActionKind.LOAD, m)


def offload(m):
    return Action(ActionKind.OFFLOAD, m)


def run(m):
    return Action(ActionKind.RUN, m)


def make(n=3, max_loaded=2, **kw):
    return Scheduler(IDS[:n], max_loaded, **kw)


def bring_up(s, *models):
    """Load ``models`` one after the other into free slots and leave them LOADED and idle."""
    for m in models:
        assert s.decide({m: 0.0}) == [load(m)]
        s.on_loaded(m)


def use(s, m):
    """Run one batch of ``m`` to completion, making it the most recently used model."""
    assert s.decide({m: 0.0}) == [run(m)]
    s.on_batch_done(m)


def states(s):
    return {m: s.state(m) for m in s.model_ids}


# ---- construction --------------------------------------------------------------

@pytest.mark.parametrize("args, kwargs", [
    (([A, B], 0), {}),
    (([A, B], -1), {}),
    (([A, B, A], 1), {}),
    (([A, B], 1), {"max_inflight": 0}),
])
def test_constructor_rejects_bad_arguments(args, kwargs):
    with pytest.raises(ValueError):
        Scheduler(*args, **kwargs)


def test_unknown_model_in_heads_raises():
    s = make()
    with pytest.raises(KeyError):
        s.decide({A: 0.0, "nope": 1.0})
    assert states(s) == {A: OFFLOADED, B: OFFLOADED, C: OFFLOADED}  # nothing was decided


def test_starts_empty_and_idle():
    s = make()
    assert states(s) == {A: OFFLOADED, B: OFFLOADED, C: OFFLOADED}
    assert s.inflight == {A: 0, B: 0, C: 0}
    assert s.resident() == []
    assert s.decide({}) == []


# ---- ordering ------------------------------------------------------------------

def test_oldest_head_is_served_first():
    s = make(max_loaded=1)
    assert s.decide({A: 5.0, B: 1.0, C: 3.0}) == [load(B)]


def test_ties_are_broken_by_model_order():
    s = make(max_loaded=1)
    assert s.decide({C: 1.0, B: 1.0}) == [load(B)]


def test_actions_come_in_head_order():
    s = make(max_loaded=3)
    bring_up(s, A, B, C)
    assert s.decide({A: 3.0, B: 1.0, C: 2.0}) == [run(B), run(C), run(A)]


def test_loading_model_is_skipped_and_younger_model_still_loads():
    s = make()
    assert s.decide({A: 0.0}) == [load(A)]
    assert s.decide({A: 0.0, B: 1.0}) == [load(B)]
    assert states(s) == {A: LOADING, B: LOADING, C: OFFLOADED}


def test_offloading_model_is_skipped_and_younger_model_still_runs():
    s = make()
    bring_up(s, A, B)
    assert s.decide({C: 0.0}) == [offload(A)]
    assert s.decide({A: 1.0, B: 2.0}) == [run(B)]
    assert states(s) == {A: OFFLOADING, B: LOADED, C: OFFLOADED}


# ---- free slots ----------------------------------------------------------------

def test_fills_free_slots_without_evicting():
    s = make()
    assert s.decide({A: 0.0, B: 1.0, C: 2.0}) == [load(A), load(B)]
    assert s.resident() == [A, B]
    assert s.state(C) is OFFLOADED
    assert s.decide({A: 0.0, B: 1.0, C: 2.0}) == []  # c waits for a slot, nobody is evicted yet


# ---- LRU eviction --------------------------------------------------------------

@pytest.mark.parametrize("uses, victim", [((), A), ((A, B), A), ((B, A), B)])
def test_evicts_least_recently_used_idle_model(uses, victim):
    s = make()
    bring_up(s, A, B)
    for m in uses:
        use(s, m)
    assert s.decide({C: 0.0}) == [offload(victim)]
    assert s.state(victim) is OFFLOADING


def test_model_with_batches_in_flight_is_never_the_victim():
    s = make()
    bring_up(s, A, B)
    assert s.decide({A: 0.0}) == [run(A)]  # a stays busy and is less recently used than b
    use(s, B)
    assert s.decide({C: 0.0}) == [offload(B)]
    assert s.state(A) is LOADED


def test_waits_while_every_resident_model_is_busy():
    s = make()
    bring_up(s, A, B)
    assert s.decide({A: 0.0, B: 1.0}) == [run(A), run(B)]
    assert s.decide({C: 2.0}) == []
    assert s.decide({C: 2.0}) == []
    s.on_batch_done(B)
    assert s.decide({C: 2.0}) == [offload(B)]


# ---- draining for a waiting model ------------------------------------------------

def _c_waits_for_a():
    s = make()
    bring_up(s, A, B)
    assert s.decide({C: 0.0}) == [offload(A)]
    return s


def test_younger_resident_gets_one_batch_while_an_older_model_waits():
    s = _c_waits_for_a()
    assert s.decide({C: 0.0, B: 1.0}) == [run(B)]
    assert s.decide({C: 0.0, B: 1.0}) == []
    assert s.inflight[B] == 1
    assert s.decide({B: 1.0}) == [run(B)]  # nobody older waits: back to max_inflight
    assert s.decide({B: 1.0}) == []
    assert s.inflight[B] == 2


def test_the_evicting_call_itself_holds_back_younger_models():
    s = make(n=4)
    bring_up(s, A, B)
    assert s.decide({C: 0.0, D: 1.0}) == [offload(A)]  # d does not evict b as well
    s = make()
    bring_up(s, A, B)
    assert s.decide({B: 0.0}) == [run(B)]
    assert s.decide({C: 1.0, B: 2.0}) == [offload(A)]  # b already has its one batch


def test_resident_model_older_than_the_waiting_one_keeps_max_inflight():
    s = _c_waits_for_a()
    assert s.decide({B: 0.0, C: 1.0}) == [run(B)]
    assert s.decide({B: 0.0, C: 1.0}) == [run(B)]
    assert s.inflight[B] == 2


# ---- promised slots --------------------------------------------------------------

def test_promised_slot_is_not_stolen_and_is_loaded_once_free():
    s = make(n=4)
    bring_up(s, A, B)
    assert s.decide({C: 0.0}) == [offload(A)]
    assert s.decide({C: 0.0}) == []  # no second eviction for c
    assert s.decide({C: 0.0, D: 1.0}) == []  # nor one for the younger d
    assert states(s) == {A: OFFLOADING, B: LOADED, C: OFFLOADED, D: OFFLOADED}
    s.on_offloaded(A)
    assert s.decide({C: 0.0, D: 1.0}) == [load(C), offload(B)]


def test_promised_model_takes_a_slot_freed_elsewhere():
    s = make(n=4)
    bring_up(s, A)
    assert s.decide({B: 0.0}) == [load(B)]
    assert s.decide({C: 1.0}) == [offload(A)]  # promised a's slot
    s.on_load_failed(B)  # frees a slot before a's offload ends
    assert s.decide({C: 1.0}) == [load(C)]
    s.on_offloaded(A)
    assert s.decide({D: 2.0}) == [load(D)]
    assert s.resident() == [C, D]


# ---- state transitions and events ------------------------------------------------

def test_full_cycle_of_states():
    s = make(n=2, max_loaded=1)
    seen = [s.state(A)]
    s.decide({A: 0.0})
    seen.append(s.state(A))
    s.on_loaded(A)
    seen.append(s.state(A))
    assert s.decide({B: 1.0}) == [offload(A)]
    seen.append(s.state(A))
    s.on_offloaded(A)
    seen.append(s.state(A))
    assert seen == [OFFLOADED, LOADING, LOADED, OFFLOADING, OFFLOADED]
    assert s.decide({B: 1.0}) == [load(B)]


def test_failed_load_frees_the_slot():
    s = make(n=2, max_loaded=1)
    assert s.decide({A: 0.0}) == [load(A)]
    s.on_load_failed(A)
    assert s.state(A) is OFFLOADED and s.resident() == []
    assert s.decide({B: 1.0}) == [load(B)]


def test_batches_are_counted_in_and_out():
    s = make()
    bring_up(s, A)
    assert s.decide({A: 0.0}) == [run(A)]
    assert s.decide({A: 0.0}) == [run(A)]
    assert s.decide({A: 0.0}) == []  # max_inflight=2
    assert s.inflight[A] == 2
    s.on_batch_done(A)
    assert s.inflight[A] == 1
    assert s.decide({A: 0.0}) == [run(A)]


def _drive_a_to(s, state):
    """Bring model a of a one-slot scheduler to ``state`` through the public API."""
    if state is OFFLOADED:
        return
    s.decide({A: 0.0})
    if state is LOADING:
        return
    s.on_loaded(A)
    if state is OFFLOADING:
        assert s.decide({B: 1.0}) == [offload(A)]


@pytest.mark.parametrize("event, state", [
    ("on_loaded", OFFLOADED), ("on_loaded", LOADED), ("on_loaded", OFFLOADING),
    ("on_load_failed", OFFLOADED), ("on_load_failed", LOADED), ("on_load_failed", OFFLOADING),
    ("on_offloaded", OFFLOADED), ("on_offloaded", LOADING), ("on_offloaded", LOADED),
    ("on_batch_done", OFFLOADED), ("on_batch_done", LOADED),
])
def test_invalid_event_raises_and_changes_nothing(event, state):
    s = make(n=2, max_loaded=1)
    _drive_a_to(s, state)
    with pytest.raises(RuntimeError):
        getattr(s, event)(A)
    assert s.state(A) is state and s.inflight[A] == 0


# ---- overlap -----------------------------------------------------------------------

def test_overlap_runs_right_behind_the_load():
    s = make(overlap=True)
    assert s.decide({A: 0.0}) == [load(A), run(A)]
    assert s.state(A) is LOADING and s.inflight[A] == 1
    assert s.decide({A: 0.0}) == [run(A)]
    assert s.decide({A: 0.0}) == []


def test_without_overlap_a_loading_model_gets_no_batch():
    s = make()
    assert s.decide({A: 0.0}) == [load(A)]
    assert s.decide({A: 0.0}) == []
    s.on_loaded(A)
    assert s.decide({A: 0.0}) == [run(A)]


def test_overlap_waits_for_the_load_while_another_model_is_resident():
    s = make(overlap=True)
    assert s.decide({A: 0.0}) == [load(A), run(A)]
    s.on_loaded(A)
    s.on_batch_done(A)
    assert s.decide({B: 1.0}) == [load(B)]
    assert s.decide({B: 1.0}) == []
    s.on_loaded(B)
    assert s.decide({B: 1.0}) == [run(B)]


@pytest.mark.parametrize("batch_first", [True, False])
def test_overlap_batch_outlives_a_failed_load(batch_first):
    s = make(overlap=True)
    assert s.decide({A: 0.0}) == [load(A), run(A)]
    events = [s.on_batch_done, s.on_load_failed] if batch_first else [s.on_load_failed, s.on_batch_done]
    for event in events:
        event(A)
    assert s.state(A) is OFFLOADED and s.inflight[A] == 0


# ---- prefetch ----------------------------------------------------------------------

def _all_busy(batches=1, **kw):
    """Two slots, a and b resident with ``batches`` each in flight (a least recently used)."""
    s = make(**kw)
    bring_up(s, A, B)
    for _ in range(batches):
        assert s.decide({A: 0.0, B: 1.0}) == [run(A), run(B)]
    return s


def test_prefetch_queues_offload_then_load():
    s = _all_busy(prefetch=True)
    assert s.decide({C: 2.0}) == [offload(A), load(C)]
    assert states(s) == {A: LOADED, B: LOADED, C: LOADING}  # a's offload waits behind its batch
    assert not s.can_accept_batches(A)


def test_without_prefetch_the_same_situation_waits():
    s = _all_busy()
    assert s.decide({C: 2.0}) == []


def test_prefetch_victim_gets_no_more_batches():
    s = _all_busy(prefetch=True)
    assert s.decide({C: 2.0}) == [offload(A), load(C)]
    assert s.decide({A: 3.0, B: 4.0}) == [run(B)]
    s.on_batch_done(A)
    assert s.state(A) is OFFLOADING
    assert s.decide({A: 3.0}) == []


def test_prefetch_victim_offloads_after_its_last_batch():
    s = _all_busy(batches=2, prefetch=True)
    assert s.decide({C: 2.0}) == [offload(A), load(C)]
    s.on_batch_done(A)
    assert s.state(A) is LOADED
    s.on_batch_done(A)
    assert s.state(A) is OFFLOADING
    s.on_offloaded(A)
    s.on_loaded(C)
    assert states(s) == {A: OFFLOADED, B: LOADED, C: LOADED}
    assert s.resident() == [B, C]


def test_prefetch_never_picks_a_victim_with_waiting_requests():
    s = _all_busy(prefetch=True)
    assert s.decide({C: 2.0, A: 3.0}) == [offload(B), load(C), run(A)]


def test_prefetch_waits_when_every_busy_model_has_waiting_requests():
    s = _all_busy(prefetch=True)
    assert s.decide({C: 2.0, A: 3.0, B: 4.0}) == []


def test_prefetch_with_overlap_runs_right_behind_the_load():
    s = make(n=2, max_loaded=1, prefetch=True, overlap=True)
    assert s.decide({A: 0.0}) == [load(A), run(A)]
    s.on_loaded(A)
    assert s.decide({B: 1.0}) == [offload(A), load(B), run(B)]
    assert states(s) == {A: LOADED, B: LOADING}


# ---- randomized simulation -----------------------------------------------------------

class Sim:
    """Plays engine and workers around a Scheduler and checks its invariants after every step.

    Requests arrive at random models; a RUN takes up to three queued requests; sent commands
    are answered in random order, except that each model's commands are answered in the order
    they were sent (workers execute in order), a batch may overtake its model's load (loads are
    asynchronous with overlap), and a load fails with probability ``fail_rate``, failing the
    model's queued requests as the engine does. Like the engine, ``pump`` calls ``decide``
    until it returns nothing; then no waiting model may be left out while a slot is free.
    """

    def __init__(self, s, rng, fail_rate=0.0):
        self.s, self.rng, self.fail_rate = s, rng, fail_rate
        self.queues = {m: deque() for m in s.model_ids}
        self.sent = []  # commands not answered yet, in the order they were sent
        self.offload_sent = set()  # models with an OFFLOAD not answered yet
        self.clock = itertools.count()
        self.arrived, self.answered, self.batches = Counter(), Counter(), Counter()

    def heads(self):
        return {m: q[0] for m, q in self.queues.items() if q}

    def arrive(self):
        m = self.rng.choice(self.s.model_ids)
        self.queues[m].append(next(self.clock))
        self.arrived[m] += 1

    def pump(self):
        for _ in range(100):
            heads = self.heads()
            actions = self.s.decide(heads)
            if not actions:
                break
            for i, a in enumerate(actions):
                self.check_action(a, heads, actions[i + 1:])
                self.send(a)
            self.check_state()
        else:
            pytest.fail("decide never settles")
        free = len(self.s.resident()) < self.s.max_loaded
        idle_waiting = [m for m in self.heads() if self.s.state(m) is OFFLOADED]
        assert not (free and idle_waiting), f"{idle_waiting} wait although a slot is free"

    def send(self, a):
        m = a.model_id
        if a.kind is ActionKind.RUN:
            for _ in range(min(len(self.queues[m]), self.rng.randint(1, 3))):
                self.queues[m].popleft()
                self.answered[m] += 1
            self.batches[m] += 1
        elif a.kind is ActionKind.OFFLOAD:
            self.offload_sent.add(m)
        self.sent.append(a)

    def answerable(self):
        out = []
        for i, a in enumerate(self.sent):
            earlier = [b for b in self.sent[:i] if b.model_id == a.model_id]
            if all(a.kind is ActionKind.RUN and b.kind is ActionKind.LOAD for b in earlier):
                out.append(i)
        return out

    def answer_one(self):
        a = self.sent.pop(self.rng.choice(self.answerable()))
        m = a.model_id
        if a.kind is ActionKind.RUN:
            self.s.on_batch_done(m)
        elif a.kind is ActionKind.OFFLOAD:
            self.s.on_offloaded(m)
            self.offload_sent.discard(m)
        elif self.rng.random() < self.fail_rate:
            self.s.on_load_failed(m)
            self.answered[m] += len(self.queues[m])
            self.queues[m].clear()
        else:
            self.s.on_loaded(m)
        self.check_state()

    def check_action(self, a, heads, rest):
        s, m = self.s, a.model_id
        if a.kind is ActionKind.RUN:
            assert m in heads and self.queues[m]
            assert m not in self.offload_sent, "RUN for a model whose offload is queued"
            assert s.state(m) is LOADED or (s.overlap and s.state(m) is LOADING)
        elif a.kind is ActionKind.LOAD:
            assert m in heads and s.state(m) is LOADING
        elif s.state(m) is LOADED:  # an offload queued behind batches
            assert s.prefetch and s.inflight[m] > 0 and m not in heads
            assert rest and rest[0].kind is ActionKind.LOAD
        else:
            assert s.state(m) is OFFLOADING and s.inflight[m] == 0

    def check_state(self):
        s = self.s
        assert all(n >= 0 for n in s.inflight.values())
        if s.prefetch:
            staying = [m for m in s.model_ids if s.state(m) in (LOADED, LOADING) and m not in self.offload_sent]
            assert len(staying) <= s.max_loaded
        else:
            assert len(s.resident()) <= s.max_loaded
        for m in s.model_ids:
            if s.state(m) is OFFLOADING:
                assert s.inflight[m] == 0
            if s.state(m) is LOADED and m in self.offload_sent:
                assert s.inflight[m] > 0, "a queued offload must become OFFLOADING after the last batch"

    def play(self, arrival_steps):
        for _ in range(arrival_steps):
            if not self.sent or self.rng.random() < 0.4:
                self.arrive()
            else:
                self.answer_one()
            self.pump()
        while self.sent:  # arrivals stopped: everything waiting must be served
            self.answer_one()
            self.pump()
        assert self.heads() == {}, f"starved: {self.heads()} in {states(self.s)}"
        assert self.answered == self.arrived
        assert all(n == 0 for n in self.s.inflight.values())


@pytest.mark.parametrize("n, max_loaded, prefetch, overlap, max_inflight, fail_rate", [
    (3, 1, False, False, 2, 0.0),
    (4, 2, False, False, 2, 0.0),
    (5, 3, False, False, 1, 0.0),
    (4, 2, False, True, 3, 0.0),
    (4, 2, True, False, 2, 0.0),
    (5, 3, True, True, 2, 0.0),
    (2, 1, True, True, 1, 0.0),
    (4, 2, False, True, 2, 0.2),
    (5, 2, True, True, 3, 0.2),
])
def test_random_simulation_keeps_invariants(n, max_loaded, prefetch, overlap, max_inflight, fail_rate):
    for seed in range(20):
        s = make(n, max_loaded, prefetch=prefetch, overlap=overlap, max_inflight=max_inflight)
        sim = Sim(s, random.Random(seed), fail_rate)
        sim.play(arrival_steps=150)
        if fail_rate == 0.0:
            assert set(sim.batches) == set(sim.arrived), "every model with requests got a RUN"
