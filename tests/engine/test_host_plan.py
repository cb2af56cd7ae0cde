"""The models an engine keeps in host memory by plan (``Engine.set_host_models``, issue 21), on real workers.

Three tiny OPT checkpoints, one worker, ``host_budget`` room for two of the three shards: the planned model
is read from disk ahead of its load, and stays in host memory while the other two go through it (read
from disk for their loads, each sending the other back): under plain LRU it would be the first to go, as it
is the least recently used.
"""
import asyncio
import os

import pytest
from helpers import greedy_reference

from computron import EngineConfig, LaunchEngine, ModelConfig, UnknownModelError, zoo
from computron.comm import messages as msg

pytestmark = pytest.mark.timeout(300)

NAMES = ["opt0", "opt1", "opt2"]
PROMPT = [2, 5, 9, 14]


def test_a_planned_model_is_read_ahead_and_stays_in_host_memory(checkpoints):
    configs = [ModelConfig(m, zoo.load_causal_lm, {"path": checkpoints[m]}) for m in NAMES]
    file_bytes = os.path.getsize(os.path.join(checkpoints["opt0"], "model.safetensors"))
    budget = int(2.5 * file_bytes)  # two shards (each a little under its file), not three
    refs = {m: greedy_reference(checkpoints[m], PROMPT, 4).tolist() for m in NAMES}
    replies = []

    async def go():
        async with LaunchEngine(EngineConfig(max_loaded=1, host_budget=budget), configs, 1, 1) as engine:
            shard = engine.workers[0].host_bytes
            assert 2 * shard["opt0"] <= budget < sum(shard.values())
            engine.add_reply_observer(lambda r: isinstance(r, (msg.Loaded, msg.HostModelsSet)) and replies.append(r))
            before = engine.stats()[0]
            assert before.host_resident == ("opt0", "opt1") and before.host_kept == ()

            with pytest.raises(UnknownModelError, match="nope"):
                await engine.set_host_models(["opt2", "nope"])
            with pytest.raises(TypeError):
                await engine.set_host_models("opt2")
            assert not replies  # no rank heard of either

            assert await engine.set_host_models(["opt2"]) is True
            planned = engine.stats()[0]
            assert "opt2" in planned.host_resident and len(planned.host_resident) == 2
            assert planned.host_kept == ("opt2",)
            snap = engine.snapshot().models
            assert snap["opt2"].host_plan and snap["opt2"].tier == "host"
            assert not snap["opt0"].host_plan and snap["opt0"].host_bytes == shard["opt0"]

            for m in ["opt0", "opt1", "opt0", "opt1"]:
                out = await engine.submit(m, {"input_ids": PROMPT, "max_tokens": 4})
                assert out.tolist() == refs[m], m
            out = await engine.submit("opt2", {"input_ids": PROMPT, "max_tokens": 4})
            assert out.tolist() == refs["opt2"]
            return before, planned
    asyncio.run(go())
    answer = next(r for r in replies if isinstance(r, msg.HostModelsSet))
    assert answer.read == ("opt2",) and answer.no_room == () and not answer.failed
    loads = [r for r in replies if isinstance(r, msg.Loaded)]
    assert [r.model_id for r in loads] == ["opt0", "opt1", "opt0", "opt1", "opt2"]
    # the unplanned models went through host memory (one sent the other to disk), opt2 stayed there all along
    assert [r.tier for r in loads[:4]] == ["disk"] * 4, [(r.model_id, r.tier) for r in loads]
    assert all("opt2" in r.host_resident for r in loads), [(r.model_id, r.host_resident) for r in loads]
    assert loads[-1].tier == "host" and loads[-1].read_bytes == 0
