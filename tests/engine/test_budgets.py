"""Byte budgets: models of different sizes share the device by bytes, not by count."""
import asyncio

import pytest
from helpers import greedy_reference

from computron import EngineConfig, LaunchEngine, LaunchError, ModelConfig, zoo

pytestmark = pytest.mark.timeout(300)
KV = 0.1


def _bytes(path):
    model = zoo.load_causal_lm(path)
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return model, total


def test_budget_holds_the_two_small_models_or_the_big_one(checkpoints, tmp_path):
    big_path = zoo.save_random_causal_lm("opt-small", str(tmp_path / "big"), seed=5)
    paths = {"small0": checkpoints["opt0"], "small1": checkpoints["opt1"], "big": big_path}
    refs, sizes = {}, {}
    for m, p in paths.items():
        refs[m], sizes[m] = _bytes(p)
    assert sizes["big"] > 1.5 * sizes["small0"]
    budget = int((sizes["big"] + sizes["small0"] / 2) * (1 + KV))
    configs = [ModelConfig(m, zoo.load_causal_lm, {"path": p}) for m, p in paths.items()]
    prompts = {m: [2, 11 + i, 12 + i] for i, m in enumerate(paths)}

    async def ask(engine, *models):
        outs = await asyncio.gather(*[engine.submit(m, {"input_ids": prompts[m], "max_tokens": 6}) for m in models])
        for m, out in zip(models, outs):
            assert out.tolist() == greedy_reference(refs[m], prompts[m], 6).tolist(), m

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=None, device_budget=budget, kv_reserve=KV), configs, 1, 1)
        async with engine:
            host = engine.workers[0].host_bytes
            for m in paths:  # the workers' own shard accounting agrees with the sizes the budget assumed
                assert host[m] == pytest.approx(sizes[m], rel=0.02), (m, host[m], sizes[m])
            await ask(engine, "small0", "small1")
            assert engine.model_states() == {"small0": "loaded", "small1": "loaded", "big": "offloaded"}
            await ask(engine, "big")
            assert engine.model_states() == {"small0": "offloaded", "small1": "offloaded", "big": "loaded"}
            await ask(engine, "small1", "big", "small0")
            loads = engine.metrics("load")
            assert len(loads) >= 4
            for r in loads:  # never over the budget, by the workers' own device accounting
                assert all(b <= budget for b in r.device_bytes.values()), (r.model_id, r.device_bytes, budget)
            assert engine.snapshot().models["big"].tier in ("host", "device")
    asyncio.run(go())


def test_models_that_can_never_fit_are_refused_at_launch(checkpoints):
    configs = [ModelConfig(m, zoo.load_causal_lm, {"path": checkpoints[m]}) for m in ("opt0", "llama0")]
    with pytest.raises(LaunchError, match=r"device_budget=1000 bytes per rank cannot hold model 'llama0' "
                                          r"\(\d+ bytes per rank.*model 'opt0' \(\d+ bytes"):
        LaunchEngine(EngineConfig(max_loaded=None, device_budget=1000), configs, 1, 1)
    with pytest.raises(ValueError, match="max_loaded"):
        EngineConfig(max_loaded=None)
    with pytest.raises(ValueError, match="device_budget"):
        EngineConfig(device_budget=1.5)
