"""Unit tests of the cluster's pure policy: the swap-aware router, the baseline routers and the host planner."""
import pytest

from computron.cluster import (GroupState, NoGroupError, RayMuxRouter, RoundRobinRouter, StaticRouter,
                               SwapAwareRouter, plan)

MODELS = frozenset({"a", "b", "c", "d"})


def state(g, seq=1, **kw):
    kw.setdefault("served", MODELS)
    kw.setdefault("load_s", {m: 0.5 for m in MODELS})
    kw.setdefault("disk_load_s", {m: 5.0 for m in MODELS})
    return GroupState(g, seq=seq, **{k: frozenset(v) if isinstance(v, (set, list, tuple)) else v
                                     for k, v in kw.items()})


def router(n, *states, **kw):
    r = SwapAwareRouter(n, **kw)
    for s in states:
        r.update(s)
    return r


# ---- routing order ----------------------------------------------------------------------------

def test_resident_beats_loading_beats_host_beats_disk():
    r = router(4, state(0), state(1, host={"a"}), state(2, loading={"a"}), state(3, resident={"a"}))
    assert r.route("a", 10, 0.0) == 3
    r = router(3, state(0), state(1, host={"a"}), state(2, loading={"a"}))
    assert r.route("a", 10, 0.0) == 2
    r = router(2, state(0), state(1, host={"a"}))
    assert r.route("a", 10, 0.0) == 1


def test_models_new_to_idle_groups_spread_over_them():
    r = router(2, state(0), state(1))
    first = r.route("a", 10, 0.0)
    r.finished(first, "a", 10)
    second = r.route("b", 10, 1.0)
    assert {first, second} == {0, 1}


def test_a_busier_resident_group_still_wins_over_an_idle_one_without_the_model():
    # group 0 holds 'a' with a little queued work (wait 0.2 s < the 0.5 s a host load would cost elsewhere)
    r = router(2, state(0, resident={"a"}, queued_tokens={"b": 10}), state(1, host={"a"}))
    assert r.route("a", 10, 0.0) == 0


def test_least_loaded_among_groups_of_the_same_kind():
    # the least expected TTFT: a step cycle is one step of each model with work there
    r = router(3, state(0, resident={"a"}, queued_tokens={"b": 30, "c": 5}),
               state(1, resident={"a"}, queued_tokens={"c": 5}), state(2, resident={"a"}, queued_tokens={"b": 20,
                                                                                                      "c": 1, "d": 1}))
    assert r.route("a", 1, 0.0) == 1


def test_disk_only_model_goes_to_the_least_expected_ttft():
    # group 0: idle but a slow disk; group 1: busy (3 models with work) but a fast disk
    r = router(2, state(0, disk_load_s={"a": 9.0}), state(1, queued_tokens={"b": 50, "c": 5, "d": 5},
                                                          disk_load_s={"a": 1.0}))
    assert r.route("a", 1, 0.0) == 1  # 1.0 s + a cycle of 4 steps < 9.0 s + one step
    assert r.swap_cost(0, "a") == 9.0 and r.swap_cost(1, "a") == 0.5  # now expected there: half a load


def test_a_full_device_waits_for_a_turn_to_end():
    full = state(0, max_loaded=2, resident={"b", "c"}, host={"a"}, queued_tokens={"b": 5, "c": 5})
    r = router(1, full)
    assert r.swap_cost(0, "a") == pytest.approx(0.5 + 4 * 3 * 0.02)  # MIN_TURN_STEPS cycles of 3 models
    r = router(1, state(0, max_loaded=2, resident={"b", "c"}, host={"a"}, queued_tokens={"b": 5}))
    assert r.swap_cost(0, "a") == 0.5  # c is idle: its slot is free at once


def test_missing_load_figures_are_estimated_from_other_groups():
    r = router(2, state(0, load_s={}, disk_load_s={}), state(1, load_s={"a": 0.3}, disk_load_s={"a": 4.0}))
    assert r.swap_cost(0, "a") == 4.0
    assert router(1, GroupState(0, served=MODELS, seq=1)).swap_cost(0, "a") > 0


def test_a_burst_spreads_before_the_next_push():
    # 'a' resident on group 0, in host memory on group 1, batches of 2: once two requests run on group 0 the
    # next one would wait there for a slot (half a batch of 60 tokens at 0.02 s per step: 0.62 s), longer than
    # group 1 needs to load it (0.5 s) and step: group 1 joins, and takes the next one (not congested yet)
    r = router(2, state(0, resident={"a"}, max_batch=2), state(1, host={"a"}, max_batch=2))
    got = [r.route("a", 60, 0.0) for _ in range(4)]
    assert got == [0, 0, 1, 1] and r.replicas("a") == [0, 1]
    # without the router's own count (every push resetting it) the burst would all go to group 0
    assert r.queue_wait(0, "a") > r.queue_wait(1, "a") - 1e-9


def test_requests_in_flight_survive_pushes():
    r = router(1, state(0, resident={"a"}, max_batch=1))
    r.route("a", 10, 0.0)
    r.route("a", 10, 0.0)
    r.update(state(0, seq=2, resident={"a"}, max_batch=1, queued_tokens={"a": 20}))
    assert r.queue_wait(0, "a") == pytest.approx(0.02 * (1 + 2 / 1 * 10))
    r.finished(0, "a", 10)
    assert r.queue_wait(0, "a") == pytest.approx(0.02 * (1 + 1 * 10))


def test_finished_takes_the_tokens_off():
    r = router(1, state(0, resident={"a"}))
    g = r.route("a", 100, 0.0)
    assert r.expected_wait(g) == pytest.approx(2.0)
    r.finished(g, "a", 100)
    r.finished(g, "a", 100)  # counted twice (a push already took it off): never below zero
    assert r.expected_wait(g) == 0.0


# ---- pushes -----------------------------------------------------------------------------------

def test_stale_pushes_are_ignored():
    r = router(2, state(0, seq=5, resident={"a"}), state(1, seq=5))
    r.update(state(0, seq=4))  # older: ignored, 'a' still resident on group 0
    r.update(state(0, seq=5))  # same: ignored
    r.update(state(1, seq=4, resident={"a"}))
    assert r.route("a", 1, 0.0) == 0
    r.update(state(0, seq=6, alive=False))
    assert r.route("b", 1, 0.0) == 1


def test_a_push_replaces_the_routers_own_estimate():
    r = router(1, state(0, resident={"a"}))
    r.route("a", 500, 0.0)
    r.update(state(0, seq=2, resident={"a"}, queued_tokens={"a": 100}))
    assert r.expected_wait(0) == pytest.approx(100 * 0.02)


def test_batch_divides_the_wait():
    r = router(1, GroupState(0, served=MODELS, queued_tokens={"a": 80}, step_s=0.05, batch=4.0, seq=1))
    assert r.expected_wait(0) == pytest.approx(1.0)


def test_group_index_out_of_range_is_refused():
    with pytest.raises(ValueError, match="group"):
        SwapAwareRouter(2).update(GroupState(2))


# ---- exclude and dead groups ------------------------------------------------------------------

def test_exclude_avoids_a_group_and_no_group_raises_clearly():
    r = router(2, state(0, resident={"a"}), state(1))
    assert r.route("a", 1, 0.0, exclude={0}) == 1
    with pytest.raises(NoGroupError, match="'a'.*excluded \\[0, 1\\]"):
        r.route("a", 1, 0.0, exclude={0, 1})
    with pytest.raises(NoGroupError, match="'zzz'"):
        r.route("zzz", 1, 0.0)
    r.update(state(0, seq=2, alive=False))
    r.update(state(1, seq=2, alive=False))
    with pytest.raises(NoGroupError, match="alive none"):
        r.route("a", 1, 0.0)


def test_a_dead_replica_is_replaced():
    r = router(2, state(0, resident={"a"}), state(1, host={"a"}))
    assert r.route("a", 1, 0.0) == 0
    r.update(state(0, seq=2, alive=False))
    assert r.route("a", 1, 1.0) == 1
    assert r.replicas("a") == [1]


def test_only_groups_that_serve_the_model():
    r = router(2, state(0, served={"b"}), state(1, served={"a"}))
    assert r.route("a", 1, 0.0) == 1


# ---- replication ------------------------------------------------------------------------------

def test_replication_when_queue_wait_exceeds_the_load_and_removal_when_cold():
    r = router(2, state(0, resident={"a"}, max_batch=1), state(1, host={"a"}, max_batch=1), cold_after_s=30.0)
    assert r.route("a", 30, 0.0) == 0  # a free batch slot: one step away
    # the batch is full: a slot frees in 30 steps, 0.62 s > the 0.5 s load: congested, and group 1's
    # 0.5 s load + one step is sooner
    assert r.route("a", 30, 0.1) == 1
    assert r.replicas("a") == [0, 1]
    r.finished(0, "a", 30)
    r.finished(1, "a", 30)
    assert r.route("a", 1, 10.0) == 0  # the burst is over: the first replica takes it, the second gets nothing
    r.finished(0, "a", 1)
    r.route("a", 1, 29.0)
    r.finished(0, "a", 1)
    assert r.replicas("a") == [0, 1]  # 28.9 s since the second's last request: not yet cold
    r.route("a", 1, 31.0)
    assert r.replicas("a") == [0]  # cold: no request for 30.9 s


def test_no_replication_when_disabled_or_a_disk_load_costs_more_than_the_wait():
    r = router(2, state(0, resident={"a"}, max_batch=1), state(1, host={"a"}, max_batch=1), replicate=False)
    assert {r.route("a", 20, 0.0) for _ in range(5)} == {0}
    r = router(2, state(0, resident={"a"}, max_batch=1), state(1, max_batch=1))  # group 1 reads 'a' from disk (5 s)
    assert [r.route("a", 20, 0.0) for _ in range(3)] == [0, 0, 0]  # waits of 0.4 s, 0.8 s < 5 s
    assert r.replicas("a") == [0]


def test_max_replicas_caps_the_set():
    r = router(3, state(0, resident={"a"}, max_batch=1), state(1, host={"a"}, max_batch=1),
               state(2, host={"a"}, max_batch=1), max_replicas=2)
    for _ in range(20):
        r.route("a", 50, 0.0)
    assert r.replicas("a") == [0, 1]


# ---- baselines --------------------------------------------------------------------------------

def test_round_robin_cycles_over_serving_groups():
    r = RoundRobinRouter(3)
    for s in (state(0), state(1, served={"b"}), state(2)):
        r.update(s)
    assert [r.route("a", 1, 0.0) for _ in range(4)] == [0, 2, 0, 2]


def test_static_router_keeps_to_its_placement():
    r = StaticRouter(3, {"a": [1, 2]})
    for g in range(3):
        r.update(state(g))
    assert r.route("a", 10, 0.0) == 1
    assert r.route("a", 10, 0.0) == 2
    assert r.replicas("a") == [1, 2] and r.route("b", 1, 0.0) == 0
    with pytest.raises(ValueError, match="placement"):
        StaticRouter(2, {"a": [5]})
    with pytest.raises(NoGroupError):
        r.route("a", 1, 0.0, exclude={1, 2})


def test_ray_mux_prefers_a_replica_holding_the_model_then_the_fewest_models():
    r = RayMuxRouter(3, seed=0)
    r.update(state(0, resident={"a", "b"}))
    r.update(state(1, resident={"c"}))
    r.update(state(2, resident={"b", "c", "d"}))
    assert r.route("a", 1, 0.0) == 0
    assert r.route("d", 1, 0.0) == 2
    assert r.route("zz" if False else "b", 1, 0.0) in (0, 2)
    r2 = RayMuxRouter(3, seed=1)
    for s in (state(0, resident={"b", "c"}), state(1, resident={"c"}), state(2, resident={"b", "c", "d"})):
        r2.update(s)
    assert r2.route("a", 1, 0.0) == 1  # held nowhere: the replica with the fewest models
    assert r2.replicas("a") == [1]


def test_ray_mux_falls_back_when_the_holders_are_full():
    r = RayMuxRouter(2, max_ongoing=2, seed=0)
    r.update(state(0, resident={"a"}))
    r.update(state(1, resident={"b", "c"}))
    assert [r.route("a", 1, 0.0) for _ in range(2)] == [0, 0]
    assert r.route("a", 1, 0.0) == 1  # group 0 is at max_ongoing
    r.finished(0, "a", 1)
    assert r.route("a", 1, 0.0) == 0


# ---- planner ----------------------------------------------------------------------------------

def test_plan_respects_every_budget_and_keeps_every_group():
    sizes = {f"m{i}": 10 + i for i in range(20)}
    out = plan({m: 1.0 for m in sizes}, sizes, {m: 2.0 for m in sizes}, {0: 35, 1: 0, 2: 100})
    assert set(out) == {0, 1, 2} and out[1] == set()
    for g, budget in ((0, 35), (2, 100)):
        assert sum(sizes[m] for m in out[g]) <= budget


def test_plan_greedy_takes_the_most_saved_seconds_per_byte():
    rates = {"hot": 5.0, "warm": 1.0, "cold": 0.1, "big": 5.0}
    sizes = {"hot": 10, "warm": 10, "cold": 10, "big": 30}
    load = {"hot": 1.0, "warm": 1.0, "cold": 1.0, "big": 1.0}
    out = plan(rates, sizes, load, {0: 20}, max_copies=1)
    assert out == {0: {"hot", "warm"}}  # big's 5/30 per byte < warm's 1/10; cold's 0.01 last and no room
    out = plan(rates, sizes, {**load, "warm": 0.01}, {0: 20}, max_copies=1)
    assert out == {0: {"hot", "cold"}}  # a cheap disk load saves little


def test_plan_gives_a_hot_model_two_groups_and_spreads_the_load():
    rates = {"hot": 10.0, **{f"m{i}": 0.1 for i in range(6)}}
    sizes = {m: 10 for m in rates}
    out = plan(rates, sizes, {m: 1.0 for m in rates}, {0: 30, 1: 30, 2: 30})
    assert sum("hot" in ms for ms in out.values()) == 2
    assert all(len(ms) == 3 for ms in out.values())
    even = {m: 0.1 for m in "abcd"}
    out = plan(even, {m: 1 for m in even}, {m: 1.0 for m in even}, {0: 2, 1: 2})
    assert sorted(m for ms in out.values() for m in ms) == list("abcd")  # first copies before second ones


def test_replanning_keeps_copies_where_they_were_when_that_changes_little():
    rates = {f"m{i}": 1.0 + 0.01 * i for i in range(6)}
    sizes = {m: 10 for m in rates}
    load = {m: 1.0 for m in rates}
    first = plan(rates, sizes, load, {0: 30, 1: 30}, max_copies=1)
    shifted = {m: r * (1.1 if i % 2 else 0.9) for i, (m, r) in enumerate(sorted(rates.items()))}
    again = plan(shifted, sizes, load, {0: 30, 1: 30}, previous=first, max_copies=1)
    assert again == first


def test_plan_refuses_bad_input():
    with pytest.raises(ValueError, match="sizes"):
        plan({"a": 1.0}, {}, {}, {0: 1})
    with pytest.raises(ValueError, match="host_budget"):
        plan({"a": 1.0}, {"a": 1}, {"a": 1.0}, {0: -1})
