"""Switching models between tokens: preempted sequences resume exactly where they stopped."""
import asyncio

import pytest
from helpers import greedy_reference

from computron import EngineConfig, LaunchEngine, ModelConfig, zoo

pytestmark = pytest.mark.timeout(300)


def _prompt(i):
    return [2] + [10 + (11 * i + k) % 400 for k in range(2 + i % 4)]


@pytest.mark.parametrize("kv_swap,tp,pp", [("offload", 2, 1), ("recompute", 1, 2)])
def test_preempted_sequences_equal_generate(checkpoints, kv_swap, tp, pp):
    paths = {"opt": checkpoints["opt0"], "llama": checkpoints["llama0"]}
    refs = {m: zoo.load_causal_lm(p) for m, p in paths.items()}
    configs = [ModelConfig(m, zoo.load_causal_lm, {"path": p}) for m, p in paths.items()]
    sampled = {"input_ids": [2, 30, 31], "max_tokens": 30, "temperature": 1.3, "top_k": 40, "seed": 11}
    jobs = [(m, {"input_ids": _prompt(i), "max_tokens": 24 + 5 * i}) for i in range(3) for m in paths]

    async def go():
        config = EngineConfig(max_loaded=1, policy="quantum", quantum_ms=60, kv_swap=kv_swap)
        engine = LaunchEngine(config, configs, tp, pp)
        async with engine:
            alone = await engine.submit("opt", sampled)  # nothing else running: never preempted
            outs = await asyncio.gather(engine.submit("opt", sampled),
                                        *[engine.submit(m, d) for m, d in jobs])
            stats = engine.stats()
            return alone, outs, engine.metrics(), stats, {r: w.host_bytes for r, w in engine.workers.items()}
    alone, outs, records, stats, shards = asyncio.run(go())
    assert outs[0].tolist() == alone.tolist()  # its sampling generator survived the preemptions
    for (m, d), out in zip(jobs, outs[1:]):
        assert out.tolist() == greedy_reference(refs[m], d["input_ids"], d["max_tokens"]).tolist(), (m, d)
    preemptions = [r for r in records if r.kind == "preemption"]
    assert len(preemptions) >= 2 and {p.model_id for p in preemptions} == {"opt", "llama"}
    reqs = [r for r in records if r.kind == "request" and r.error is None]
    assert max(r.preemptions for r in reqs) >= 2
    if kv_swap == "offload":
        assert all(p.recomputed == 0 and p.parked > 0 for p in preemptions)
        assert [r for r in records if r.kind == "kv_offload"] and [r for r in records if r.kind == "kv_restore"]
    else:
        assert all(p.parked == 0 and p.recomputed > 0 for p in preemptions)
        assert not [r for r in records if r.kind in ("kv_offload", "kv_restore")]
    # one model resident: right after each load a rank holds that model's shard (and at most the KV cache
    # of its own sequences, which a step overlapping the load may have started), never the other model
    for r in records:
        if r.kind == "load" and r.error is None:
            assert set(r.device_bytes) == set(range(tp * pp))
            for rank, b in r.device_bytes.items():
                other = min(v for m, v in shards[rank].items() if m != r.model_id)
                assert shards[rank][r.model_id] <= b < shards[rank][r.model_id] + other, (r, shards[rank])
    assert all(s.host_kv_bytes == 0 and s.kv_bytes == 0 for s in stats.values())  # all ended: all freed


def test_cancelling_a_parked_sequence_frees_its_host_cache(checkpoints):
    configs = [ModelConfig("low", zoo.load_causal_lm, {"path": checkpoints["opt0"]}),
               ModelConfig("high", zoo.load_causal_lm, {"path": checkpoints["opt1"]}, priority=1)]

    async def go():
        config = EngineConfig(max_loaded=1, policy="quantum", quantum_ms=20, kv_swap="offload")
        engine = LaunchEngine(config, configs, 1, 1)
        async with engine:
            low = engine.stream("low", {"input_ids": [2, 5, 6], "max_tokens": 500})
            await low.__anext__()
            high = engine.stream("high", {"input_ids": [2, 7], "max_tokens": 300})
            await high.__anext__()  # "high" runs: "low" was preempted, its sequence parked in host memory
            assert engine.model_states()["low"] == "offloaded"
            parked = engine.stats()
            assert sum(s.host_kv_bytes for s in parked.values()) > 0
            await low.aclose()  # cancelled while paused
            after = engine.stats()
            assert sum(s.host_kv_bytes for s in after.values()) == 0
            rest = [t async for t in high]
            assert len(rest) == 299 or rest[-1] == 2
            assert engine.counters()["preemptions"] == {"low": 1}
    asyncio.run(go())
