"""The engine on the paged KV pool (``EngineConfig(kv_cache='paged')``) equals the unsharded transformers
model: llama, qwen3 and gemma3_text (sliding window on half its layers) at TP=1, TP=2 and PP=2, three
models for two device slots (each is preempted between tokens: its sequences' KV blocks parked and
restored, or recomputed), prompts of mixed lengths arriving while others generate and leaving at
different lengths."""
import asyncio

import psutil
import pytest
from family_configs import FAMILIES
from helpers import greedy_reference, multiprocessing_servers
from test_families import KV_SWAP, LAYOUTS, REQUEST_TIMEOUT_S, _children, _hf, _model_config, _prompts

from computron import EngineConfig, LaunchEngine

SERVED = ("llama", "qwen3", "gemma3_text")
LENGTHS = (3, 11, 6, 17)
TOKENS = (12, 5, 9, 7)  # each request its own answer length: they leave the batch at different steps


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("paged-families"))
    return {name: FAMILIES[name](root) for name in SERVED}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def paged(request, ckpts):
    tp, pp = LAYOUTS[request.param]
    config = EngineConfig(max_loaded=2, max_batch_size=8, quantum_ms=1.0, kv_swap=KV_SWAP[request.param],
                          kv_cache="paged", kv_block_size=4)
    before = _children()
    engine = LaunchEngine(config, [_model_config(n, ckpts[n]) for n in SERVED], tp, pp)
    try:
        yield engine, request.param
    finally:
        engine.close()
        left = [psutil.Process(p) for p in _children() - before - multiprocessing_servers() if psutil.pid_exists(p)]
        _, alive = psutil.wait_procs(left, timeout=15)
        for p in alive:
            p.kill()
        assert not alive, f"the paged {request.param} engine left workers behind"


@pytest.mark.timeout(600)
def test_paged_engine_matches_hf_with_joins_leaves_and_preemption(paged, ckpts):
    engine, layout = paged
    prompts = {f: _prompts(f + "-paged", LENGTHS) for f in SERVED}

    async def one(family, i, wait_for=None):
        if wait_for is not None:
            await wait_for.wait()
        toks = []
        async for t in engine.stream(family, {"input_ids": prompts[family][i], "max_tokens": TOKENS[i]},
                                     timeout=REQUEST_TIMEOUT_S):
            toks.append(int(t))
        return family, i, toks

    async def go():
        first = {f: asyncio.Event() for f in SERVED}

        async def opener(family):  # the first request of each family; the others join once it produced
            toks = []
            async for t in engine.stream(family, {"input_ids": prompts[family][0], "max_tokens": TOKENS[0]},
                                         timeout=REQUEST_TIMEOUT_S):
                toks.append(int(t))
                if len(toks) == 2:
                    first[family].set()
            first[family].set()
            return family, 0, toks
        calls = [opener(f) for f in SERVED]
        calls += [one(f, i, first[f]) for f in SERVED for i in range(1, len(LENGTHS))]
        return await asyncio.gather(*calls)

    got = asyncio.run(go())
    for family, i, toks in got:
        want = greedy_reference(_hf(ckpts[family]), prompts[family][i], TOKENS[i]).tolist()
        assert toks == want, f"{family} {layout}, prompt {i} ({LENGTHS[i]} tokens): engine {toks} != {want}"
    swaps = [r for r in engine.metrics("load")]
    assert len(swaps) > len(SERVED), "three models for two slots: some model was swapped back in"



@pytest.mark.timeout(300)
def test_a_repeated_system_prompt_is_prefilled_once(paged, ckpts):
    """Two requests share a 20-token system prompt (five blocks of 4): the second, sent once the first ended,
    computes its own 3 tokens only, and both answers equal transformers' (each layout: every rank's pool
    caches the same blocks)."""
    engine, layout = paged
    system, tails = _prompts("llama-system", (20,))[0], _prompts("llama-tails", (3, 3))
    prompts = [system + t for t in tails]
    before = len(engine.metrics())

    async def go():
        outs = []
        for p in prompts:
            outs.append([int(t) async for t in engine.stream("llama", {"input_ids": p, "max_tokens": 6},
                                                              timeout=REQUEST_TIMEOUT_S)])
        return outs

    outs = asyncio.run(go())
    for p, toks in zip(prompts, outs):
        assert toks == greedy_reference(_hf(ckpts["llama"]), p, 6).tolist(), layout
    prefilled = [r.prefill_tokens for r in engine.metrics()[before:]
                 if r.kind == "step" and r.admitted and r.model_id == "llama"]
    assert prefilled == [23, 3], layout
