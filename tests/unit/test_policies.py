"""Unit tests of the token-level policies, byte budgets, pinning and priorities, and models added and
removed while serving (pure, no workers)."""
import pytest

from test_scheduler import load, offload, run, use

from computron.sched.policies import APART_MIN_WASTE, prefill_apart
from computron.sched.scheduler import MIN_TURN_STEPS, ActionKind, ModelState, Scheduler, choose_recompute


def steps(s, m, n, t0, dt=0.01, running=None):
    """``n`` steps of ``m`` (alone in heads), each answered; returns the clock after them."""
    t = t0
    for _ in range(n):
        assert s.decide({m: 0.0}, running or [m], t) == [run(m)]
        s.on_batch_done(m)
        t += dt
    return t


def loaded(s, m, t=0.0):
    assert s.decide({m: t}, [m], t)[0] == load(m)
    s.on_loaded(m)


def test_just_loaded_model_with_work_is_not_evicted_before_its_first_batch():
    # 4 models, 2 slots, prefetch: c loads slowly, d has just loaded and has a waiting request,
    # while older b waits too. Evicting d (the only idle resident model) would waste its load.
    s = Scheduler(list("abcd"), 2, prefetch=True)
    assert s.decide({"c": 0.0}) == [load("c")]
    assert s.decide({"c": 0.0, "d": 6.0}) == [load("d")]
    s.on_loaded("d")
    actions = s.decide({"b": 0.0, "c": 0.0, "d": 6.0})
    assert offload("d") not in actions
    assert actions == [run("d")]
    s.on_batch_done("d")
    # once served (and idle, with no more work) it is the LRU victim as before
    assert s.decide({"b": 0.0, "c": 0.0}) == [offload("d")]


def test_run_to_completion_never_preempts_a_running_model():
    s = Scheduler(["a", "b"], 1, policy="run_to_completion", max_inflight=1)
    loaded(s, "a")
    t = steps(s, "a", 50, 0.0, dt=0.1)
    assert s.decide({"a": 0.0, "b": 1.0}, ["a"], t) == [run("a")]  # b waits as long as a runs


def test_quantum_preempts_after_its_turn_and_minimum_steps():
    s = Scheduler(["a", "b"], 1, policy="quantum", quantum_s=0.2, max_inflight=1)
    loaded(s, "a")
    t = steps(s, "a", MIN_TURN_STEPS, 0.0, dt=0.01)       # enough steps, but only 0.04 s of turn
    assert s.decide({"a": 0.0, "b": t}, ["a"], t) == [run("a")]
    s.on_batch_done("a")
    t = 0.25                                               # the turn is over: b preempts a
    actions = s.decide({"a": 0.0, "b": 0.1}, ["a"], t)
    assert actions == [run("a"), offload("a"), load("b")] or actions == [offload("a"), load("b")]
    preempting = [a for a in actions if a.preempts]
    assert preempting == [offload("a")] and preempting[0].for_model == "b"
    assert not s.can_accept_batches("a")                   # no step after the queued offload
    if actions[0] == run("a"):
        s.on_batch_done("a")
    s.on_offloaded("a")
    s.on_loaded("b")
    # a's sequences are paused: it has work again and gets the slot back after b's own turn
    t2 = steps(s, "b", MIN_TURN_STEPS, 0.3, dt=0.01, running=["a", "b"])
    assert s.decide({"a": t, "b": 0.1}, ["a", "b"], t2) == [run("b")]
    s.on_batch_done("b")
    assert s.decide({"a": t, "b": 0.1}, ["a", "b"], 0.6)[-2:] == [offload("b"), load("a")]


def test_short_quantum_still_gives_each_turn_a_few_steps():
    s = Scheduler(["a", "b"], 1, policy="quantum", quantum_s=0.001, max_inflight=1)
    loaded(s, "a")
    t = steps(s, "a", MIN_TURN_STEPS - 2, 0.0, dt=1.0)
    assert s.decide({"a": 0.0, "b": 0.5}, ["a"], t) == [run("a")]       # step MIN_TURN_STEPS - 1
    s.on_batch_done("a")
    assert s.decide({"a": 0.0, "b": 0.5}, ["a"], t + 1) == [run("a"), offload("a"), load("b")]


def test_deadline_orders_by_the_oldest_waiting_request_and_preempts_for_urgency():
    s = Scheduler(["a", "b", "c"], 1, policy="deadline", ttft_slo_s=1.0, quantum_s=0.2, max_inflight=1)
    # nothing resident: the most urgent (oldest) waiting model loads first
    assert s.decide({"b": 0.5, "c": 0.2}, [], 0.6) == [load("c")]
    s.on_loaded("c")
    steps(s, "c", MIN_TURN_STEPS, 0.6, dt=0.02)
    # b has used less than half of its objective: c keeps running
    assert s.decide({"b": 0.5, "c": 0.2}, ["c"], 0.9) == [run("c")]
    s.on_batch_done("c")
    # past half of its objective: c is preempted for b
    assert s.decide({"b": 0.5, "c": 0.2}, ["c"], 1.1)[-2:] == [offload("c"), load("b")]


def test_deadline_anti_starvation_beats_priority_order():
    s = Scheduler(["low", "high", "x"], 1, policy="deadline", ttft_slo_s=1.0, priority={"high": 5},
                  max_inflight=1)
    # "low" has waited 4 objectives: it goes before the higher-priority, fresher "high"
    assert s.decide({"low": 0.0, "high": 3.9}, [], 4.0) == [load("low")]


def test_no_starvation_under_a_steady_stream_to_one_model():
    """A keeps a full running batch forever; B's single request is served within about a quantum."""
    for policy in ("quantum", "deadline"):
        s = Scheduler(["a", "b"], 1, policy=policy, quantum_s=0.2, ttft_slo_s=0.4, max_inflight=1)
        loaded(s, "a")
        t, served = 0.0, None
        for i in range(1000):
            heads = {"a": 0.0, "b": 1.0} if t >= 1.0 else {"a": 0.0}
            actions = s.decide(heads, ["a"], t)
            if load("b") in actions:
                served = t
                break
            if run("a") in actions:
                s.on_batch_done("a")
            t += 0.01
        assert served is not None and served - 1.0 <= 0.4 + 0.05, (policy, served)


def test_byte_budget_evicts_until_the_big_model_fits():
    sizes = {"big": 80, "s1": 30, "s2": 30}
    s = Scheduler(list(sizes), None, sizes=sizes, device_budget=100, max_inflight=1)
    assert s.decide({"s1": 0.0, "s2": 0.1}) == [load("s1"), load("s2")]  # both small ones fit at once
    s.on_loaded("s1")
    s.on_loaded("s2")
    actions = s.decide({"big": 1.0})
    assert sorted(a.model_id for a in actions if a.kind is ActionKind.OFFLOAD) == ["s1", "s2"]
    s.on_offloaded("s1")
    assert s.decide({"big": 1.0}) == []            # 30 + 80 > 100: still waits for s2
    s.on_offloaded("s2")
    assert s.decide({"big": 1.0}) == [load("big")]


def test_budget_refuses_a_model_that_can_never_fit():
    with pytest.raises(ValueError, match=r"'huge' \(120 bytes"):
        Scheduler(["a", "huge"], None, sizes={"a": 10, "huge": 120}, device_budget=100)
    with pytest.raises(ValueError, match="needs a device_budget"):
        Scheduler(["a"], None)


def test_pinned_is_never_evicted_and_priority_is_evicted_last():
    s = Scheduler(["p", "hi", "lo"], 2, pinned=["p"], max_inflight=1)
    for m in ("p", "hi"):
        assert s.decide({m: 0.0}) == [load(m)]
        s.on_loaded(m)
    s.decide({"hi": 0.0})
    s.on_batch_done("hi")  # p is the least recently used, but pinned
    assert s.decide({"lo": 1.0}) == [offload("hi")]

    s2 = Scheduler(["hi", "lo", "new"], 2, priority={"hi": 3}, max_inflight=1)
    for m in ("hi", "lo"):
        assert s2.decide({m: 0.0}) == [load(m)]
        s2.on_loaded(m)
    s2.decide({"lo": 0.0})
    s2.on_batch_done("lo")  # "hi" is least recently used, but has the higher priority
    assert s2.decide({"new": 1.0}) == [offload("lo")]
    # and among waiting models the higher priority is visited (loaded) first
    s3 = Scheduler(["a", "b"], 1, priority={"b": 1})
    assert s3.decide({"a": 0.0, "b": 5.0}) == [load("b")]


def test_choose_recompute_keeps_long_contexts_and_unknown_rates():
    contexts = {1: 16, 2: 20000}
    # copying costs 2 * 1000 B / 1e9 B/s = 2 us per token; prefill 1e6 tokens/s = 1 us per token
    assert choose_recompute(contexts, 1000, 1e9, 1e6) == {1}
    assert choose_recompute(contexts, 1000, 1e9, 1e3) == set()    # slow prefill: copy everything
    assert choose_recompute(contexts, 0, 1e9, 1e6) == set()       # unknown KV size: keep the caches


# ---- models changing while serving ---------------------------------------------

def _internals(s, m):
    """Every internal container that still mentions ``m``."""
    found = [name for name, v in vars(s).items()
             if isinstance(v, (dict, set, list)) and (m in v or (isinstance(v, dict) and m in v.values()))]
    found += [f"_eviction.{name}" for name, v in vars(s._eviction).items() if isinstance(v, dict) and m in v]
    return found


def test_add_model_starts_offloaded_and_is_scheduled_like_the_others():
    s = Scheduler(["a"], 1, max_inflight=1)
    s.add_model("b")
    assert s.state("b") is ModelState.OFFLOADED and s.model_ids == ["a", "b"]
    assert s.decide({"b": 0.0}) == [load("b")]
    s.on_loaded("b")
    assert s.decide({"b": 0.0}) == [run("b")]


def test_added_model_ties_after_the_others_even_after_a_removal():
    s = Scheduler(["a", "b", "c"], 3)
    s.remove_model("a")
    s.add_model("d")
    s.add_model("a")                     # back, but now the newest
    assert s.decide({"a": 0.0, "d": 0.0, "c": 0.0}) == [load("c"), load("d"), load("a")]


def test_add_model_errors():
    s = Scheduler(["a"], None, sizes={"a": 10}, device_budget=100)
    with pytest.raises(ValueError, match="'a' is already known"):
        s.add_model("a", 10)
    with pytest.raises(ValueError, match=r"device_budget=100 bytes per rank cannot hold model 'huge' \(120 bytes"):
        s.add_model("huge", 120)
    assert "huge" not in s.model_ids
    s.add_model("ok", 100)               # exactly the budget fits


def test_added_model_counts_against_the_budget_and_keeps_pinned_and_priority():
    s = Scheduler(["a", "b"], None, sizes={"a": 40, "b": 40}, device_budget=100, max_inflight=1)
    s.add_model("c", 60, priority=2)
    for m in ("a", "b"):
        assert s.decide({m: 0.0}) == [load(m)]
        s.on_loaded(m)
        use(s, m)
    # c needs 60: one 40 must go (a, the least recently used), not both
    assert s.decide({"c": 1.0}) == [offload("a")]
    s.on_offloaded("a")
    assert s.decide({"c": 1.0}) == [load("c")]
    s.on_loaded("c")
    use(s, "c")
    s.add_model("p", 40, pinned=True)
    assert s.is_pinned("p") and s.priority["c"] == 2
    # p needs 40: b (priority 0) leaves, not c (priority 2) although c is the most recently used either way
    assert s.decide({"p": 2.0}) == [offload("b")]


def test_remove_offloaded_model_forgets_it_everywhere():
    s = Scheduler(["a", "b"], 1, sizes={"a": 1, "b": 1}, pinned=["b"], priority={"b": 3}, eviction="cost")
    s.note_arrival("b", 0.0)
    s.record_load("b", 0.5, 2)
    s.remove_model("b")
    assert _internals(s, "b") == []
    with pytest.raises(KeyError, match=r"unknown model ids in heads: \['b'\]"):
        s.decide({"b": 0.0})


def test_remove_loaded_idle_model_frees_its_slot_at_once():
    s = Scheduler(["a", "b"], 1, max_inflight=1)
    assert s.decide({"a": 0.0}) == [load("a")]
    s.on_loaded("a")
    use(s, "a")
    s.remove_model("a")
    assert _internals(s, "a") == [] and s.resident() == []
    assert s.decide({"b": 1.0}) == [load("b")]          # no offload of a: the engine freed it


def test_remove_model_refuses_busy_states_naming_them():
    s = Scheduler(["a", "b", "c"], 1, prefetch=True, max_inflight=1)
    assert s.decide({"a": 0.0}) == [load("a")]
    with pytest.raises(RuntimeError, match="'a' is loading"):
        s.remove_model("a")
    s.on_loaded("a")
    assert s.decide({"a": 0.0}) == [run("a")]
    with pytest.raises(RuntimeError, match="'a' is loaded with 1 batches in flight"):
        s.remove_model("a")
    # prefetch: b waits, a's queue is empty: a's offload is queued behind its batch
    assert s.decide({"b": 1.0}) == [offload("a"), load("b")]
    with pytest.raises(RuntimeError, match="'a' is loaded with 1 batches in flight and its offload queued"):
        s.remove_model("a")
    s.on_batch_done("a")
    with pytest.raises(RuntimeError, match="'a' is offloading: "):
        s.remove_model("a")
    s.on_offloaded("a")
    s.remove_model("a")
    assert s.state("b") is ModelState.LOADING


def test_removing_a_model_waiting_for_a_victims_slot_drops_the_promise():
    s = Scheduler(["a", "b", "c"], 1, max_inflight=1)
    assert s.decide({"a": 0.0}) == [load("a")]
    s.on_loaded("a")
    use(s, "a")
    assert s.decide({"b": 1.0}) == [offload("a")]       # a's slot is promised to b
    s.remove_model("b")
    assert _internals(s, "b") == []
    s.on_offloaded("a")
    assert s.decide({"c": 2.0}) == [load("c")]


def test_set_pinned_and_set_priority():
    s = Scheduler(["a", "b", "c"], 2, max_inflight=1)
    for m in ("a", "b"):
        assert s.decide({m: 0.0}) == [load(m)]
        s.on_loaded(m)
        use(s, m)
    s.set_pinned("a", True)                             # a is the LRU one, but pinned now
    assert s.decide({"c": 1.0}) == [offload("b")]
    s.on_offloaded("b")
    assert s.decide({"c": 1.0}) == [load("c")]
    s.on_loaded("c")
    use(s, "c")
    s.set_pinned("a", False)
    s.set_priority("a", 5)                              # a is the LRU one, but has the higher priority
    assert s.decide({"b": 2.0}) == [offload("c")]


@pytest.mark.parametrize("call", [
    lambda s: s.set_pinned("x", True), lambda s: s.set_priority("x", 1), lambda s: s.note_arrival("x", 0.0),
    lambda s: s.record_load("x", 1.0, 10), lambda s: s.remove_model("x"), lambda s: s.state("x"),
    lambda s: s.on_loaded("x"), lambda s: s.on_offloaded("x"), lambda s: s.on_batch_done("x"),
    lambda s: s.in_flight("x"), lambda s: s.is_pinned("x"), lambda s: s.can_accept_batches("x"),
])
def test_unknown_model_ids_are_a_clear_error(call):
    with pytest.raises(KeyError, match="unknown model id 'x'"):
        call(Scheduler(["a"], 1))


def test_note_arrival_and_record_load_feed_the_cost_estimates():
    s = Scheduler(["a", "b"], 1, sizes={"a": 100, "b": 300}, eviction="cost")
    ev = s._eviction
    assert ev.reload_s("b") == 300                      # nothing measured: the size stands in
    s.record_load("a", 0.5, 400)                        # 100 bytes per rank in 0.5 s: 200 B/s
    assert ev.reload_s("a") == 0.5 and ev.reload_s("b") == pytest.approx(1.5)
    for t in range(4):
        s.note_arrival("a", float(t))
    assert ev.rate("a") > 0 and ev.rate("b") == 0
    with pytest.raises(ValueError, match="must be >= 0"):
        s.record_load("a", -1.0, 10)


def test_prefill_apart_where_padding_would_waste_most_of_a_costly_step():
    shard = 500_000_000  # opt-125m in fp32, one rank
    assert not prefill_apart(0, [24], shard, "cpu")             # nothing runs: a plain prefill
    assert not prefill_apart(4, [], shard, "cpu")               # nothing joins: a plain decode
    assert prefill_apart(4, [24], shard, "cpu")                 # 92 of 120 positions wasted
    assert not prefill_apart(8, [2], shard, "cpu")              # 8 wasted, 10 needed
    assert not prefill_apart(4, [24], 100_000, "cpu")           # a tiny model: a second forward costs more
    assert 4 * 23 * shard < APART_MIN_WASTE["cuda"] and not prefill_apart(4, [24], shard, "cuda")
    assert prefill_apart(40, [24], 14_000_000_000, "cuda")     # a 7B shard in fp16, 920 positions wasted
    assert prefill_apart(40, [24], 14_000_000_000, "xpu") == prefill_apart(40, [24], 14_000_000_000, "cuda")
