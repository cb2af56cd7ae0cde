"""Admission control: the pure policy (``sched/admission.py``: queue bound, Retry-After, the TTFT prediction,
the measured per-request time) and the engine's use of it over fake workers (refused before any work on the
request, places held while preparing, reasons counted)."""
from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # fake_workers, whatever the import mode

from fake_workers import build_engine, model_fn  # noqa: E402

from computron.batching.base import BatchManager, TaskEntry  # noqa: E402
from computron.config import EngineConfig, ModelConfig  # noqa: E402
from computron.errors import QueueFullError  # noqa: E402
from computron.sched.admission import (QUEUE_FULL, TTFT, Outlook, ServiceClock, admit, predicted_ttft,  # noqa: E402
                                       retry_after)

WAIT_S = 5.0


# ---- the policy ----------------------------------------------------------------------------------

def test_a_queue_under_its_bound_admits_and_a_full_one_refuses_with_the_expected_wait():
    assert admit("m", Outlook(waiting=49, bound=50, per_request_s=0.3)) is None
    r = admit("m", Outlook(waiting=50, bound=50, per_request_s=0.3))
    assert (r.reason, r.retry_after_s) == (QUEUE_FULL, 15)  # 50 ahead x 0.3 s
    assert "already has 50 waiting requests (queue_size=50)" in r.message
    assert admit("m", Outlook(waiting=10_000, bound=0, per_request_s=0.3)) is None  # 0: unbounded


def test_retry_after_is_whole_seconds_at_least_one():
    assert retry_after(50, None) == 1  # nothing measured yet
    assert retry_after(3, 0.01) == 1
    assert retry_after(7, 0.5) == 4  # 3.5 s rounded up
    assert retry_after(0, 2.0) == 1


def test_predicted_ttft_adds_the_queue_a_load_when_not_resident_and_the_prefill_once_known():
    o = Outlook(waiting=4, bound=0, per_request_s=0.25, resident=False, load_s=2.0, prefill_tokens_per_s=1000.0)
    assert predicted_ttft(o) == pytest.approx(1.0 + 2.0)
    assert predicted_ttft(o, prompt_tokens=500) == pytest.approx(1.0 + 2.0 + 0.5)
    resident = Outlook(waiting=4, bound=0, per_request_s=0.25, resident=True, load_s=2.0)
    assert predicted_ttft(resident, prompt_tokens=500) == pytest.approx(1.0)  # no prefill rate measured


def test_a_predicted_late_request_is_refused_only_with_a_limit():
    o = Outlook(waiting=8, bound=512, per_request_s=0.5)  # 4 s ahead
    assert admit("m", o) is None
    assert admit("m", o, ttft_limit_s=5.0) is None
    r = admit("m", o, ttft_limit_s=3.0)
    assert (r.reason, r.retry_after_s) == (TTFT, 4)
    assert "predicted time to first token 4.00s exceeds 3.00s" in r.message
    cold = Outlook(waiting=0, bound=512, per_request_s=None, resident=False, load_s=2.5)
    assert admit("m", cold, ttft_limit_s=2.0).retry_after_s == 3  # nothing ahead: the load's time
    # the prefill counts once the prompt is known
    warm = Outlook(waiting=0, bound=512, per_request_s=0.1, prefill_tokens_per_s=100.0)
    assert admit("m", warm, ttft_limit_s=1.0) is None
    assert admit("m", warm, ttft_limit_s=1.0, prompt_tokens=200).reason == TTFT


def test_service_clock_measures_answers_within_a_busy_period():
    c = ServiceClock(window=4)
    assert c.per_request_s("m") is None
    c.answered("m", 10.0, more_left=True)
    assert c.per_request_s("m") is None  # one answer is no rate
    for t in (10.5, 11.0, 11.5):
        c.answered("m", t, more_left=True)
    assert c.per_request_s("m") == pytest.approx(0.5)
    c.answered("m", 13.5, more_left=False)  # the window keeps the latest 4: 10.5 .. 13.5
    assert c.per_request_s("m") == pytest.approx(1.0)
    c.answered("m", 100.0, more_left=True)  # after an idle gap: a new window, the estimate kept
    assert c.per_request_s("m") == pytest.approx(1.0)
    c.answered("m", 100.2, more_left=True)
    assert c.per_request_s("m") == pytest.approx(0.2)
    c.forget("m")
    assert c.per_request_s("m") is None


def test_engine_config_checks_the_refusal_factor():
    assert EngineConfig().queue_size == 512
    assert EngineConfig(ttft_refusal_factor=2).ttft_refusal_factor == 2
    for bad in (0, -1.0, True, "2", float("inf")):
        with pytest.raises(ValueError, match="ttft_refusal_factor"):
            EngineConfig(ttft_refusal_factor=bad)


# ---- the engine ----------------------------------------------------------------------------------

class GatedBatchManager(BatchManager):
    """Prepares off the loop and waits for ``gate`` in ``prepare``: requests stay in preparation."""
    prepare_off_loop = True

    def __init__(self):
        self.gate = threading.Event()
        self.prepared = 0

    def prepare(self, data):
        assert self.gate.wait(WAIT_S)
        self.prepared += 1
        return data

    def make_batch(self, q):
        e = q.popleft()
        return TaskEntry((e.uid,), e.data), {}

    def split_batch(self, task_entry, n=0, **_):
        return [(task_entry.uids[0], task_entry.batch)]


def test_requests_being_prepared_hold_their_places_and_the_next_is_refused_before_any_work():
    async def main():
        bm = GatedBatchManager()
        engine, w = build_engine([ModelConfig("a", model_fn, batch_manager=bm)], lms=(), queue_size=2)
        first = [asyncio.ensure_future(engine.submit("a", i)) for i in range(2)]
        await asyncio.sleep(0)  # a yield point, not a timer: both are admitted and in preparation
        with pytest.raises(QueueFullError) as info:
            await engine.submit("a", 99)
        assert (info.value.reason, info.value.retry_after_s) == ("queue_full", 1)
        with pytest.raises(QueueFullError):
            engine.check_admission("a")  # the server's early question: the same answer, counted too
        assert bm.prepared == 0  # refused while the others were still being prepared
        assert engine.counters()["rejections"] == {("a", "queue_full"): 2}
        bm.gate.set()
        while not all(t.done() for t in first):
            w.answer_all()
            await asyncio.sleep(0)
        assert bm.prepared == 2
        engine.check_admission("a")  # room again
        engine.close()
    asyncio.run(asyncio.wait_for(main(), 4 * WAIT_S))


def test_a_predicted_late_request_is_refused_with_retry_after_from_measured_answers():
    async def main():
        engine, w = build_engine(("a",), ttft_slo_s=0.75, ttft_refusal_factor=2.0, max_batch_size=1, overlap=False)
        # measured: a busy period of answers 1 s apart
        clock = engine._requests.service
        for t in (0.0, 1.0, 2.0):
            clock.answered("a", t, more_left=True)
        engine.check_admission("a")  # nothing ahead, resident or not: nothing measured to be late by
        tasks = [asyncio.ensure_future(engine.submit("a", {"input_ids": [5, 6], "max_tokens": 1})) for _ in range(2)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert engine.snapshot().models["a"].waiting == 2  # loading: both wait, 2 s ahead over the 1.5 s limit
        with pytest.raises(QueueFullError) as info:
            await engine.submit("a", {"input_ids": [5, 6], "max_tokens": 1})
        assert info.value.reason == "ttft_late" and info.value.retry_after_s >= 1
        assert engine.counters()["rejections"][("a", "ttft_late")] == 1
        while not all(t.done() for t in tasks):
            w.answer_all()
            await asyncio.sleep(0)
        engine.close()
    asyncio.run(asyncio.wait_for(main(), 4 * WAIT_S))


def test_a_refusal_answers_429_with_its_retry_after_and_reason_in_both_shapes():
    import pickle

    from computron.server.errors import to_openai, to_v2
    exc = QueueFullError("model 'm': predicted time to first token 7.20s exceeds 2.00s", "ttft_late", 8)
    o = to_openai(exc)
    assert (o.status, o.type, o.code, o.headers) == (429, "rate_limit_error", "ttft_late", {"Retry-After": "8"})
    v = to_v2(exc)
    assert (v.status, v.headers, v.body()) == (429, {"Retry-After": "8"}, {"error": str(exc)})
    full = to_openai(QueueFullError("model 'm' already has 50 waiting requests (queue_size=50)"))
    assert (full.code, full.headers) == ("queue_full", {"Retry-After": "1"})
    back = pickle.loads(pickle.dumps(exc))  # through Ray, from an engine group
    assert (type(back), str(back), back.reason, back.retry_after_s) == (QueueFullError, str(exc), "ttft_late", 8)
