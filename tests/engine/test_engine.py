"""The engine end to end on CPU: swapping, ordering, concurrency, memory, bad input and faults."""
import asyncio
import os
import signal

import psutil
import pytest
import torch
from helpers import MLP_SIZES, big_mlp, greedy_reference, mlp, picky

from computron import (EngineConfig, EngineDeadError, LaunchEngine, LaunchError, ModelConfig, OPTBatchManager,
                       PayloadError, QueueFullError, UnknownModelError, WorkerError, zoo)

pytestmark = pytest.mark.timeout(300)


def mlp_configs(n):
    return [ModelConfig(f"m{i}", mlp, {"seed": i}) for i in range(n)]


def swap_events(engine):
    return [(r.kind, r.model_id) for r in engine.metrics() if r.kind in ("load", "offload")]


def test_round_robin_three_models_one_slot():
    x = torch.randn(3, MLP_SIZES[0])
    refs = [mlp(i)(x) for i in range(3)]

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=1), mlp_configs(3), 2, 1)
        async with engine:
            for k in range(7):
                out = await engine.submit(f"m{k % 3}", x)
                torch.testing.assert_close(out, refs[k % 3], rtol=1e-5, atol=1e-6)
                states = engine.model_states()
                assert states[f"m{k % 3}"] == "loaded"
                assert sum(s == "loaded" for s in states.values()) == 1
            return engine
    engine = asyncio.run(go())
    events = swap_events(engine)
    expected = [("load", "m0")]
    for k in range(1, 7):
        expected += [("offload", f"m{(k - 1) % 3}"), ("load", f"m{k % 3}")]
    assert events == expected
    loads = engine.metrics("load")
    assert len(loads) == 7 and len(engine.metrics("offload")) == 6 and len(engine.metrics("batch")) == 7
    assert all(set(r.rank_times) == {0, 1} for r in loads)  # every rank loaded its own shard


def test_lru_eviction_with_two_slots():
    x = torch.randn(2, MLP_SIZES[0])

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=2), mlp_configs(3), 1, 1)
        async with engine:
            for m in ["m0", "m1", "m0", "m2", "m1"]:
                await engine.submit(m, x)
            return engine
    engine = asyncio.run(go())
    # m1 is least recently used when m2 arrives; then m0 is when m1 comes back
    assert swap_events(engine) == [("load", "m0"), ("load", "m1"), ("offload", "m1"), ("load", "m2"),
                                   ("offload", "m0"), ("load", "m1")]


def test_resident_model_serves_while_another_loads():
    x = torch.randn(2, MLP_SIZES[0])
    configs = [ModelConfig("small", mlp, {"seed": 0}), ModelConfig("other", mlp, {"seed": 1}),
               ModelConfig("big", big_mlp)]

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=2), configs, 1, 1)
        async with engine:
            await engine.submit("small", x)
            await engine.submit("other", x)  # both slots full
            await engine.submit("small", x)  # 'other' is now least recently used
            big = asyncio.ensure_future(engine.submit("big", torch.randn(1, 4096)))
            while engine.model_states()["big"] != "loading":
                await asyncio.sleep(0)  # let the submit task run; no wall-clock wait
            small_during_load = await engine.submit("small", x)
            state_after_small = engine.model_states()["big"]
            await big
            return engine, small_during_load, state_after_small
    engine, out, state = asyncio.run(go())
    torch.testing.assert_close(out, mlp(0)(x))
    big_load = [r for r in engine.metrics("load") if r.model_id == "big"][0]
    small_batch = [r for r in engine.metrics("batch") if r.model_id == "small"][-1]
    assert state == "loading", "the small model's answer should come back before the big load finished"
    assert big_load.start < small_batch.start and small_batch.end < big_load.end


def test_fifty_concurrent_requests_over_three_models(checkpoints):
    bm = OPTBatchManager.for_config(zoo.hf_config("opt-tiny"), max_batch_size=4)
    configs = [ModelConfig(f"opt{s}", zoo.load_causal_lm, {"path": checkpoints[f"opt{s}"]}, batch_manager=bm)
               for s in range(3)]
    requests = [(f"opt{i % 3}", [3 + i % 7, 10 + i % 5, 30 + i % 11][: 1 + i % 3]) for i in range(50)]

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=2), configs, 2, 1)
        async with engine:
            return await asyncio.gather(*[engine.submit(m, {"input_ids": p, "max_tokens": 4})
                                          for m, p in requests]), engine
    outs, engine = asyncio.run(go())
    refs = {}
    for (m, p), out in zip(requests, outs):
        key = (m, tuple(p))
        if key not in refs:
            refs[key] = greedy_reference(checkpoints[m], p, 4).tolist()
        assert out.tolist() == refs[key], (m, p)
    assert len(engine.metrics("request")) == 50
    assert all(r.error is None for r in engine.metrics("request"))


@pytest.mark.parametrize("paper_mode", [False, True])
def test_device_bytes_return_to_baseline_after_offload(paper_mode):
    x = torch.randn(2, MLP_SIZES[0])

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=1, paper_mode=paper_mode), mlp_configs(2), 2, 1)
        async with engine:
            base = {r: s.device_bytes for r, s in engine.stats().items()}
            await engine.submit("m0", x)
            loaded = {r: s.device_bytes for r, s in engine.stats().items()}
            await engine.submit("m1", x)  # offloads m0
            await engine.submit("m0", x)  # offloads m1
            return engine, base, loaded, engine.stats()
    engine, base, loaded, after = asyncio.run(go())
    shard = sum(torch.numel(p) * 4 for p in mlp(0).parameters()) // 2  # TP=2 splits the Linear weights
    for rank in (0, 1):
        assert loaded[rank] - base[rank] >= shard * 0.9
        assert after[rank].resident == ("m0",)
        assert after[rank].device_bytes == loaded[rank]
    for rec in engine.metrics("offload"):
        assert all(b == base[r] for r, b in rec.device_bytes.items()), rec


def test_outputs_identical_after_many_swaps_and_in_paper_mode():
    x = torch.randn(4, MLP_SIZES[0])

    async def outputs(paper):
        engine = LaunchEngine(EngineConfig(max_loaded=1, paper_mode=paper), mlp_configs(2), 1, 2)
        async with engine:
            first = await engine.submit("m0", x)
            for k in range(10):
                await engine.submit(f"m{(k + 1) % 2}", x)
            last = await engine.submit("m0", x)
            return first, last, len(engine.metrics("load"))
    first, last, n_loads = asyncio.run(outputs(False))
    assert torch.equal(first, last) and n_loads == 11
    p_first, p_last, _ = asyncio.run(outputs(True))
    assert torch.equal(p_first, first) and torch.equal(p_last, first)


# ---- bad input: the request fails, the engine keeps serving --------------------------------------

def test_bad_requests_fail_alone():
    x = torch.ones(2, 4)
    configs = [ModelConfig("picky", picky), ModelConfig("m0", mlp, {"seed": 0}),
               ModelConfig("lm", zoo.random_causal_lm, {"name": "opt-tiny"})]  # batch manager from its config

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=3, queue_size=2), configs, 2, 1)
        async with engine:
            with pytest.raises(UnknownModelError, match="'nope'"):
                await engine.submit("nope", x)
            with pytest.raises(PayloadError, match="max_tokens"):
                await engine.submit("lm", {"input_ids": [1, 2], "max_tokens": -3})
            with pytest.raises(WorkerError, match="negative input is not allowed"):
                await engine.submit("picky", -x)
            with pytest.raises(WorkerError, match="takes a tensor batch"):
                await engine.submit("m0", "not a tensor")
            torch.testing.assert_close(await engine.submit("picky", x), 2 * x)
            # queue_size: the third waiting request is refused at once
            tasks = [asyncio.ensure_future(engine.submit("m0", torch.randn(1, MLP_SIZES[0]))) for _ in range(5)]
            results = await asyncio.gather(*tasks, return_exceptions=True)
            full = [r for r in results if isinstance(r, QueueFullError)]
            assert full and all("queue_size=2" in str(r) for r in full)
            assert all(isinstance(r, torch.Tensor) for r in results if not isinstance(r, QueueFullError))
            out = await engine.submit("lm", {"input_ids": [5, 6], "max_tokens": 3})
            assert out.tolist() == greedy_reference(zoo.random_causal_lm("opt-tiny"), [5, 6], 3).tolist()
            assert engine.is_alive
    asyncio.run(go())


def test_failing_model_fn_fails_launch():
    from helpers import failing_model_fn
    with pytest.raises(LaunchError, match="model_fn exploded on purpose"):
        LaunchEngine(EngineConfig(), [ModelConfig("bad", failing_model_fn)], 2, 1)
    # the process group was torn down: a new engine can start in the same process
    async def go():
        engine = LaunchEngine(EngineConfig(), mlp_configs(1), 1, 1)
        async with engine:
            return await engine.submit("m0", torch.zeros(1, MLP_SIZES[0]))
    assert asyncio.run(go()).shape == (1, MLP_SIZES[-1])


def test_killed_worker_fails_everything_quickly():
    configs = [ModelConfig("big", big_mlp), ModelConfig("m0", mlp, {"seed": 0})]

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=1), configs, 2, 1)
        try:
            pending = asyncio.ensure_future(engine.submit("big", torch.randn(1, 4096)))
            while engine.model_states()["big"] == "offloaded":
                await asyncio.sleep(0)
            os.kill(engine.workers[1].pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="rank 1"):
                await asyncio.wait_for(pending, 20)
            with pytest.raises(EngineDeadError):
                await engine.submit("m0", torch.zeros(1, MLP_SIZES[0]))
            assert not engine.is_alive
            # a server blocked in run() is released, and the surviving worker is shut down
            with pytest.raises(EngineDeadError, match="rank 1"):
                await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, engine.run), 30)
        finally:
            await engine.shutdown()
    asyncio.run(go())


def test_workers_fork_from_one_server_with_the_environment_of_their_launch(monkeypatch):
    """On a CPU, workers are forks of multiprocessing's fork server, which the first launch starts and later
    ones reuse; each worker still sees the master's environment of its own launch. ``spawn`` starts them
    as children of the master."""
    from multiprocessing import forkserver

    from helpers import env_scale

    async def serve(scale, **config):
        monkeypatch.setenv("COMPUTRON_TEST_SCALE", scale)
        async with LaunchEngine(EngineConfig(**config), [ModelConfig("s", env_scale)], 1, 1) as engine:
            return await engine.submit("s", torch.ones(1, 4)), psutil.Process(engine.workers[0].pid).ppid()
    (two, parent_a), (three, parent_b) = asyncio.run(serve("2")), asyncio.run(serve("3"))
    assert parent_a == parent_b == forkserver._forkserver._forkserver_pid != os.getpid()
    assert torch.equal(two, torch.full((1, 4), 2.0)) and torch.equal(three, torch.full((1, 4), 3.0))
    five, parent = asyncio.run(serve("5", start_method="spawn"))
    assert parent == os.getpid() and torch.equal(five, torch.full((1, 4), 5.0))


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="start_method"):
        EngineConfig(start_method="fork")
    with pytest.raises(ValueError, match="max_loaded"):
        EngineConfig(max_loaded=0)
    with pytest.raises(ValueError, match="queue_size"):
        EngineConfig(queue_size=-1)
    with pytest.raises(ValueError, match="backend"):
        EngineConfig(backend="mpi")
    with pytest.raises(ValueError, match="model_fn"):
        ModelConfig("x", model_fn=3)
    with pytest.raises(ValueError, match="duplicate model_id 'a'"):
        LaunchEngine(EngineConfig(), [ModelConfig("a", mlp), ModelConfig("a", mlp)])
    with pytest.raises(ValueError, match="tp_world_size"):
        LaunchEngine(EngineConfig(), [ModelConfig("a", mlp)], tp_world_size=0)


def _residency(engine, rank):
    """Per model on one rank: [(load start, offload end)] on that rank's clock."""
    spans = []
    loads = [r for r in engine.metrics("load") if rank in r.rank_times]
    offloads = [r for r in engine.metrics("offload") if rank in r.rank_times]
    for load in loads:
        start = load.rank_times[rank][0]
        ends = [o.rank_times[rank][1] for o in offloads
                if o.model_id == load.model_id and o.rank_times[rank][1] >= start]
        spans.append((load.model_id, start, min(ends) if ends else float("inf")))
    return spans


@pytest.mark.parametrize("max_loaded", [1, 2])
def test_prefetch_never_evicts_busy_models_nor_exceeds_slots(max_loaded):
    x = torch.randn(2, MLP_SIZES[0])
    refs = [mlp(i)(x) for i in range(3)]

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=max_loaded, prefetch=True), mlp_configs(3), 1, 2)
        async with engine:
            for wave in range(4):
                names = [f"m{(wave + k) % 3}" for k in range(3)]
                outs = await asyncio.gather(*[engine.submit(m, x) for m in names for _ in range(2)])
                for m, out in zip([m for m in names for _ in range(2)], outs):
                    torch.testing.assert_close(out, refs[int(m[1])])
            return engine
    engine = asyncio.run(go())
    batches = engine.metrics("batch")
    for rank in (0, 1):
        spans = _residency(engine, rank)
        for _, start, _ in spans:  # at every load start, count models resident on this rank
            resident = [m for m, a, b in spans if a <= start < b]
            assert len(resident) <= max_loaded, (rank, resident)
        for b in batches:  # every batch ran while its model was resident on this rank
            s, e = b.rank_times[rank]
            assert any(m == b.model_id and a <= s and e <= z for m, a, z in spans), (rank, b)
    # prefetch really happened: some load was sent before the previous model's last batch had returned
    overlapped = [ld for ld in engine.metrics("load")
                  if any(b.start < ld.start < b.end and b.model_id != ld.model_id for b in batches)]
    assert overlapped
