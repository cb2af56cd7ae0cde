"""Steps sent ahead (``EngineConfig.step_ahead``): the policy's times (``sched/step_ahead.py``), the scheduler's
extra step in flight, and the engine over fake workers, which answer at once, so every step that may go ahead
goes at once (no timer is involved). An EOS behind a step sent ahead: ``test_engine_inprocess.py``."""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fake_workers import build_engine, expected_tokens  # noqa: E402
from test_engine_inprocess import async_test, gen, result, started, steps  # noqa: E402

from computron.comm import messages as msg  # noqa: E402
from computron.engine.wake import WakeAt  # noqa: E402
from computron.errors import WorkerError  # noqa: E402
from computron.sched.scheduler import ActionKind, Scheduler  # noqa: E402
from computron.sched.step_ahead import MIN_LEAD_S, SMOOTHING, StepAhead  # noqa: E402


LEAD_MS = 60_000
"""A lead longer than any step: each step goes ahead as soon as the one before it is sent (answers come at once
here, where a measured lead would send none ahead: their steps are shorter than twice the lead)."""


# ---- the policy -----------------------------------------------------------------------------------

def test_no_step_goes_ahead_before_a_decode_step_was_timed_nor_behind_a_prefill():
    a = StepAhead()
    a.sent("m", 1.0, prompt_tokens=0)
    assert a.due("m") is None  # nothing timed yet
    a.answered("m", 1.0, 1.040, worker_s=0.038, prompt_tokens=0)
    a.sent("m", 1.040, prompt_tokens=12)
    assert a.due("m") is None  # a prefill's time is not a decode step's
    a.sent("m", 1.100, prompt_tokens=0)
    assert a.due("m") == pytest.approx(1.100 + 0.040 - 2 * 0.002)


def test_due_is_the_expected_end_less_twice_the_overhead_and_at_least_the_minimum_lead():
    a = StepAhead()
    a.answered("m", 0.0, 0.050, worker_s=0.045, prompt_tokens=0)  # 5 ms outside the workers
    a.sent("m", 0.050, prompt_tokens=0)
    assert a.due("m") == pytest.approx(0.050 + 0.050 - 0.010)
    b = StepAhead()
    b.answered("m", 0.0, 0.050, worker_s=0.0499, prompt_tokens=0)
    b.sent("m", 0.050, prompt_tokens=0)
    assert b.due("m") == pytest.approx(0.100 - MIN_LEAD_S)


def test_steps_shorter_than_twice_the_measured_lead_send_none_ahead_and_a_fixed_lead_always_applies():
    a = StepAhead()
    a.answered("m", 0.0, 0.003, worker_s=0.002, prompt_tokens=0)  # 3 ms steps, 2 ms lead
    a.sent("m", 0.003, prompt_tokens=0)
    assert a.due("m") is None
    b = StepAhead(lead_s=0.5)
    b.answered("m", 0.0, 0.003, worker_s=0.002, prompt_tokens=0)
    b.sent("m", 0.003, prompt_tokens=0)
    assert b.due("m") == pytest.approx(0.006 - 0.5)


def test_a_step_sent_ahead_starts_when_the_one_before_is_answered_and_estimates_smooth():
    a = StepAhead()
    a.answered("m", 0.0, 0.040, worker_s=0.040, prompt_tokens=0)
    a.sent("m", 0.030, prompt_tokens=0)  # ahead: sent before 0.040
    assert a.start("m", 0.030) == 0.040
    assert a.start("m", 0.045) == 0.045  # sent after: it starts when sent
    assert a.due("m") == pytest.approx(0.040 + 0.040 - MIN_LEAD_S)
    a.answered("m", 0.030, 0.100, worker_s=0.060, prompt_tokens=0)  # took 60 ms from 0.040
    assert a.start("m", 0.090) == 0.100
    a.sent("m", 0.090, prompt_tokens=0)
    assert a.due("m") == pytest.approx(0.100 + (0.040 + SMOOTHING * 0.020) - MIN_LEAD_S)
    a.forget("m")
    assert a.due("m") is None and a.start("m", 0.090) == 0.090


def test_the_scheduler_runs_one_more_step_for_a_model_ahead_unless_another_waits():
    s = Scheduler(["a", "b"], max_loaded=1, max_inflight=1)
    s.decide({"a": 0.0})
    s.on_loaded("a")
    assert [x.kind for x in s.decide({"a": 0.0}, running={"a"}, ahead={"a"})] == [ActionKind.RUN]
    assert [x.kind for x in s.decide({"a": 0.0}, running={"a"}, ahead={"a"})] == [ActionKind.RUN]
    assert s.in_flight("a") == 2
    assert s.decide({"a": 0.0}, running={"a"}, ahead={"a"}) == []  # one ahead, not more
    s.on_batch_done("a")
    # b waits for the slot: a drains instead of sending ahead
    assert all(x.kind is not ActionKind.RUN for x in s.decide({"a": 0.0, "b": 1.0}, running={"a"}, ahead={"a"}))
    assert s.in_flight("a") == 1


def test_wake_at_calls_back_at_the_earliest_time_asked_and_stops():
    called = []
    done = threading.Event()

    def fn():
        called.append(time.perf_counter())
        done.set()
    w = WakeAt(fn, "test-wake")
    t0 = time.perf_counter()
    w.at(t0 + 30.0)
    w.at(t0 + 0.01)  # sooner: replaces it
    w.at(t0 + 20.0)  # later than the one asked: ignored
    assert done.wait(10.0)
    assert called[0] >= t0 + 0.01 and len(called) == 1
    w.stop()
    w._thread.join(5.0)
    assert not w._thread.is_alive()


# ---- the engine -----------------------------------------------------------------------------------

@async_test
async def test_decode_steps_go_ahead_and_none_after_the_last_token():
    engine, w = build_engine(step_ahead=True, step_ahead_lead_ms=LEAD_MS)
    task = await started(engine.submit("a", gen(max_tokens=6)))
    w.answer()  # Load
    assert [c.ahead for c in w.pending()] == [False]  # the prefill: nothing goes behind it
    w.answer()
    assert [c.ahead for c in w.pending()] == [False]  # the first decode step: not timed yet
    w.answer()
    assert [c.ahead for c in w.pending()] == [False, True]
    w.answer_all()
    assert (await result(task)).tolist() == expected_tokens(0, 3, 6)
    assert len(steps(w)) == 6  # max_tokens ends the sequence with the step in flight: none sent after it
    records = engine.metrics("step")
    assert all(b.start >= a.end for a, b in zip(records, records[1:]))  # a step ahead starts at its turn


async def _one_step_ahead(max_tokens: int):
    """An engine over fake workers with one sequence decoding and a step sent ahead of the one in flight."""
    engine, w = build_engine(step_ahead=True, step_ahead_lead_ms=LEAD_MS)
    task = await started(engine.submit("a", gen(max_tokens=max_tokens)))
    for _ in range(3):  # the load, the prefill, the first (timed) decode step
        w.answer()
    assert [c.ahead for c in w.pending()] == [False, True]
    return engine, w, task


@async_test
async def test_a_request_arriving_with_a_step_ahead_joins_the_next_one():
    engine, w, first = await _one_step_ahead(8)
    second = await started(engine.submit("a", gen(prompt=(9, 9), max_tokens=3)))
    assert len(w.pending()) == 2  # it waits: two steps are in flight
    w.answer()
    joined = w.pending()[-1]
    assert [a.sid for a in joined.admit] == [1] and joined.ahead
    w.answer_all()
    assert (await result(first)).tolist() == expected_tokens(0, 3, 8)
    assert (await result(second)).tolist() == expected_tokens(1, 2, 3)


@async_test
async def test_a_failed_step_with_one_ahead_fails_its_requests_and_the_engine_goes_on():
    engine, w, task = await _one_step_ahead(8)
    failing = w.pending()[0]
    w.fail(failing, rank=0, error="ValueError: boom")
    with pytest.raises(WorkerError, match="ValueError: boom"):
        await result(task)
    cleanup = w.channel.sent[-1]  # queued behind the step sent ahead, which still holds the sequence
    assert isinstance(cleanup, msg.Step) and cleanup.drop == (0,) and not cleanup.ahead
    w.answer_all()
    assert w.sequences["a"] == {}
    again = await started(engine.submit("a", gen(max_tokens=2)))
    w.answer_all()
    assert (await result(again)).tolist() == expected_tokens(1, 3, 2)
    assert engine.is_alive
