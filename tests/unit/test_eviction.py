"""Unit tests of the eviction policies (``computron.sched.eviction``) alone and inside the scheduler (pure)."""
import pytest

from test_scheduler import load, offload, run

from computron.config import EngineConfig
from computron.sched.eviction import EVICTIONS, HALF_LIFE_S, CostEviction, LruEviction, make_eviction
from computron.sched.scheduler import Scheduler


def serve(s, m, t, arrivals=1):
    """``arrivals`` requests for ``m`` at time ``t``, loaded if need be (into free room) and served."""
    for _ in range(arrivals):
        s.note_arrival(m, t)
    actions = s.decide({m: t}, (), t)
    if actions == [load(m)]:
        s.on_loaded(m)
        actions = s.decide({m: t}, (), t)
    assert actions == [run(m)], actions
    s.on_batch_done(m)


def victims(s, m, t):
    """Who leaves for ``m``, asked at ``t``."""
    s.note_arrival(m, t)
    return [a.model_id for a in s.decide({m: t}, (), t) if a.kind.value == "offload"]


def test_names_and_config():
    assert EVICTIONS == ("lru", "cost")
    assert isinstance(make_eviction("lru", {}), LruEviction)
    assert isinstance(make_eviction("cost", {}), CostEviction)
    with pytest.raises(ValueError, match=r"eviction='fifo': must be one of \('lru', 'cost'\)"):
        Scheduler(["a"], 1, eviction="fifo")
    with pytest.raises(ValueError, match=r"EngineConfig.eviction='fifo': must be one of"):
        EngineConfig(eviction="fifo")
    assert EngineConfig(eviction="cost").eviction == "cost"
    assert EngineConfig().eviction == "lru"


def test_a_policy_object_is_used_as_given():
    """A simulation's own policy (benchmarks/residency_sim.py's bounds): the scheduler feeds it every model
    and follows its order, and names it by its ``name``."""
    class Alphabetical(LruEviction):
        name = "alphabetical"

        def key(self, m):
            return (m,)
    policy = Alphabetical()
    assert make_eviction(policy, {}) is policy
    s = _big_and_small(policy, 1, 1, small_first=True)   # small used first: LRU's victim
    assert s.eviction == "alphabetical" and set(policy._last_used) == {"big", "small", "new"}
    assert victims(s, "new", 0.2) == ["big"]


def test_make_scheduler_passes_the_eviction_policy():
    from computron.comm import messages as msg
    from computron.engine.budget import make_scheduler
    from computron.config import ModelConfig
    workers = [msg.WorkerReady(rank=0, pid=1, host="h", device="cpu", host_bytes={"a": 100, "b": 300})]
    configs = [ModelConfig(m, dict) for m in ("a", "b")]
    s = make_scheduler(EngineConfig(eviction="cost", max_loaded=None, device_budget=1000), configs, workers)
    assert s.eviction == "cost" and isinstance(s._eviction, CostEviction)
    assert s.sizes == {"a": 110, "b": 330}
    assert make_scheduler(EngineConfig(), configs, workers).eviction == "lru"


def test_rate_halves_every_half_life_and_tracks_a_steady_rate():
    ev = CostEviction({"a": 1})
    ev.add("a")
    ev.note_arrival("a", 0.0)
    r0 = ev.rate("a")
    ev._advance(HALF_LIFE_S)
    assert ev.rate("a") == pytest.approx(r0 / 2)
    ev2 = CostEviction({"a": 1})
    ev2.add("a")
    for i in range(2000):                        # 4 per second for 500 s
        ev2.note_arrival("a", i / 4)
    assert ev2.rate("a") == pytest.approx(4.0, rel=0.1)


def test_reload_seconds_measured_then_mean_bandwidth_then_size():
    sizes = {"a": 100, "b": 300}
    ev = CostEviction(sizes)
    for m in sizes:
        ev.add(m)
    assert (ev.reload_s("a"), ev.reload_s("b")) == (100, 300)      # no load yet: bytes as the proxy
    ev.record_load("a", 2.0, 100)                                  # 50 B/s
    assert ev.reload_s("a") == 2.0 and ev.reload_s("b") == pytest.approx(6.0)
    ev.record_load("a", 0.5, 100)                                  # its own latest load counts
    assert ev.reload_s("a") == 0.5 and ev.reload_s("b") == pytest.approx(300 / (200 / 2.5))


def _big_and_small(eviction, big, small, small_first=False):
    """big (300) and small (100) resident, asked ``big`` and ``small`` times; a budget of 450, so a third
    model of 100 needs one of them to leave. Big is used first unless ``small_first``."""
    sizes = {"big": 300, "small": 100, "new": 100}
    s = Scheduler(list(sizes), None, sizes=sizes, device_budget=450, max_inflight=1, eviction=eviction)
    for m, n, t in (("small", small, 0.0), ("big", big, 0.1)) if small_first else \
            (("big", big, 0.0), ("small", small, 0.1)):
        serve(s, m, t, arrivals=n)
    return s


def test_cost_values_reload_cost_per_byte_of_room():
    """GreedyDual-Size: the big model reloads 3x slower but holds 3x the room; asked less often than the
    small one, it leaves (LRU and a cost not divided by the size would evict the small one here)."""
    assert victims(_big_and_small("lru", 3, 4, small_first=True), "new", 0.2) == ["small"]
    s = _big_and_small("cost", 3, 4, small_first=True)
    ev = s._eviction
    assert ev.repeat_rate("small") > ev.repeat_rate("big")
    assert ev.repeat_rate("big") * ev.reload_s("big") > ev.repeat_rate("small") * ev.reload_s("small")
    assert victims(s, "new", 0.2) == ["big"]


def test_cost_weighs_rate_against_reload_cost_per_byte():
    def scenario(n_small_requests):
        return victims(_big_and_small("cost", 3, n_small_requests), "new", 0.5)
    assert scenario(2) == ["small"]              # asked less often than big: it leaves, small as it is
    assert scenario(4) == ["big"]                # asked more often: it keeps its room, big as the other is


def test_cost_does_not_count_the_latest_request():
    """A model asked once, just now, has shown no rate yet: it leaves before one asked steadily, although it
    was used last (LRU evicts the steady one)."""
    def scenario(eviction):
        s = Scheduler(["steady", "once", "new"], 2, max_inflight=1, eviction=eviction,
                      sizes=dict.fromkeys(["steady", "once", "new"], 100))
        for i in range(3):
            serve(s, "steady", float(i))
        serve(s, "once", 3.0)
        return s, victims(s, "new", 3.1)
    assert scenario("lru")[1] == ["steady"]
    s, out = scenario("cost")
    assert out == ["once"]
    assert s._eviction.repeat_rate("once") == 0.0 and s._eviction.rate("once") > 0
    assert s._eviction.repeat_rate("steady") == pytest.approx(
        s._eviction.rate("steady") * 2 / 3, rel=0.1)  # two of its three arrivals


def test_cost_keeps_the_model_that_reloads_slowly():
    """Same size, same requests: the one whose measured load took longer (e.g. read from disk) stays."""
    ids = ["slow", "fast", "new"]
    s = Scheduler(ids, 2, max_inflight=1, eviction="cost", sizes=dict.fromkeys(ids, 100))
    serve(s, "slow", 0.0, arrivals=2)
    serve(s, "fast", 0.1, arrivals=2)
    s.record_load("slow", 2.0, 100)
    s.record_load("fast", 0.1, 100)
    serve(s, "slow", 0.2)                        # refreshed with the measured reload times
    serve(s, "fast", 0.3)
    assert victims(s, "new", 0.4) == ["fast"]


def test_cost_still_honours_pinned_and_priority():
    for kw, expected in (({"pinned": ["small"]}, ["big"]), ({"priority": {"small": 1}}, ["big"]),
                         ({"priority": {"big": 1}}, ["small"])):
        sizes = {"big": 300, "small": 100, "new": 100}
        s = Scheduler(list(sizes), None, sizes=sizes, device_budget=450, max_inflight=1, eviction="cost", **kw)
        serve(s, "big", 0.0)
        serve(s, "small", 0.1, arrivals=20)       # small is hot: cost alone would keep it
        if not kw.get("pinned"):
            assert s._eviction.value("small") > s._eviction.value("big") or kw["priority"].get("big")
        assert victims(s, "new", 0.2) == expected, kw


def test_cost_ages_out_a_model_that_was_hot_long_ago():
    """A burst makes ``old`` valuable; once its requests stop, the evictions among the other models raise
    the floor L past its stale value and it leaves, although it was never the least valuable when used."""
    ids = ["old", "x", "y", "z"]
    s = Scheduler(ids, 2, max_inflight=1, eviction="cost", sizes=dict.fromkeys(ids, 100))
    serve(s, "old", 0.0, arrivals=30)
    h_old = s._eviction.value("old")
    t, evicted_old = 1.0, None
    for i in range(60):                          # x, y, z take turns in the other slot, once a second
        m = ["x", "y", "z"][i % 3]
        s.note_arrival(m, t)
        actions = s.decide({m: t}, (), t)
        out = [a.model_id for a in actions if a.kind.value == "offload"]
        if "old" in out:
            evicted_old = i
            break
        for v in out:
            s.on_offloaded(v)
        if load(m) not in actions:
            assert s.decide({m: t}, (), t) == [load(m)]
        s.on_loaded(m)
        assert s.decide({m: t}, (), t) == [run(m)]
        s.on_batch_done(m)
        t += 1.0
    assert evicted_old is not None and evicted_old > 3, evicted_old
    assert s._eviction._floor >= h_old   # the floor rose to old's stale value: it was the lowest


def test_cost_ranks_never_asked_models_least_recently_used_first():
    s = Scheduler(["a", "b", "c"], 2, max_inflight=1, eviction="cost")
    for m in ("a", "b"):
        assert s.decide({m: 0.0}) == [load(m)]
        s.on_loaded(m)
    for m in ("b", "a"):
        assert s.decide({m: 0.0}) == [run(m)]
        s.on_batch_done(m)
    assert s.decide({"c": 1.0}) == [offload("b")]


def test_cost_keeps_a_victim_that_a_bigger_one_made_unnecessary():
    """The cheap model goes first in cost order, but the big one alone makes the room: the cheap one stays.
    LRU evicts in its order until the model fits, both here."""
    def scenario(eviction):
        sizes = {"small": 100, "big": 300, "new": 300}
        s = Scheduler(list(sizes), None, sizes=sizes, device_budget=450, max_inflight=1, eviction=eviction)
        serve(s, "small", 0.0)
        serve(s, "big", 0.1, arrivals=5)
        return victims(s, "new", 0.2)
    assert scenario("lru") == ["small", "big"]
    assert scenario("cost") == ["big"]
