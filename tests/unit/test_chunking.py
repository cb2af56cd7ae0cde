"""Chunked prefill's policy (``engine.chunking``) and the master's bookkeeping of sequences mid-prefill
(``engine.sequences.TokenBatch`` with ``chunked=True``): no torch, no engine."""
from collections import deque
from types import SimpleNamespace

from computron.comm.messages import SeqSpec
from computron.engine.chunking import StepBudget, min_chunk, plan
from computron.engine.sequences import Cancelled, Request, TokenBatch


def test_decoders_first_then_filling_then_admissions_in_order():
    p = plan(32, decoding=4, filling=[(1, 10), (2, 30)], waiting=[(3, 5, True)], slots=4)
    assert p.fill == ((1, 10), (2, 18)) and p.admit == ()


def test_a_long_prompt_takes_a_chunk_of_what_is_left():
    p = plan(32, decoding=2, filling=[], waiting=[(1, 4, True), (2, 100, True), (3, 2, True)], slots=4)
    assert p.admit == ((1, 4), (2, 26))


def test_a_chunk_under_the_minimum_waits_and_nothing_overtakes_it():
    assert min_chunk(32) == 8 and min_chunk(4096) == 16 and min_chunk(2) == 1
    p = plan(32, decoding=20, filling=[], waiting=[(1, 8, True), (2, 50, True), (3, 1, True)], slots=4)
    assert p.admit == ((1, 8),)  # 4 tokens left: too small a chunk for 2, and 3 does not overtake it


def test_a_prompt_alone_always_progresses():
    assert plan(8, decoding=8, filling=[(1, 40)], waiting=[], slots=0).fill == ((1, 2),)
    assert plan(8, decoding=0, filling=[], waiting=[(1, 3, True)], slots=1).admit == ((1, 3),)


def test_an_unchunkable_prompt_goes_whole_alone_or_waits():
    assert plan(8, 1, [], [(1, 20, False)], slots=2).admit == ((1, 20),)
    assert plan(8, 1, [], [(1, 3, True), (2, 20, False)], slots=2).admit == ((1, 3),)


def test_the_batch_size_bounds_admissions():
    assert plan(64, 0, [], [(1, 4, True), (2, 4, True), (3, 4, True)], slots=2).admit == ((1, 4), (2, 4))


def test_budget_never_exceeded_beyond_the_progress_guarantee():
    for decoding in range(0, 10):
        for lengths in ([1], [7, 9], [3, 30, 2], [100]):
            p = plan(8, decoding, [], [(i, n, True) for i, n in enumerate(lengths)], slots=8)
            used = decoding + sum(n for _, n in p.admit)
            assert used <= 8 or (len(p.admit) == 1 and p.admit[0][1] <= min_chunk(8))


def test_step_budget_counts_prefills():
    b = StepBudget(16, 0)
    assert b.grant(0) == 0 and b.grant(5) == 5 and b.prefills == 1 and b.left == 11


class _BM:
    def to_spec(self, uid, data):
        return SeqSpec(uid, tuple(data["prompt"]), 4, **data.get("kw", {}))


def _batch(prompts, budget=8, **kw):
    tb = TokenBatch(_BM(), 8, budget, chunked=True)
    queue = deque(SimpleNamespace(uid=u, data={"prompt": list(range(n)), "kw": kw}) for u, n in prompts)
    reqs = {u: Request(u, "m", None, None, 0.0, 0.0) for u, _ in prompts}
    return tb, queue, reqs


def test_master_chunks_a_long_prompt_and_gives_no_token_before_it_is_complete():
    tb, queue, reqs = _batch([(1, 3), (2, 20)])
    admit, _, _ = tb.next_step(queue, reqs)
    assert [(a.sid, a.chunk) for a in admit] == [(1, 0), (2, 5)] and tb.step_tokens == 8
    assert tb.filling == {2: (5, 20)}
    tb.on_step_done([1, 2], [7, 7], [])  # a token for 2 while it fills: not given
    assert reqs[1].tokens == [7] and reqs[2].tokens == []
    admit, _, _ = tb.next_step(queue, reqs)
    assert admit == [] and tb.fill == ((2, 7),) and tb.filling == {2: (12, 20)}
    assert tb.contexts() == {1: 4, 2: 12}
    tb.next_step(queue, reqs)
    assert tb.fill == ((2, 7),)
    tb.next_step(queue, reqs)
    assert tb.fill == ((2, 1),) and tb.filling == {}
    tb.on_step_done([1, 2], [8, 9], [])
    assert reqs[2].tokens == [9]


def test_cancel_of_a_sequence_mid_prefill():
    tb, queue, reqs = _batch([(1, 10), (2, 40)], budget=16)
    tb.next_step(queue, reqs)
    assert tb.filling == {2: (6, 40)}
    assert tb.cancel(2) is Cancelled.ON_WORKERS and tb.filling == {} and tb.take_drops() == (2,)
    tb.next_step(queue, reqs)
    assert tb.fill == () and tb.step_tokens == 0


def test_recompute_of_a_sequence_mid_prefill_restarts_its_prefill_whole():
    tb, queue, reqs = _batch([(1, 40)], budget=16)
    tb.next_step(queue, reqs)
    tb.next_step(queue, reqs)
    assert tb.filling == {1: (32, 40)}
    tb.pause([1], now=1.0)
    assert tb.filling == {} and tb.paused() == 1
    admit, _, _ = tb.next_step(queue, reqs)  # in one step: chunks restarted at every turn might never end
    assert [(a.sid, len(a.prompt), a.chunk) for a in admit] == [(1, 40, 0)] and tb.filling == {}


def test_prompt_logprobs_are_not_chunked():
    tb, queue, reqs = _batch([(1, 20)], prompt_logprobs=0)
    admit, _, _ = tb.next_step(queue, reqs)
    assert admit[0].chunk == 0 and tb.filling == {}
