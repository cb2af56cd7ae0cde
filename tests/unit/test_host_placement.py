"""The front's host placement (``cluster/placement.py``): when it re-plans, and what it tells which group.
Pure: no Ray, no process, no clock (every call says ``now``)."""
from __future__ import annotations

import logging
import math

import pytest

from computron.cluster.placement import DecayedRates, HostPlacement, mix_change

MB = 100  # one model's shard, in the tests' bytes
MODELS = ("a", "b", "c")


def placement(n_groups=2, budget=MB, models=MODELS, **kw):
    """A started placement whose groups each pushed ``budget`` and ``models`` of ``MB`` bytes."""
    p = HostPlacement(n_groups, min_interval_s=2.0, change=0.1, **kw)
    for g in range(n_groups):
        observe(p, g, budget, models)
    p.started = True
    return p


def observe(p, g, budget=MB, models=MODELS, served=None, load_s=None, disk_load_s=None):
    p.observe(g, budget, {m: MB for m in models}, frozenset(models if served is None else served),
              load_s or {}, disk_load_s or {})


def tell_all(p, changes):
    """Every group's call succeeded."""
    for g, (models, epoch) in changes.items():
        p.applied(g, models, epoch)


def arrivals(p, counts, t0, t1):
    """``counts[model]`` requests of each model spread over [t0, t1)."""
    for m, n in counts.items():
        for k in range(n):
            p.arrival(m, t0 + (t1 - t0) * k / n)


def test_the_first_plan_waits_for_every_group_then_tells_each_its_share():
    p = HostPlacement(2, min_interval_s=2.0)
    observe(p, 0, budget=2 * MB, models="abcd")
    observe(p, 1, budget=2 * MB, models="abcd")
    assert not p.due(0.0)  # the groups have not all started
    p.started = True
    assert p.due(0.0)
    changes = p.replan(0.0)
    assert set(changes) == {0, 1}
    told = {g: set(models) for g, (models, _) in changes.items()}
    assert told[0] | told[1] == set("abcd") and len(told[0]) == len(told[1]) == 2  # equal rates: spread
    tell_all(p, changes)
    assert p.told == {0: frozenset(told[0]), 1: frozenset(told[1])}
    assert not p.due(1.0) and not p.due(5.0)  # nothing changed, and no request yet: the launch plan stands


def test_a_skewed_mix_replans_after_the_minimum_interval_and_tells_only_the_groups_that_change():
    p = placement()
    first = p.replan(0.0)
    tell_all(p, first)
    assert p.plan == {0: {"a"}, 1: {"b"}}  # room for two of three, equal rates: by name
    assert p.next_plan_at(1.0) is None  # no request yet
    arrivals(p, {"c": 40, "a": 4}, 0.5, 1.9)
    assert not p.due(1.9) and p.next_plan_at(1.9) == 2.0  # within min_interval_s of the last plan: a timer
    assert p.due(2.0)
    changes = p.replan(2.0)
    # the hot model gets a copy; "a" keeps its place on group 0; group 1 swaps "b" for "c"
    assert p.plan == {0: {"a"}, 1: {"c"}}
    assert list(changes) == [1] and changes[1][0] == ("c",)
    assert not p.due(4.5)  # group 1's call is in flight: not told twice
    tell_all(p, changes)
    assert not p.due(4.5)
    arrivals(p, {"c": 40, "a": 4}, 4.5, 6.0)  # the same mix: no new plan
    assert not p.due(6.0)


def test_the_busiest_model_is_read_first():
    p = placement(budget=3 * MB)
    arrivals(p, {"b": 9, "c": 3, "a": 1}, 0.0, 1.0)
    changes = p.replan(1.0)
    told = [m for models, _ in changes.values() for m in models]
    for models, _ in changes.values():
        assert list(models) == sorted(models, key=lambda m: "bca".index(m))
    assert set(told) >= set(MODELS)


def test_a_group_that_goes_down_or_fails_a_call_is_told_again():
    p = placement()
    tell_all(p, p.replan(0.0))
    p.down(1)  # Ray restarted it: nothing planned there any more
    assert p.told[1] is None
    observe(p, 1)
    assert p.due(2.0)
    changes = p.replan(2.0)
    assert list(changes) == [1] and changes[1][0] == ("b",)
    p.down(1)  # it died again before answering: that answer is stale
    p.applied(1, ("b",), changes[1][1])
    assert p.told[1] is None
    observe(p, 1)
    changes = p.replan(4.0)
    p.failed(1, changes[1][1])
    assert p.due(6.0)
    assert list(p.replan(6.0)) == [1]


def test_a_model_a_group_does_not_serve_yet_is_left_out_until_it_does():
    p = HostPlacement(1, min_interval_s=2.0)
    observe(p, 0, budget=2 * MB, models="ab", served="a")
    p.started = True
    changes = p.replan(0.0)
    assert p.plan == {0: {"a", "b"}} and changes[0][0] == ("a",)
    tell_all(p, changes)
    assert not p.due(2.0)
    observe(p, 0, budget=2 * MB, models="ab", served="ab")  # the catalog's version of "b" is there now
    assert p.due(2.0)
    assert p.replan(2.0)[0][0] == ("a", "b")


def test_without_a_host_budget_nothing_is_planned_and_that_is_said_once(caplog):
    p = placement(budget=None)
    with caplog.at_level(logging.INFO, logger="computron.cluster"):
        assert p.due(0.0) and p.replan(0.0) == {}
        arrivals(p, {"a": 10}, 0.0, 1.0)
        assert not p.due(3.0)
        observe(p, 0, budget=None, models="abc", load_s={"a": 0.1})  # new figures: looked at again
        assert p.due(3.0) and p.replan(3.0) == {}
    assert sum("no engine group has a host_budget" in r.message for r in caplog.records) == 1


def test_a_disk_load_costs_what_was_measured_else_its_bytes_at_the_measured_rate():
    p = placement()
    observe(p, 0, load_s={"a": 0.5}, disk_load_s={"a": 2.5, "b": 1.0})
    observe(p, 1, load_s={"a": 0.5}, disk_load_s={"a": 1.5})
    extra = p.disk_extra_s({"a": MB, "b": MB, "c": 4 * MB})
    assert extra["a"] == pytest.approx(1.5)  # the mean of 2.0 and 1.0
    assert extra["b"] == pytest.approx(1.0)  # only a disk load measured
    assert extra["c"] == pytest.approx(4 * MB / ((MB / 1.5 + MB / 1.0) / 2))
    assert HostPlacement(1).disk_extra_s({"a": 2e9}) == {"a": pytest.approx(2.0)}  # 1 GB/s assumed


def test_rates_decay_over_the_window_and_the_mix_change_is_a_distance():
    r = DecayedRates(window_s=10.0)
    for k in range(1000):
        r.add("a", k * 0.1)  # 10 requests/s for 100 s
    assert r.rates(99.9)["a"] == pytest.approx(10.0, rel=0.05)
    assert r.rates(109.9)["a"] == pytest.approx(10.0 * math.exp(-1), rel=0.05)
    assert mix_change({"a": 1.0}, {"a": 1.0}) == 0.0
    assert mix_change({"a": 1.0}, {"b": 1.0}) == 1.0
    assert mix_change({"a": 0.5, "b": 0.5}, {"a": 0.75, "b": 0.25}) == pytest.approx(0.25)


def test_a_copy_that_fits_nowhere_takes_the_place_of_copies_of_less_gain():
    """Budgets of 1.5 shards: three copies fit in all, but one per group. Copies that stayed (a, b: no
    request any more) give way to the model that became hot, on one group; the other keeps its copy."""
    from computron.cluster.planner import plan
    sizes = {m: MB for m in MODELS}
    budgets = {0: int(1.5 * MB), 1: int(1.5 * MB)}
    out = plan({"c": 5.0}, sizes, {m: 1.0 for m in MODELS}, budgets, previous={0: {"a"}, 1: {"b"}})
    assert out == {0: {"c"}, 1: {"b"}}
    # a copy of more gain stays: c's second copy (half of a first copy's gain at most) displaces nothing
    out = plan({"a": 4.0, "c": 5.0}, sizes, {m: 1.0 for m in MODELS}, budgets, previous={0: {"a"}, 1: {"c"}})
    assert out == {0: {"a"}, 1: {"c"}}
    # nor for a little more gain: the noise of a rate estimate moves no copy
    out = plan({"a": 1.0, "b": 1.0, "c": 1.1}, sizes, {m: 1.0 for m in MODELS}, budgets,
               previous={0: {"a"}, 1: {"b"}})
    assert out == {0: {"a"}, 1: {"b"}}
