"""The engine in process, over fake workers (``fake_workers.py``): no worker process, no data plane,
no sleeps. Each test builds an ``Engine`` on a ``FakeChannel``, submits from an asyncio loop, answers
the commands it sends with the replies real workers would give (or failures), and checks what the
engine sent, what it answered and what it recorded."""
from __future__ import annotations

import asyncio
import functools
import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # fake_workers, whatever the import mode

from fake_workers import EOS, build_engine, expected_tokens, model_fn  # noqa: E402

from computron.comm import messages as msg  # noqa: E402
from computron.batching.base import BatchManager, TaskEntry  # noqa: E402
from computron.config import ModelConfig  # noqa: E402
from computron.engine import EngineSnapshot, ModelSnapshot  # noqa: E402
from computron.batching.causal_lm import CausalLMBatchManager  # noqa: E402
from computron.errors import (EngineDeadError, PayloadError, QueueFullError, RequestTimeoutError,  # noqa: E402
                              UnknownModelError, WorkerError)
from computron.metrics import KVRecord, RequestRecord, StepRecord, SwapRecord  # noqa: E402
from computron.sched.scheduler import MIN_TURN_STEPS  # noqa: E402

WAIT_S = 5.0
"""A safety net only: every await below completes as soon as the replies it needs are delivered."""


def async_test(fn):
    """Run an ``async def`` test in its own event loop (pytest-asyncio is not a dependency)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 4 * WAIT_S))
    return wrapper


async def started(coro):
    """Start ``coro`` as a task and let it run up to its first wait: its request is then queued."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0)  # a yield point for the loop, not a timer: the request is queued
    await asyncio.sleep(0)  # and the engine acts on it (after the tasks that were ready with it)
    return task


async def result(task):
    return await asyncio.wait_for(task, WAIT_S)


def gen(prompt=(5, 6, 7), max_tokens=4, **kw):
    return {"input_ids": list(prompt), "max_tokens": max_tokens, **kw}


def steps(w, model_id="a"):
    return w.channel.of_type(msg.Step, model_id)


# ---- token-level generation: loads and steps ---------------------------------------------------

@async_test
async def test_submit_sends_load_and_first_step_together_with_overlap():
    engine, w = build_engine(overlap=True)
    task = await started(engine.submit("a", gen(max_tokens=4)))
    assert w.channel.kinds() == [("Load", "a"), ("Step", "a")]
    assert steps(w)[0].admit == (msg.SeqSpec(sid=0, prompt=(5, 6, 7), max_tokens=4, eos=(EOS,)),)
    w.answer_all()
    out = await result(task)
    assert out.tolist() == expected_tokens(0, 3, 4)
    assert w.channel.kinds() == [("Load", "a")] + [("Step", "a")] * 4  # one step per token, none after
    assert [s.admit for s in steps(w)[1:]] == [()] * 3
    assert engine.model_states() == {"a": "loaded"}


@async_test
async def test_without_overlap_the_first_step_waits_for_loaded():
    engine, w = build_engine(overlap=False)
    task = await started(engine.submit("a", gen(max_tokens=3)))
    assert w.channel.kinds() == [("Load", "a")]
    assert engine.model_states() == {"a": "loading"}
    w.answer()  # every rank's Loaded
    assert w.channel.kinds() == [("Load", "a"), ("Step", "a")]
    assert engine.model_states() == {"a": "loaded"}
    w.answer_all()
    assert (await result(task)).tolist() == expected_tokens(0, 3, 3)


@pytest.mark.parametrize("step_ahead, n_steps", [(False, 5), (True, 6)])  # ahead: one step runs for nothing
@async_test
async def test_eos_ends_a_sequence_before_max_tokens_and_stream_yields_the_same_tokens(step_ahead, n_steps):
    full = expected_tokens(0, 3, 20, eos=())
    eos = full[4]  # the fifth token of sid 0 is made the EOS
    engine, w = build_engine(eos=eos, step_ahead=step_ahead, step_ahead_lead_ms=60_000)  # every step ahead
    tokens = []

    async def consume():
        async for t in engine.stream("a", gen(max_tokens=20)):
            tokens.append(t)
    task = await started(consume())
    w.answer_all()
    await result(task)
    assert tokens == full[:5] == expected_tokens(0, 3, 20, eos=(eos,))
    assert len(steps(w)) == n_steps
    assert w.sequences["a"] == {}


@async_test
async def test_step_admissions_respect_the_prompt_token_budget():
    # whole prompts: the paged pool would prefill the second one in chunks (tests/unit/test_chunking.py)
    engine, w = build_engine(max_step_tokens=5, overlap=False, kv_cache="dynamic")
    tasks = [await started(engine.submit("a", gen(prompt=(5, 6, 7), max_tokens=3))) for _ in range(3)]
    w.answer()  # Load
    w.answer_all()
    # 3 + 3 prompt tokens exceed max_step_tokens=5: one admission per step
    assert [[s.sid for s in st.admit] for st in steps(w)][:4] == [[0], [1], [2], []]
    outs = [(await result(t)).tolist() for t in tasks]
    assert outs == [expected_tokens(i, 3, 3) for i in range(3)]


@async_test
async def test_step_admissions_respect_the_batch_size():
    engine, w = build_engine(max_batch_size=2, overlap=False)
    tasks = [await started(engine.submit("a", gen(max_tokens=n))) for n in (2, 4, 1)]
    w.answer()  # Load
    w.answer_all()
    # the batch is full (2 running) until sid 0 ends with its second token
    assert [[s.sid for s in st.admit] for st in steps(w)] == [[0, 1], [], [2], []]
    outs = [(await result(t)).tolist() for t in tasks]
    assert outs == [expected_tokens(i, 3, n) for i, n in enumerate((2, 4, 1))]


# ---- eviction and preemption ------------------------------------------------------------------

@async_test
async def test_max_loaded_one_evicts_the_idle_model_before_loading_the_next():
    engine, w = build_engine(("a", "b"), policy="run_to_completion")
    ta = await started(engine.submit("a", gen(max_tokens=6)))
    w.answer()  # Load a
    w.answer()  # step 1 of a
    tb = await started(engine.submit("b", gen(prompt=(8, 9), max_tokens=2)))
    assert engine.model_states() == {"a": "loaded", "b": "offloaded"}  # a keeps its slot while it runs
    w.answer_until(lambda: w.channel.of_type(msg.Offload))
    last_a_step = max(i for i, c in enumerate(w.channel.sent) if isinstance(c, msg.Step) and c.model_id == "a")
    offload = w.channel.sent.index(w.channel.of_type(msg.Offload)[0])
    assert offload > last_a_step and not w.pending()[:-1]  # sent only once a's last step was answered
    assert engine.model_states() == {"a": "offloading", "b": "offloaded"}
    assert w.channel.of_type(msg.Load, "b") == []  # b's load waits for the slot
    w.answer()  # Offloaded
    assert engine.model_states()["a"] == "offloaded" and engine.model_states()["b"] == "loading"
    w.answer_all()
    assert (await result(ta)).tolist() == expected_tokens(0, 3, 6)
    assert (await result(tb)).tolist() == expected_tokens(1, 2, 2)
    assert w.channel.of_type(msg.Offload)[0].recompute == ()
    swaps = engine.metrics("offload")
    assert [(s.model_id, s.cause) for s in swaps] == [("a", "evicted (least recently used) to make room for b")]
    loads = engine.metrics("load")
    assert [s.model_id for s in loads] == ["a", "b"] and loads[1].cause.startswith("its oldest request has waited")
    assert engine.metrics("preemption") == []


@pytest.mark.parametrize("kv_swap", ["recompute", "offload"])
@async_test
async def test_quantum_preemption_pauses_and_resumes_with_the_same_tokens(kv_swap):
    engine, w = build_engine(("a", "b"), policy="quantum", quantum_ms=0.001, kv_swap=kv_swap)
    ta = await started(engine.submit("a", gen(max_tokens=12)))
    w.answer_until(lambda: len(steps(w, "a")) >= 2)
    tb = await started(engine.submit("b", gen(prompt=(8, 9), max_tokens=12)))
    w.answer_until(lambda: w.channel.of_type(msg.Offload))
    # a was preempted once it had its minimal turn; its offload is queued behind its step in flight
    assert len(steps(w, "a")) == MIN_TURN_STEPS
    # (and b's first step right behind its load: overlap, as no other model stays resident)
    assert w.channel.kinds()[-4:] == [("Step", "a"), ("Offload", "a"), ("Load", "b"), ("Step", "b")]
    offload = w.channel.of_type(msg.Offload)[0]
    assert offload.recompute == ((0,) if kv_swap == "recompute" else ())
    assert engine.snapshot().models["a"].paused == 1
    w.answer_all()
    a, b = (await result(ta)).tolist(), (await result(tb)).tolist()
    assert a == expected_tokens(0, 3, 12) and b == expected_tokens(1, 2, 12)
    pre = engine.metrics("preemption")
    assert (pre[0].model_id, pre[0].for_model) == ("a", "b")
    assert (pre[0].recomputed, pre[0].parked) == ((1, 0) if kv_swap == "recompute" else (0, 1))
    assert len(pre) >= 2 and {p.model_id for p in pre} == {"a", "b"}  # turns alternate
    readmitted = [s for st in steps(w, "a")[1:] for s in st.admit]
    if kv_swap == "recompute":  # rebuilt by prefill: prompt + tokens so far, the rest of max_tokens
        done = len(readmitted[0].prompt) - 3
        assert done >= MIN_TURN_STEPS and readmitted[0].prompt == (5, 6, 7) + tuple(a[:done])
        assert readmitted[0].max_tokens == 12 - done
    else:
        assert readmitted == []  # parked with its KV cache: it simply goes on
        assert all(o.recompute == () for o in w.channel.of_type(msg.Offload))
    records = {r.uid: r for r in engine.metrics("request")}
    assert records[0].preemptions >= 1 and records[0].n_tokens == 12 and records[0].error is None
    assert w.sequences["a"] == {} and w.sequences["b"] == {}


@async_test
async def test_parked_kv_caches_are_recorded_when_offloaded_and_restored():
    engine, w = build_engine(("a", "b"), policy="quantum", quantum_ms=0.001, kv_swap="offload")
    ta = await started(engine.submit("a", gen(max_tokens=8)))
    w.answer()
    tb = await started(engine.submit("b", gen(max_tokens=8)))
    w.answer_all()
    await result(ta), await result(tb)
    kv = engine.metrics("kv_offload")
    assert kv and all(isinstance(r, KVRecord) for r in kv)
    assert kv[0].model_id == "a" and kv[0].nbytes == 10  # one sequence parked, on the one rank
    restored = engine.metrics("kv_restore")
    assert restored and restored[0].model_id == "a" and restored[0].nbytes == 10


@async_test
async def test_sampled_sequence_recomputed_after_preemption_keeps_its_generator_state():
    engine, w = build_engine(("a", "b"), policy="quantum", quantum_ms=0.001, kv_swap="recompute")
    ta = await started(engine.submit("a", gen(max_tokens=10, temperature=0.5, seed=7)))
    w.answer()
    tb = await started(engine.submit("b", gen(max_tokens=10)))
    w.answer_all()
    await result(ta), await result(tb)
    first, resumed = [s for st in steps(w, "a") for s in st.admit][:2]
    assert (first.temperature, first.seed, first.gen_state) == (0.5, 7, None)
    assert (resumed.sid, resumed.temperature, resumed.seed) == (0, 0.5, 7)
    assert resumed.gen_state == b"gen-state-0"  # as the output rank handed it back with Offloaded


@async_test
async def test_pinned_model_is_never_evicted():
    pinned = ModelConfig("p", model_fn, pinned=True)
    engine, w = build_engine((pinned, "b", "c"), max_loaded=2)
    tp = await started(engine.submit("p", gen(max_tokens=1)))
    w.answer_all()
    tb = await started(engine.submit("b", gen(max_tokens=1)))
    w.answer_all()
    tc = await started(engine.submit("c", gen(max_tokens=1)))
    w.answer_all()
    for t in (tp, tb, tc):
        await result(t)
    assert [o.model_id for o in w.channel.of_type(msg.Offload)] == ["b"]  # p was least recently used
    assert engine.model_states() == {"p": "loaded", "b": "offloaded", "c": "loaded"}
    assert engine.snapshot().models["p"].pinned is True


@async_test
async def test_higher_priority_waiting_model_is_loaded_first():
    hi = ModelConfig("hi", model_fn, priority=1)
    engine, w = build_engine(("busy", "lo", hi), policy="run_to_completion")
    tbusy = await started(engine.submit("busy", gen(max_tokens=3)))
    w.answer()
    tlo = await started(engine.submit("lo", gen(max_tokens=1)))
    thi = await started(engine.submit("hi", gen(max_tokens=1)))  # younger than lo's request
    w.answer_all()
    for t in (tbusy, tlo, thi):
        await result(t)
    assert [c.model_id for c in w.channel.of_type(msg.Load)] == ["busy", "hi", "lo"]


# ---- leaving early ------------------------------------------------------------------------------

@async_test
async def test_leaving_a_stream_early_drops_the_sequence_at_the_next_step():
    engine, w = build_engine()
    stream = engine.stream("a", gen(max_tokens=10))
    nxt = await started(stream.__anext__())
    w.answer()  # Load
    w.answer()  # step 1: the first token
    assert await result(nxt) == expected_tokens(0, 3, 10)[0]
    assert len(w.pending()) == 1  # step 2 is already on its way
    await stream.aclose()
    assert len(w.pending()) == 1  # no command of its own: the drop rides on the next step
    w.answer_all()
    assert [s.drop for s in steps(w)] == [(), (), (0,)]
    assert w.sequences["a"] == {}
    assert engine.counters()["requests"] == {("a", "cancelled"): 1}
    assert engine.metrics("request") == []  # a cancelled request is never answered


@async_test
async def test_cancelling_while_the_model_is_away_sends_a_drop():
    engine, w = build_engine(("a", "b"), policy="quantum", quantum_ms=0.001, kv_swap="offload")
    ta = await started(engine.submit("a", gen(max_tokens=12)))
    w.answer()
    tb = await started(engine.submit("b", gen(max_tokens=3)))
    w.answer_until(lambda: w.channel.of_type(msg.Offload, "a"))
    n_steps = len(steps(w, "a"))
    ta.cancel()
    with pytest.raises(asyncio.CancelledError):
        await result(ta)
    assert w.channel.sent[-1] == msg.Drop(w.channel.sent[-1].seq, "a", (0,))
    w.answer_all()
    await result(tb)
    assert len(steps(w, "a")) == n_steps  # a never came back: nothing of it was left
    assert len(w.channel.of_type(msg.Load, "a")) == 1
    assert w.sequences["a"] == {}
    assert engine.snapshot().models["a"].paused == 0


@async_test
async def test_cancelling_a_queued_request_sends_nothing():
    engine, w = build_engine(max_batch_size=1)
    t0 = await started(engine.submit("a", gen(max_tokens=3)))
    t1 = await started(engine.submit("a", gen(max_tokens=3)))
    assert engine.snapshot().models["a"].waiting == 1
    sent = len(w.channel.sent)
    t1.cancel()
    with pytest.raises(asyncio.CancelledError):
        await result(t1)
    assert len(w.channel.sent) == sent
    assert engine.snapshot().models["a"].waiting == 0
    w.answer_all()
    assert (await result(t0)).tolist() == expected_tokens(0, 3, 3)
    assert {s.sid for st in steps(w) for s in st.admit} == {0}
    assert engine.counters()["requests"] == {("a", "ok"): 1, ("a", "cancelled"): 1}


@async_test
async def test_request_timeout_cancels_the_request():
    engine, w = build_engine(overlap=False)
    with pytest.raises(RequestTimeoutError, match="took over 0.01s"):
        await engine.submit("a", gen(), timeout=0.01)  # its Load is never answered
    assert engine.snapshot().models["a"].waiting == 0
    w.answer_all()
    assert steps(w) == []  # nothing left to run once the model is there
    assert engine.counters()["requests"] == {("a", "cancelled"): 1}


# ---- failures -----------------------------------------------------------------------------------

@async_test
async def test_failed_step_fails_its_requests_names_the_rank_and_realigns_the_ranks():
    engine, w = build_engine(tp=2)
    task = await started(engine.submit("a", gen(max_tokens=5)))
    w.answer()  # Load
    w.answer()  # step 1
    step2 = w.oldest(msg.Step)
    w.answer(step2, ranks=[0])  # rank 0 ran it and still holds the sequence
    w.fail(step2, rank=1, error="ValueError: boom")
    with pytest.raises(WorkerError, match=r"model 'a': rank 1: ValueError: boom"):
        await result(task)
    cleanup = w.channel.sent[-1]
    assert isinstance(cleanup, msg.Step) and cleanup.drop == (0,) and cleanup.admit == ()
    w.answer_all()
    assert w.sequences["a"] == {}
    assert [r.error for r in engine.metrics("step")] == [None, "rank 1: ValueError: boom"]
    # the engine goes on serving
    again = await started(engine.submit("a", gen(max_tokens=2)))
    w.answer_all()
    assert (await result(again)).tolist() == expected_tokens(1, 3, 2)
    assert engine.is_alive
    assert engine.counters()["requests"] == {("a", "error"): 1, ("a", "ok"): 1}


@async_test
async def test_upstream_failure_is_not_the_root_cause():
    engine, w = build_engine(pp=2)  # rank 1 is the output rank
    task = await started(engine.submit("a", gen(max_tokens=5)))
    w.answer()  # Load
    step = w.oldest(msg.Step)
    w.fail(step, rank=0, error="UpstreamFailed: an earlier stage failed", upstream=True)
    w.fail(step, rank=1, error="ValueError: boom")
    with pytest.raises(WorkerError) as info:
        await result(task)
    assert "rank 1: ValueError: boom" in str(info.value) and "UpstreamFailed" not in str(info.value)
    assert w.pending() == []  # no rank kept the sequence: nothing to clean up
    assert engine.is_alive


@async_test
async def test_failed_load_fails_its_queue_and_cleans_up_while_other_models_serve():
    engine, w = build_engine(("a", "b"), max_loaded=2, overlap=False, tp=2)
    ta = await started(engine.submit("a", gen(max_tokens=2)))
    tb = await started(engine.submit("b", gen(max_tokens=2)))
    load_a = w.oldest(msg.Load, "a")
    w.answer(load_a, ranks=[0])
    w.fail(load_a, rank=1, error="MemoryError: out of memory")
    with pytest.raises(WorkerError, match=r"loading model 'a' failed: rank 1: MemoryError: out of memory"):
        await result(ta)
    assert w.channel.sent[-1] == msg.Offload(w.channel.sent[-1].seq, "a")  # what rank 0 did load
    assert engine.model_states()["a"] == "offloaded"
    w.answer_all()
    assert (await result(tb)).tolist() == expected_tokens(1, 3, 2)
    assert steps(w, "a") == []
    assert engine.metrics("load")[0].error == "rank 1: MemoryError: out of memory"
    assert engine.counters()["swaps"] == {("b", "load"): 1}  # failed loads are not counted as swaps


@async_test
async def test_failed_load_with_overlap_fails_the_admitted_sequence_and_drops_it():
    engine, w = build_engine(overlap=True)
    task = await started(engine.submit("a", gen(max_tokens=3)))
    load, step = w.channel.sent
    w.fail(load, rank=0, error="OSError: disk gone")
    with pytest.raises(WorkerError, match="loading model 'a' failed: rank 0: OSError: disk gone"):
        await result(task)
    assert w.channel.kinds()[2:] == [("Offload", "a"), ("Drop", "a")]
    assert w.channel.sent[3].sids == (0,)
    w.fail(step, rank=0, error="RuntimeError: weights never arrived")  # the overlapped step fails too
    w.answer_all()
    assert engine.is_alive and engine.model_states() == {"a": "offloaded"}
    again = await started(engine.submit("a", gen(max_tokens=2)))
    w.answer_all()
    assert (await result(again)).tolist() == expected_tokens(1, 3, 2)


@async_test
async def test_step_failing_while_its_preemption_is_queued_fails_its_requests_and_the_engine_goes_on():
    engine, w = build_engine(("a", "b"), policy="quantum", quantum_ms=0.001, tp=2)
    ta = await started(engine.submit("a", gen(max_tokens=12)))
    w.answer()
    tb = await started(engine.submit("b", gen(max_tokens=3)))
    w.answer_until(lambda: w.channel.of_type(msg.Offload))
    step = w.oldest(msg.Step, "a")  # in flight, with a's offload and b's load queued behind it
    w.answer(step, ranks=[0])
    w.fail(step, rank=1, error="ValueError: boom")
    with pytest.raises(WorkerError, match="rank 1: ValueError: boom"):
        await result(ta)
    assert w.channel.kinds()[-1] == ("Step", "a") and w.channel.sent[-1].drop == (0,)  # realign the ranks
    w.answer_all()
    assert (await result(tb)).tolist() == expected_tokens(1, 3, 3)
    assert engine.model_states() == {"a": "offloaded", "b": "loaded"}
    assert engine.snapshot().models["a"].paused == 0
    again = await started(engine.submit("a", gen(max_tokens=2)))
    w.answer_all()
    assert (await result(again)).tolist() == expected_tokens(2, 3, 2) and engine.is_alive


@async_test
async def test_failed_load_of_the_preempting_model_lets_the_paused_one_resume():
    engine, w = build_engine(("a", "b"), policy="quantum", quantum_ms=0.001, kv_swap="recompute")
    ta = await started(engine.submit("a", gen(max_tokens=12)))
    w.answer()
    tb = await started(engine.submit("b", gen(max_tokens=3)))
    w.answer_until(lambda: w.channel.of_type(msg.Load, "b"))
    load_b = w.oldest(msg.Load, "b")
    w.answer_until(lambda: w.oldest() is load_b)  # a's last step and its offload
    w.fail(load_b, rank=0, error="MemoryError: out of memory")
    with pytest.raises(WorkerError, match="loading model 'b' failed"):
        await result(tb)
    w.answer_all()
    assert (await result(ta)).tolist() == expected_tokens(0, 3, 12)
    assert [c.model_id for c in w.channel.of_type(msg.Load)] == ["a", "b", "a"]


class LaxBatchManager(CausalLMBatchManager):
    """Lets every request through at submit (a batch manager ported from elsewhere)."""

    def validate(self, data):
        pass


@async_test
async def test_a_request_that_cannot_become_a_sequence_fails_alone():
    engine, w = build_engine((ModelConfig("a", model_fn, batch_manager=LaxBatchManager()),))
    bad = await started(engine.submit("a", gen(max_tokens="lots")))
    good = await started(engine.submit("a", gen(max_tokens=2)))
    w.answer_all()
    with pytest.raises(PayloadError, match="malformed request: ValueError: invalid literal"):
        await result(bad)
    assert (await result(good)).tolist() == expected_tokens(1, 3, 2)
    assert all(s.sid != 0 for st in steps(w) for s in st.admit)


@pytest.mark.parametrize("how", ["fatal", "worker_exit", "transport"])
@async_test
async def test_death_fails_everything_and_refuses_new_work(how):
    engine, w = build_engine(("a", "b"), tp=2)
    ta = await started(engine.submit("a", gen(max_tokens=5)))
    tb = await started(engine.submit("b", gen(max_tokens=5)))  # waits in b's queue
    w.answer()  # Load a
    if how == "fatal":
        w.fail(w.oldest(msg.Step), rank=1, error="RuntimeError: gloo connection closed", fatal=True)
        reason = "rank 1 lost the data plane: RuntimeError: gloo connection closed"
    elif how == "worker_exit":
        engine.on_worker_exit(1, -9)
        reason = "worker rank 1 exited unexpectedly (exit code -9)"
    else:
        engine.on_transport_error(ConnectionResetError("peer gone"), cause="worker rank 1 died")
        reason = "worker rank 1 died; lost contact with the workers: ConnectionResetError: peer gone"
    assert not engine.is_alive and engine.dead_reason == f"engine is dead: {reason}"
    for t in (ta, tb):
        with pytest.raises(EngineDeadError, match="rank 1"):
            await result(t)
    with pytest.raises(EngineDeadError):
        await engine.submit("a", gen())
    with pytest.raises(EngineDeadError):
        engine.stats(timeout=1)
    with pytest.raises(EngineDeadError, match="rank 1"):
        engine.run()  # returns at once (the engine stopped), raising why
    snap = engine.snapshot()
    assert snap.alive is False and "rank 1" in snap.dead_reason
    n = len(w.channel.sent)
    w.answer_all()  # late replies of the dead engine's commands: ignored
    assert len(w.channel.sent) == n


@async_test
async def test_internal_error_handling_a_reply_kills_the_engine():
    engine, w = build_engine(overlap=False)
    task = await started(engine.submit("a", gen()))
    load = w.oldest(msg.Load)
    engine.on_reply(msg.Loaded(seq=load.seq, rank=0, model_id="a", start=0.0, end=0.0, nbytes=None,
                               device_bytes=0))  # a reply the master cannot add up
    assert not engine.is_alive and "internal error handling Loaded" in engine.dead_reason
    with pytest.raises(EngineDeadError, match="internal error"):
        await result(task)


# ---- submit-time errors -------------------------------------------------------------------------

@async_test
async def test_unknown_model_and_bad_payloads_are_refused_at_submit_without_a_command():
    engine, w = build_engine(("a", "mlp"), lms=("a",))
    with pytest.raises(UnknownModelError, match="served models: \\['a', 'mlp'\\]"):
        await engine.submit("nope", gen())
    with pytest.raises(UnknownModelError):
        await engine.submit(["a"], gen())
    with pytest.raises(PayloadError) as info:
        await engine.submit("a", gen(max_tokens=100))  # 3 + 100 > 64 positions
    assert info.value.param == "max_tokens" and "at most 61" in info.value.reason
    with pytest.raises(PayloadError) as info:
        await engine.submit("a", gen(temperature=-1))
    assert info.value.param == "temperature"
    with pytest.raises(PayloadError) as info:
        await engine.submit("a", {"input_ids": [5, 500]})  # vocab_size=100
    assert info.value.param == "input_ids"
    with pytest.raises(PayloadError, match="malformed request"):
        await engine.submit("a", "not a dict")
    assert w.channel.sent == []
    assert engine.snapshot().models["a"].waiting == 0


@async_test
async def test_queue_size_bounds_each_models_waiting_requests():
    engine, w = build_engine(("a", "b"), queue_size=1, overlap=False, max_loaded=2)
    ta = await started(engine.submit("a", gen(max_tokens=1)))
    with pytest.raises(QueueFullError, match="queue_size=1"):
        await engine.submit("a", gen(max_tokens=1))
    tb = await started(engine.submit("b", gen(max_tokens=1)))  # another model's queue
    w.answer_all()
    await result(ta), await result(tb)
    tc = await started(engine.submit("a", gen(max_tokens=1)))  # the queue drained
    w.answer_all()
    await result(tc)


# ---- request-level models ----------------------------------------------------------------------

class PairBatchManager(BatchManager):
    """Two requests per batch; split_batch refuses a negative output (a batch manager's bug)."""

    def make_batch(self, q):
        taken = [q.popleft() for _ in range(min(2, len(q)))]
        if any(e.data == "unbatchable" for e in taken):
            raise ValueError("cannot batch that")
        return TaskEntry(tuple(e.uid for e in taken), [e.data for e in taken]), {"n": len(taken)}

    def split_batch(self, task_entry, n=0, **_):
        if any(x < 0 for x in task_entry.batch):
            raise ValueError("negative output")
        assert n == len(task_entry.uids)
        return list(zip(task_entry.uids, task_entry.batch))


@async_test
async def test_request_level_model_runs_batches_and_splits_outputs():
    engine, w = build_engine((ModelConfig("pairs", model_fn, batch_manager=PairBatchManager()), "one"), lms=(),
                             max_loaded=2, pp=2)
    ts = [await started(engine.submit("pairs", x)) for x in (1, 2, 3)]
    t1 = await started(engine.submit("one", 21))
    assert w.channel.kinds()[:2] == [("Load", "pairs"), ("RunBatch", "pairs")]  # overlap: batch behind load
    assert w.channel.of_type(msg.RunBatch, "pairs")[0].batch == [1]  # only the first had arrived
    w.answer_all()
    assert [await result(t) for t in ts] == [2, 4, 6]
    assert await result(t1) == 42
    batches = [c.batch for c in w.channel.of_type(msg.RunBatch, "pairs")]
    assert batches == [[1], [2, 3]]
    assert [r.batch_size for r in engine.metrics("batch") if r.model_id == "pairs"] == [1, 2]
    assert engine.snapshot().models["pairs"].token_level is False
    assert w.channel.of_type(msg.Step) == []


@async_test
async def test_request_level_split_or_make_batch_failure_fails_that_batch_only():
    engine, w = build_engine((ModelConfig("pairs", model_fn, batch_manager=PairBatchManager()),), lms=(),
                             overlap=False)
    bad = [await started(engine.submit("pairs", x)) for x in (-1, 5)]  # one batch; output -2 is refused
    unbatchable = [await started(engine.submit("pairs", x)) for x in ("unbatchable", 6)]
    good = [await started(engine.submit("pairs", x)) for x in (7, 8)]
    w.answer_all()
    for t in bad:
        with pytest.raises(PayloadError, match="split_batch failed: negative output"):
            await result(t)
    for t in unbatchable:
        with pytest.raises(PayloadError, match="could not batch this request: ValueError: cannot batch that"):
            await result(t)
    assert [await result(t) for t in good] == [14, 16]
    assert [c.batch for c in w.channel.of_type(msg.RunBatch)] == [[-1, 5], [7, 8]]  # no batch for the bad pair
    assert engine.is_alive


@async_test
async def test_request_level_worker_failure_fails_the_batch_with_its_error():
    engine, w = build_engine(("mlp",), lms=(), overlap=False)
    t = await started(engine.submit("mlp", 1))
    w.answer()  # Load
    w.fail(w.oldest(msg.RunBatch), rank=0, error="ValueError: negative input is not allowed")
    with pytest.raises(WorkerError, match="model 'mlp': rank 0: ValueError: negative input"):
        await result(t)
    assert engine.metrics("batch")[0].error == "rank 0: ValueError: negative input is not allowed"
    t2 = await started(engine.submit("mlp", 2))
    w.answer_all()
    assert await result(t2) == 4


# ---- what the engine tells about itself ---------------------------------------------------------

def test_stats_asks_every_rank():
    engine, w = build_engine(tp=2)
    out = {}
    asker = threading.Thread(target=lambda: out.update(engine.stats(timeout=WAIT_S)))
    asker.start()
    query = w.channel.wait_for(lambda c: isinstance(c, msg.QueryStats))
    w.answer(query)
    asker.join(WAIT_S)
    assert not asker.is_alive()
    assert sorted(out) == [0, 1] and all(isinstance(s, msg.Stats) and s.rank == r for r, s in out.items())


@async_test
async def test_stats_async_from_a_loop():
    engine, w = build_engine()
    task = asyncio.ensure_future(engine.stats_async(timeout=WAIT_S))
    loop = asyncio.get_running_loop()
    query = await loop.run_in_executor(None, w.channel.wait_for, lambda c: isinstance(c, msg.QueryStats))
    w.answer(query)
    stats = await result(task)
    assert list(stats) == [0] and stats[0].resident == ()


@async_test
async def test_snapshot_follows_a_model_through_its_states():
    engine, w = build_engine(("a", "b"), overlap=False)
    snap = engine.snapshot()
    assert isinstance(snap, EngineSnapshot) and snap.alive and snap.dead_reason is None
    assert snap.models["a"] == ModelSnapshot(state="offloaded", tier="host", waiting=0, running=0, paused=0,
                                             token_level=True, pinned=False, host_bytes=w.nbytes)
    task = await started(engine.submit("a", gen(max_tokens=3)))
    a = engine.snapshot().models["a"]
    assert (a.state, a.tier, a.waiting, a.running) == ("loading", "device", 1, 0)
    w.answer()  # Loaded: the first step admits the request
    a = engine.snapshot().models["a"]
    assert (a.state, a.waiting, a.running, a.paused) == ("loaded", 0, 1, 0)
    assert a.last_load["bytes"] == 1000 and a.last_load["tier"] == "host" and a.last_offload is None
    w.answer_all()
    await result(task)
    assert engine.snapshot().models["a"].running == 0
    assert engine.snapshot().to_dict()["models"]["b"]["state"] == "offloaded"


@async_test
async def test_counters_total_swaps_steps_tokens_and_request_outcomes():
    engine, w = build_engine(("a", "b"))
    for m, n in (("a", 3), ("b", 2), ("a", 2)):
        t = await started(engine.submit(m, gen(max_tokens=n)))
        w.answer_all()
        await result(t)
    bad = await started(engine.submit("a", gen(max_tokens=4)))
    w.answer()  # step 1 (a is loaded)
    w.fail(w.oldest(msg.Step), rank=0, error="ValueError: boom")
    with pytest.raises(WorkerError):
        await result(bad)
    c = engine.counters()
    assert c["swaps"] == {("a", "load"): 2, ("a", "offload"): 1, ("b", "load"): 1, ("b", "offload"): 1}
    assert c["swap_bytes"][("a", "load")] == 2000
    assert c["steps"] == {"a": 3 + 2 + 2, "b": 2}
    assert c["tokens"] == {"a": 3 + 2 + 1, "b": 2}
    assert c["requests"] == {("a", "ok"): 2, ("b", "ok"): 1, ("a", "error"): 1}
    assert c["preemptions"] == {}
    records = engine.metrics("request")
    assert all(isinstance(r, RequestRecord) for r in records) and [r.n_tokens for r in records] == [3, 2, 2, 1]


@async_test
async def test_events_merge_consecutive_steps_and_follow_a_cursor():
    engine, w = build_engine(("a", "b"))
    t = await started(engine.submit("a", gen(max_tokens=3)))
    w.answer_all()
    await result(t)
    cursor, events = engine.events()
    assert [(e["id"], e["kind"], e["model_id"]) for e in events] == [(1, "load", "a"), (2, "step", "a")]
    assert events[1]["steps"] == 3 and events[0]["bytes"] == 1000 and events[0]["cause"]
    assert cursor == 2 and engine.events(cursor) == (2, [])
    assert engine.events(cursor - 1)[1] == events[1:]  # how a poller re-reads a bar that may still grow
    t = await started(engine.submit("b", gen(max_tokens=1)))
    w.answer_all()
    await result(t)
    cursor, events = engine.events(cursor)
    assert [(e["kind"], e["model_id"]) for e in events] == [("offload", "a"), ("load", "b"), ("step", "b")]
    ids = [e["id"] for e in events]
    assert ids == sorted(ids) and ids[0] > 2 and cursor == ids[-1]  # (merged steps use up ids: gaps)
    assert engine.events(cursor) == (cursor, []) and engine.events(99) == (99, [])


@async_test
async def test_observers_see_records_and_replies_and_their_failures_do_not_stop_serving():
    engine, w = build_engine()
    records, replies = [], []

    def broken(_):
        raise RuntimeError("observer bug")
    engine.add_observer(broken)
    engine.add_observer(records.append)
    engine.add_reply_observer(broken)
    engine.add_reply_observer(replies.append)
    t = await started(engine.submit("a", gen(max_tokens=2)))
    w.answer_all()
    assert (await result(t)).tolist() == expected_tokens(0, 3, 2)
    beat = msg.Heartbeat(rank=0, sent=time.time())
    engine.on_reply(beat)
    assert engine.is_alive
    # the request is answered (and recorded) as its last step is handled, before that step's record
    assert [type(r) for r in records] == [SwapRecord, StepRecord, RequestRecord, StepRecord]
    assert replies == w.delivered + [beat]


# ---- liveness -----------------------------------------------------------------------------------

@async_test
async def test_heartbeat_reporting_a_stuck_command_kills_the_engine():
    engine, w = build_engine(command_timeout_s=30.0)
    t = await started(engine.submit("a", gen()))
    engine.on_reply(msg.Heartbeat(rank=0, sent=0.0, busy_seq=0, busy_s=29.0))  # slow, not stuck
    assert engine.is_alive
    engine.on_reply(msg.Heartbeat(rank=0, sent=0.0, busy_seq=0, busy_s=31.0))
    assert not engine.is_alive
    assert "worker rank 0 has been executing command 0 for 31s" in engine.dead_reason
    with pytest.raises(EngineDeadError, match="stuck"):
        await result(t)


def test_watchdog_reports_a_silent_rank(monkeypatch):
    # The watchdog thread is not started: its question (Engine._check_liveness) is asked directly, on a
    # clock of the test's own (Liveness reads time.perf_counter for when it heard from each rank).
    from computron.engine import liveness
    clock = [1000.0]
    monkeypatch.setattr(liveness, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    engine, w = build_engine(tp=2, heartbeat_timeout_s=10.0)
    clock[0] = 1008.0
    engine.on_reply(msg.Heartbeat(rank=0, sent=0.0))
    assert engine._check_liveness(1009.0) is True and engine.is_alive
    assert engine._check_liveness(1011.0) is False
    assert engine.dead_reason == ("engine is dead: worker rank 1 sent no heartbeat for 11.0s (host h) "
                                  "(EngineConfig.heartbeat_timeout_s=10.0); it is hung, stopped or gone")


def test_watchdog_reports_a_command_failed_on_some_ranks_and_unanswered_by_others(monkeypatch):
    from computron.engine import liveness
    monkeypatch.setattr(liveness, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: 1e9)}))
    engine, w = build_engine(tp=2, heartbeat_timeout_s=10.0)
    raised = []

    def ask():
        try:
            engine.stats(timeout=WAIT_S)
        except EngineDeadError as exc:
            raised.append(exc)
    asker = threading.Thread(target=ask)
    asker.start()
    query = w.channel.wait_for(lambda c: isinstance(c, msg.QueryStats))
    w.fail(query, rank=0, error="RuntimeError: boom")
    failed_at = time.perf_counter()
    assert engine._check_liveness(failed_at + 5) is True  # every rank heartbeats (clock at 1e9)
    assert engine._check_liveness(failed_at + 11) is False
    asker.join(WAIT_S)
    assert not asker.is_alive() and len(raised) == 1  # the waiting query was woken, and raised
    assert "failed on ranks [0] and ranks [1] gave no answer for 10.0s" in engine.dead_reason


# ---- shutting down ------------------------------------------------------------------------------

@async_test
async def test_close_fails_what_waits_and_calls_on_close_once():
    calls = []
    engine, w = build_engine(on_close=calls.append)
    t = await started(engine.submit("a", gen()))
    engine.close()
    engine.close()
    assert calls == [False]
    with pytest.raises(EngineDeadError, match="engine is shutting down"):
        await result(t)
    with pytest.raises(EngineDeadError, match="shutting down"):
        await engine.submit("a", gen())
    n = len(w.channel.sent)
    w.answer_all()  # late replies after close: nobody waits for them, nothing is sent
    assert len(w.channel.sent) == n and engine.metrics("step") == []
    engine.run()  # closed, not dead: returns


@async_test
async def test_close_after_death_reports_it_and_async_with_closes():
    calls = []
    engine, w = build_engine(on_close=calls.append)
    async with engine:
        engine.on_worker_exit(0, 1)
    assert calls == [True]
    closed = []
    engine2, _ = build_engine(on_close=closed.append)
    async with engine2:
        pass
    assert closed == [False]
    engine2.on_worker_exit(0, 0)  # after close: not a death
    assert engine2.dead_reason == "engine is shutting down"


def test_reply_for_an_unknown_command_is_ignored():
    engine, w = build_engine()
    engine.on_reply(msg.Dropped(seq=42, rank=0, model_id="a", start=0.0, end=0.0))
    assert engine.is_alive and w.channel.sent == []
