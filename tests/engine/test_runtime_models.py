"""Models added, replaced and removed while real workers serve: the new shards answer exactly as the
unsharded transformers model of their checkpoint does, and a removed model's memory is freed on every
rank."""
import asyncio

import pytest
from helpers import failing_model_fn, greedy_reference

from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
from computron.errors import ModelChangeError, UnknownModelError

PROMPT = [5, 6, 7, 8]
N = 6


def lm(model_id, path, **kw):
    return ModelConfig(model_id, zoo.load_causal_lm, {"path": path}, **kw)


async def greedy(engine, model_id):
    return (await engine.submit(model_id, {"input_ids": PROMPT, "max_tokens": N})).tolist()


def held(stats):
    return {r: (s.host_bytes, s.device_bytes, s.kv_bytes, s.host_kv_bytes) for r, s in stats.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_add_replace_remove_while_serving_matches_hf_and_frees_memory(checkpoints, tp, pp):
    refs = {k: greedy_reference(checkpoints[k], PROMPT, N).tolist() for k in ("opt0", "opt1", "opt2", "llama0")}

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=2), [lm("a", checkpoints["opt0"])], tp, pp)
        async with engine:
            start = held(await engine.stats_async())
            assert await greedy(engine, "a") == refs["opt0"]
            # a model added while another generates
            going = asyncio.ensure_future(engine.submit("a", {"input_ids": PROMPT, "max_tokens": 40}))
            await engine.add_model(lm("b", checkpoints["opt1"]))
            await engine.add_model(lm("c", checkpoints["llama0"]))
            assert (await going).tolist()[:N] == refs["opt0"]
            assert engine.model_ids == ["a", "b", "c"]
            assert await greedy(engine, "b") == refs["opt1"]
            assert await greedy(engine, "c") == refs["llama0"]
            # a new version: requests admitted before keep the old weights
            old = asyncio.ensure_future(greedy(engine, "b"))
            await asyncio.sleep(0)  # a yield point: the request is admitted under version 1
            await engine.replace_model("b", lm("b", checkpoints["opt2"]))
            assert await old == refs["opt1"]
            assert await greedy(engine, "b") == refs["opt2"]
            assert engine.snapshot().models["b"].version == 2
            # a build that fails on the workers leaves the engine serving
            with pytest.raises(ModelChangeError, match="model_fn exploded on purpose"):
                await engine.add_model(ModelConfig("bad", failing_model_fn))
            for m in ("b", "c"):
                await engine.remove_model(m)
            with pytest.raises(UnknownModelError):
                await greedy(engine, "b")
            await engine.remove_model("a")
            end = held(await engine.stats_async())
            assert engine.model_ids == []
            return start, end
    start, end = asyncio.run(go())
    for r in start:
        host0, dev0, kv0, hkv0 = start[r]
        host1, dev1, kv1, hkv1 = end[r]
        assert host1 == 0 and dev1 == 0 and kv1 == 0 and hkv1 == 0, (r, end[r])
        assert host0 > 0, start
