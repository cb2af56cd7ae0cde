"""What a group pushes from its first push (``costs.py``) and how the router costs a group that has measured
nothing yet: from the fleet's own figures, not a constant (issue 37, item 3)."""
import types

from computron.cluster.costs import GroupCosts, group_state
from computron.cluster.policy import DEFAULT_LOAD_S, GroupState, SwapAwareRouter
from computron.config import EngineConfig
from computron.engine.protocol import EngineSnapshot, ModelSnapshot
from computron.metrics import StepRecord, SwapRecord

MODELS = frozenset({"a", "b", "c", "d"})


def snapshot(**states):
    models = {m: ModelSnapshot(state=s, tier="host" if s != "loaded" else "device", waiting=0, running=0, paused=0,
                           token_level=False, pinned=False)
              for m, s in states.items()}
    return EngineSnapshot(True, None, models)


def test_the_first_push_carries_max_loaded_max_batch_and_the_start_ups_measured_loads():
    costs = GroupCosts()
    costs.seed([SwapRecord("load", "a", 1.0, 1.25), SwapRecord("load", "b@v2", 2.0, 2.5, tier="disk"),
                SwapRecord("load", "c", 3.0, 9.0, error="boom"),
                StepRecord("a", 4.0, 4.1, running=3, admitted=0, dropped=0)])
    cfg = EngineConfig(max_loaded=2, max_batch_size=8)
    st = group_state(1, snapshot(a="loaded", b="offloaded"), ["a", "b"], costs, {"a": 5, "b": 0}, 1, cfg)
    assert (st.group, st.max_loaded, st.max_batch, st.seq) == (1, 2, 8, 1)
    assert st.resident == {"a"} and st.host == {"b"} and st.served == {"a", "b"} and st.queued_tokens == {"a": 5}
    assert st.load_s == {"a": 0.25} and st.disk_load_s == {"b": 0.5}
    assert abs(st.step_s - 0.1) < 1e-9 and abs(st.batch - (0.7 + 0.3 * 3)) < 1e-9
    # a byte budget alone (max_loaded None) and no batch cap are pushed as 0: unknown
    cfg = types.SimpleNamespace(max_loaded=None, max_batch_size=0)
    st = group_state(0, snapshot(), [], GroupCosts(), {}, 1, cfg)
    assert (st.max_loaded, st.max_batch, st.load_s, st.step_s) == (0, 0, {}, 0.0)  # 0: unknown, unmeasured


def state(g, **kw):
    kw.setdefault("served", MODELS)
    return GroupState(g, seq=kw.pop("seq", 1), **kw)


def test_a_group_that_measured_nothing_is_costed_from_the_fleets_figures():
    # group 0 loaded 'a' in 0.01 s and serves it (max_loaded 1, work queued); group 1 has loaded nothing yet
    busy = state(0, resident=frozenset({"a"}), queued_tokens={"a": 16}, load_s={"a": 0.01}, max_loaded=1,
                 max_batch=8)
    r = SwapAwareRouter(2)
    r.update(busy)
    r.update(state(1, max_loaded=1, max_batch=8))
    assert r.swap_cost(1, "b") == r._load_estimate(r._groups[0], "b", disk=False) == 0.01
    assert r.swap_cost(1, "b") < DEFAULT_LOAD_S
    assert r.route("b", 16, 0.0) == 1  # not piled onto group 0 behind 'a''s turn


def test_early_traffic_spreads_over_both_groups():
    # the run: 10 requests over 4 models, one group with start-up figures, the other none
    r = SwapAwareRouter(2)
    r.update(state(0, load_s={"a": 0.01}, max_loaded=1, max_batch=8))
    r.update(state(1, max_loaded=1, max_batch=8))
    sent = [r.route(m, 16, t * 0.01) for t, m in enumerate("abcdabcdab")]
    assert sent.count(0) and sent.count(1)
    # every model keeps one group: no model is sent to both while neither is congested
    by_model = {m: {g for g, mm in zip(sent, "abcdabcdab") if mm == m} for m in "abcd"}
    assert all(len(gs) == 1 for gs in by_model.values()), by_model


def test_sequential_requests_over_four_models_fill_both_groups_slots_before_swapping():
    # the issue's symptom: one request at a time; group 0 measured a faster step than group 1's default, so
    # every new model went to group 0 (each a swap there) while group 1 sat idle
    r = SwapAwareRouter(2)
    r.update(state(0, host=MODELS, load_s={m: 0.01 for m in MODELS}, step_s=0.005, max_loaded=1, max_batch=8))
    r.update(state(1, host=MODELS, step_s=0.0, max_loaded=1, max_batch=8))  # measured nothing yet
    assert r.step_s(1) == 0.005
    first = r.route("a", 8, 0.0)
    r.finished(first, "a", 8)
    r.update(state(first, seq=2, host=MODELS - {"a"}, resident={"a"}, load_s={m: 0.01 for m in MODELS},
                   step_s=0.005, max_loaded=1, max_batch=8))
    assert r.evict_cost(first) == 0.01 and r.evict_cost(1 - first) == 0.0
    assert r.route("b", 8, 1.0) == 1 - first
