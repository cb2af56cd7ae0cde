"""Token-level generation: streaming, per-sequence sampling, cancellation, interleaving, step failures."""
import asyncio

import pytest
from helpers import POISON_TOKEN, greedy_reference, late_poisoned_lm, poisoned_lm

from computron import EngineConfig, LaunchEngine, ModelConfig, WorkerError, zoo

pytestmark = pytest.mark.timeout(300)


def _prompt(i):
    return [2] + [10 + (7 * i + k) % 400 for k in range(3 + i % 5)]


async def _collect(engine, model_id, data):
    return [t async for t in engine.stream(model_id, data)]


def _weights_bytes(engine):
    return {r: s.device_bytes for r, s in engine.stats().items()}


def test_streams_sampling_cancellation_and_interleaving(checkpoints):
    """Two resident models over two pipeline stages."""
    paths = {"a": checkpoints["opt0"], "b": checkpoints["opt1"]}
    configs = [ModelConfig(m, zoo.load_causal_lm, {"path": p}) for m, p in paths.items()]
    refs = {m: zoo.load_causal_lm(p) for m, p in paths.items()}
    sampled = {"input_ids": [2, 50, 60, 70], "max_tokens": 12, "temperature": 1.5, "top_k": 50, "seed": 7}

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=2, max_batch_size=8), configs, 1, 2)
        async with engine:
            # a seeded sequence samples the same tokens alone and inside a busy batch
            alone = await engine.submit("a", sampled)
            busy = [asyncio.create_task(_collect(engine, "a", {"input_ids": _prompt(i), "max_tokens": 20}))
                    for i in range(5)]
            in_batch = await engine.submit("a", sampled)
            await asyncio.gather(*busy)
            assert in_batch.tolist() == alone.tolist()
            assert len(alone) == 12 or alone[-1].item() == 2

            # stream yields exactly what submit returns
            data = {"input_ids": _prompt(3), "max_tokens": 10}
            assert await _collect(engine, "b", data) == (await engine.submit("b", data)).tolist()

            # cancelling a stream mid-way frees its cache; the other sequences are unchanged
            baseline = _weights_bytes(engine)
            long = engine.stream("a", {"input_ids": _prompt(1), "max_tokens": 400})
            others = [asyncio.create_task(engine.submit("a", {"input_ids": _prompt(i), "max_tokens": 15}))
                      for i in range(2)]
            got = []
            async for t in long:
                got.append(t)
                if len(got) == 3:
                    break
            await long.aclose()
            for i, task in enumerate(others):
                assert (await task).tolist() == greedy_reference(refs["a"], _prompt(i), 15).tolist()
            assert got == greedy_reference(refs["a"], _prompt(1), 3).tolist()
            await engine.submit("a", {"input_ids": [2, 3], "max_tokens": 1})  # a step after the drop
            assert _weights_bytes(engine) == baseline
            steps = engine.metrics("step")
            assert sum(s.dropped for s in steps) >= 1
            assert steps[-1].kv_bytes == 0

            # 50 concurrent streams over two resident models: every answer right, steps interleaved
            n0 = len(engine.metrics("step"))
            jobs = [("ab"[i % 2], {"input_ids": _prompt(i), "max_tokens": 6 + i % 9}) for i in range(50)]
            outs = await asyncio.gather(*[_collect(engine, m, d) for m, d in jobs])
            for (m, d), out in zip(jobs, outs):
                assert out == greedy_reference(refs[m], d["input_ids"], d["max_tokens"]).tolist()
            order = [s.model_id for s in engine.metrics("step")[n0:]]
            last_a, last_b = max(i for i, m in enumerate(order) if m == "a"), \
                max(i for i, m in enumerate(order) if m == "b")
            both = order[:min(last_a, last_b)]
            switches = sum(1 for x, y in zip(both, both[1:]) if x != y)
            assert switches >= 0.9 * (len(both) - 1), order  # they alternate while both have work
            assert {r.model_id for r in engine.metrics("load")} == {"a", "b"}  # nothing swapped
            reqs = [r for r in engine.metrics("request") if r.error is None]
            assert all(r.ttft is not None and r.ttft <= r.latency for r in reqs)
    asyncio.run(go())


def test_failing_step_fails_only_its_model(checkpoints):
    configs = [ModelConfig("bad", poisoned_lm, {"path": checkpoints["opt0"]}),
               ModelConfig("good", zoo.load_causal_lm, {"path": checkpoints["opt1"]})]
    good_ref = zoo.load_causal_lm(checkpoints["opt1"])
    bad_ref = zoo.load_causal_lm(checkpoints["opt0"])

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=2), configs, 1, 2)
        async with engine:
            running_bad = [asyncio.create_task(engine.submit("bad", {"input_ids": _prompt(i), "max_tokens": 200}))
                           for i in range(2)]
            good = [asyncio.create_task(engine.submit("good", {"input_ids": _prompt(i), "max_tokens": 30}))
                    for i in range(3)]
            first = engine.stream("bad", {"input_ids": _prompt(5), "max_tokens": 200})
            await first.__anext__()  # the bad model's batch is running
            with pytest.raises(WorkerError, match="poison"):
                await engine.submit("bad", {"input_ids": [2, POISON_TOKEN], "max_tokens": 4})
            for t in running_bad:
                with pytest.raises(WorkerError, match="poison"):
                    await t
            with pytest.raises(WorkerError, match="poison"):
                async for _ in first:
                    pass
            for i, t in enumerate(good):
                assert (await t).tolist() == greedy_reference(good_ref, _prompt(i), 30).tolist()
            after = await engine.submit("bad", {"input_ids": _prompt(7), "max_tokens": 8})
            assert after.tolist() == greedy_reference(bad_ref, _prompt(7), 8).tolist()
            assert engine.is_alive
    asyncio.run(go())


def test_a_decode_step_failing_with_one_sent_ahead_aborts_that_one_on_every_rank(checkpoints):
    """PP=2, each decode step sent as soon as the one before it (a lead longer than any step): the fourth
    decode step fails on the first stage; the step already sent behind it runs on no rank (their batches
    may differ until the master's realigning drop, queued behind it), the request fails with the first
    error, and the model serves the next request right."""
    ref = zoo.load_causal_lm(checkpoints["opt0"])

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=1, step_ahead_lead_ms=60_000),
                              [ModelConfig("m", late_poisoned_lm, {"path": checkpoints["opt0"]})], 1, 2)
        async with engine:
            with pytest.raises(WorkerError, match="decode 4 is poison"):
                await engine.submit("m", {"input_ids": _prompt(0), "max_tokens": 12})
            after = await engine.submit("m", {"input_ids": _prompt(1), "max_tokens": 8})
            assert after.tolist() == greedy_reference(ref, _prompt(1), 8).tolist()
            errors = [r.error for r in engine.metrics("step") if r.error]
            assert len(errors) == 2, errors
            assert "decode 4 is poison" in errors[0] and "the step it was sent behind failed" in errors[1]
            assert engine.is_alive
    asyncio.run(go())
